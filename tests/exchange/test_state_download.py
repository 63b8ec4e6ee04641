"""Reading a state another peer serves (peer/exchange/state_download.py): whatever a hostile server
streams, the reader holds no more than a bound that the run's state sets, and every refusal is a
StateDownloadError that says what was wrong."""

from __future__ import annotations

import asyncio
import tracemalloc

import pytest
import torch
from hivemind.p2p import P2P
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.streaming import split_for_streaming

from peer.exchange.state_download import StateDownloadError, _frames, _read_state

LIMIT = 1 << 20


def frame(message) -> bytes:
    data = message.SerializeToString()
    return P2P.MESSAGE_MARKER + len(data).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + data


def served(tensors, metadata=b"\x80") -> bytes:
    """What an honest server streams: hivemind's parts of each tensor, the metadata on the first."""
    out = b""
    for tensor in tensors:
        head = runtime_pb2.Tensor(buffer=tensor.numpy().tobytes(), size=list(tensor.shape), dtype="float32")
        for part in split_for_streaming(head):
            out += frame(averaging_pb2.DownloadData(tensor_part=part, metadata=metadata))
            metadata = b""
    return out


def read(data: bytes, max_tensors: int = 2, limit: int = LIMIT):
    async def go():
        reader = asyncio.StreamReader(limit=1 << 40)
        reader.feed_data(data)
        reader.feed_eof()
        return await _read_state(_frames(reader, limit, 5.0), limit, max_tensors)
    return asyncio.run(go())


def test_an_honest_state_of_many_parts_is_read_whole():
    theta, big = torch.arange(12, dtype=torch.float32).reshape(3, 4), torch.randn(100_000)  # 7 parts of 64 KiB
    metadata, tensors = read(served([theta, big]))
    assert metadata == b"\x80" and torch.equal(tensors[0], theta) and torch.equal(tensors[1], big)


def test_many_empty_parts_are_refused_before_they_cost_more_than_the_limit():
    empty = frame(averaging_pb2.DownloadData(tensor_part=runtime_pb2.Tensor(buffer=b"")))
    head = frame(averaging_pb2.DownloadData(tensor_part=runtime_pb2.Tensor(buffer=b"", size=[0], dtype="float32"),
                                            metadata=b"\x80"))
    tracemalloc.start()
    try:
        with pytest.raises(StateDownloadError, match="messages"):
            read(head + empty * 140_000)  # 1.5 MiB on the wire, within the byte limit of its frames
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 40 * LIMIT  # the stream's own bytes and the parts of the bound, not one object a frame


@pytest.mark.parametrize("data,match", [
    (served([torch.zeros(2)] * 3), "more than the 2 tensors"),
    (frame(averaging_pb2.DownloadData(tensor_part=runtime_pb2.Tensor(buffer=b"x"), metadata=b"\x80")), "before any tensor"),
    (frame(averaging_pb2.DownloadData(tensor_part=runtime_pb2.Tensor(size=[0, 2**32 - 1, 2**32 - 1], dtype="float32"),
                                      metadata=b"\x80")), "shape"),
    (frame(averaging_pb2.DownloadData(tensor_part=runtime_pb2.Tensor(size=[1] * 9, dtype="float32"))), "sides"),
    (P2P.MESSAGE_MARKER + (5).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"\xff\xff\xff\xff\xff", "not a protobuf"),
    (served([torch.zeros(2)])[:-3], "cut its answer off"),
    ((P2P.MESSAGE_MARKER + bytes(P2P.HEADER_LEN)) * 100_000, "messages"),  # empty frames weigh no bytes
])
def test_a_malformed_answer_is_a_state_download_error(data, match):
    with pytest.raises(StateDownloadError, match=match):
        read(data)
