"""swarm/stream_frames.py: a stream message's size is bounded at its header."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.p2p import P2P
from hivemind.proto import averaging_pb2

from swarm import stream_frames
from swarm.stream_frames import MAX_MESSAGE_BYTES, MessageTooLarge, bounded_receive_raw_data


def _reader(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


def test_a_message_announced_past_the_bound_is_refused_at_its_header():
    """A stranger that announced 2^40 bytes and kept sending had everything it sent kept."""
    async def go():
        reader = _reader((1 << 40).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"x" * 1000)
        with pytest.raises(MessageTooLarge):
            await bounded_receive_raw_data(reader)
        return len(reader._buffer)

    assert asyncio.run(go()) == 1000  # nothing past the header was read


def test_messages_within_the_bound_read_as_hivemind_reads_them(monkeypatch):
    monkeypatch.setattr(P2P, "receive_raw_data", P2P.__dict__["receive_raw_data"])  # put back after the test
    stream_frames.install()
    message = averaging_pb2.AveragingData(group_id=b"g" * 40)
    body = message.SerializeToString()
    framed = P2P.MESSAGE_MARKER + len(body).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body

    async def read(data: bytes):
        return await P2P.receive_protobuf(averaging_pb2.AveragingData, _reader(data))

    got, error = asyncio.run(read(framed))
    assert got == message and error is None
    with pytest.raises(MessageTooLarge):
        asyncio.run(read(P2P.MESSAGE_MARKER + (MAX_MESSAGE_BYTES + 1).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)))
