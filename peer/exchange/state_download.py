"""Download a replica state from one peer this peer chose, every byte bounded.

hivemind's ``load_state_from_peers`` downloads from whichever peer declares the highest priority in
the DHT (any peer can declare any number) and reads whatever a frame header announces. Here the
caller (peer/round/state_sync.py) names the peer, and the answer of hivemind's ``rpc_download_state`` is
read frame by frame with limits: a frame at most ``MAX_FRAME_BYTES``, the whole answer at most what
this run's state can weigh (θ and the shared state in float32, plus the metadata), tensors only in
float32 without compression (what every honest peer serves), each whole and of the size its shape
says. The call runs on its own event loop in a helper thread, over a replica of the DHT's p2p
daemon, with a deadline for the whole download.
"""

from __future__ import annotations

import asyncio
import math
from contextlib import closing
from typing import Any, List, Optional, Tuple

import torch
from google.protobuf.message import DecodeError
from hivemind.dht import DHT
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError
from hivemind.utils.streaming import STREAMING_CHUNK_SIZE_BYTES

from protocol.wire.bounded_unpack import bounded_unpack
from protocol.errors import ProtocolError
from protocol.round.timing import Timing
from swarm.loop_thread import run_in_fresh_loop

MAX_METADATA_BYTES = 1 << 20
MAX_FRAME_BYTES = (4 << 20) + MAX_METADATA_BYTES  # hivemind streams 64 KiB parts; its messages stay under 4 MiB
MAX_DIMS = 8  # sides of a served tensor


class StateDownloadError(ProtocolError):
    """A peer's answer to a state download that this peer does not read any further."""


class StateServerBusy(StateDownloadError):
    """The peer serves as many downloads as it will now (protocol/round/serve_gate.py): ask again later."""


async def _frames(reader: asyncio.StreamReader, limit: int, timeout: float):
    """The protobuf frames of a stream answer (hivemind's framing: a marker, an 8-byte length, the bytes)."""
    total = 0
    while True:
        try:
            marker = await asyncio.wait_for(reader.readexactly(1), timeout)
        except asyncio.IncompleteReadError:  # the handler finished
            return
        try:
            size = int.from_bytes(await asyncio.wait_for(reader.readexactly(P2P.HEADER_LEN), timeout), P2P.BYTEORDER)
            total += size
            if size > MAX_FRAME_BYTES or total > limit:
                raise StateDownloadError(f"announced a frame of {size} bytes ({total} in all; at most {limit})")
            data = await asyncio.wait_for(reader.readexactly(size), timeout)
        except asyncio.IncompleteReadError:
            raise StateDownloadError("cut its answer off inside a frame") from None
        try:
            if marker == P2P.ERROR_MARKER:
                message = RPCError.FromString(data).message
                if message:
                    raise StateDownloadError(f"failed: {message[:200]}")
                return
            yield averaging_pb2.DownloadData.FromString(data)
        except DecodeError:
            raise StateDownloadError("sent a frame that is not a protobuf message") from None


def _tensor(parts: List[runtime_pb2.Tensor], max_numel: int) -> torch.Tensor:
    head = parts[0]
    if head.compression != runtime_pb2.CompressionType.NONE or head.dtype != "float32":
        raise StateDownloadError(f"sent a tensor as {head.dtype or '?'} with compression {head.compression} (only float32, uncompressed)")
    shape = [int(s) for s in head.size]
    # an empty tensor's other sides are bounded too: torch cannot even lay out some shapes of no elements
    if len(shape) > MAX_DIMS or any(s < 0 for s in shape) or math.prod(max(1, s) for s in shape) > max_numel:
        raise StateDownloadError(f"sent a tensor of shape {shape[:MAX_DIMS + 1]} (at most {MAX_DIMS} sides, {max_numel} values)")
    buffer = bytearray(b"".join(p.buffer for p in parts))
    if len(buffer) != 4 * math.prod(shape):
        raise StateDownloadError(f"sent {len(buffer)} bytes for a float32 tensor of shape {shape}")
    return torch.frombuffer(buffer, dtype=torch.float32).reshape(shape) if buffer else torch.zeros(shape)


async def _read_state(messages, limit: int, max_tensors: int) -> Tuple[Optional[bytes], List[torch.Tensor]]:
    """(metadata, tensors) from a state answer's messages. Besides its bytes (``limit``), the answer's
    count of tensors and of parts is bounded, by what an honest server sends: ``max_tensors``, and
    hivemind's parts of 64 KiB. Each part held costs far more memory than its bytes on the wire, so a
    server of many empty parts otherwise grew this process by 50x the limit
    (tests/exchange/test_state_download.py)."""
    max_parts = limit // STREAMING_CHUNK_SIZE_BYTES + max_tensors + 64
    metadata: Optional[bytes] = None
    tensors: List[torch.Tensor] = []
    parts: List[runtime_pb2.Tensor] = []
    count = 0
    async for message in messages:
        count += 1  # every message, parts or not: a stream of empty frames ends here too
        if count > max_parts:
            raise StateDownloadError(f"sent more than {max_parts} messages")
        if message.metadata:
            if metadata is not None or len(message.metadata) > MAX_METADATA_BYTES:
                raise StateDownloadError("sent its metadata twice or too large")
            metadata = message.metadata
        if not message.HasField("tensor_part"):  # metadata alone (a busy server's answer)
            continue
        part = message.tensor_part
        if part.dtype and parts:  # a new tensor begins
            tensors.append(_tensor(parts, limit // 4))
            parts = []
        if not part.dtype and not parts:
            raise StateDownloadError("sent a tensor part before any tensor began")
        if part.dtype and len(tensors) >= max_tensors:
            raise StateDownloadError(f"sent more than the {max_tensors} tensors of this run's state")
        parts.append(part)
    if parts:
        tensors.append(_tensor(parts, limit // 4))
    return metadata, tensors


async def _download(maddr, handle: str, peer: str, limit: int, timeout: float,
                    max_tensors: int) -> Tuple[Any, List[torch.Tensor]]:
    p2p = await P2P.replicate(maddr)
    try:
        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer), handle)
        with closing(writer):
            await P2P.send_protobuf(averaging_pb2.DownloadRequest(), writer)
            await P2P.send_protobuf(P2P.END_OF_STREAM, writer)
            metadata, tensors = await _read_state(_frames(reader, limit, timeout), limit, max_tensors)
    finally:
        await p2p.shutdown()
    if metadata is None:
        raise StateDownloadError("served no state (it shares none yet, or does not admit us)")
    n = len(metadata)
    meta = bounded_unpack(metadata, StateDownloadError, "state metadata", max_array_len=n, max_map_len=n)
    if not tensors and isinstance(meta, dict) and "busy" in meta:
        raise StateServerBusy(f"busy: {str(meta['busy'])[:200]}")
    return meta, tensors


class StateDownloader:
    """Downloads through the DHT's p2p daemon from the peer the caller names."""

    def __init__(self, dht, gatherer, min_rate: float = Timing.download_min_rate):
        self.min_rate = min_rate  # bytes/s: the slowest download allowed, on top of the per-frame timeout
        self.dht = dht
        self.handle = type(gatherer)._get_handle_name(gatherer.prefix, "rpc_download_state")
        self._maddr = None

    def __call__(self, peer: str, expected_bytes: int, timeout: float, tensors: int) -> Tuple[Any, List[torch.Tensor]]:
        """(metadata, tensors) of ``peer``'s state, which holds ``tensors`` tensors of ``expected_bytes`` in
        all; StateDownloadError (or an OSError, a timeout) if it fails."""
        if self._maddr is None:
            self._maddr = self.dht.run_coroutine(DHT._get_p2p_daemon_listen_maddr)
        limit = expected_bytes + MAX_METADATA_BYTES + 64 * (expected_bytes // (1 << 16) + 64)  # framing per 64 KiB part
        deadline = timeout + expected_bytes / self.min_rate
        coro = asyncio.wait_for(_download(self._maddr, self.handle, peer, limit, timeout, tensors), deadline)
        return run_in_fresh_loop(coro, "state-download")  # the caller may be inside an event loop
