"""Serving this peer's replica state to peers that download it (peer/exchange/state_download.py).

A mixin of peer/exchange/gatherer.py's ``PayloadGatherer``: what hivemind's ``rpc_download_state`` serves,
while state sharing is allowed (peer/round/state_sync.py turns it on once the state is the group's),
is ``get_current_state``, here ``state_provider()``, set by the runtime. Each download is admitted by a
``ServeGate`` first (protocol/round/serve_gate.py): a few at once, strangers never all of them, a few a
peer within a window, one at a time. A refused one is answered "busy" (metadata ``{"busy": why}`` and no
tensor), and one that falls behind the slowest rate a downloader accepts is cut off.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator, Callable, Optional, Sequence, Tuple

import msgpack
import torch
from hivemind.compression import CompressionInfo
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils.streaming import split_for_streaming

from peer.exchange.bounds import StallCut
from swarm.refusal_log import RefusalLog
from protocol.round.serve_gate import ServeGate

logger = logging.getLogger(__name__)

REFUSALS_LOGGED_EVERY = 60.0  # seconds: a refused peer is logged once within this, however often it asks


class StateServing:
    """What a late joiner downloads from this peer, and no DHT declaration of it."""

    state_provider: Optional[Callable[[], Tuple[Any, Sequence[torch.Tensor]]]] = None
    _serve_gate: Optional[ServeGate] = None  # made in the averager process, where downloads are served
    _mates: frozenset = frozenset()  # the members of our last group (base58): no strangers to us

    def get_current_state(self):
        """Called in this (host) process when a late joiner downloads our state."""
        if self.state_provider is None:
            raise RuntimeError("this peer has no state to share yet")
        return self.state_provider()

    async def rpc_download_state(self, _request: averaging_pb2.DownloadRequest,
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        """hivemind's answer, once the gate admits the download, within its lease
        (tests/exchange/test_state_serving.py)."""
        if not self.allow_state_sharing:
            return
        t = self.timing
        if self._serve_gate is None:
            self._serve_gate = ServeGate(t.serves_at_once, t.serves_per_peer, t.serve_window_s, lease=t.gather_slot_s)
        peer = context.remote_id.to_base58()
        known = self._known  # None before our first gather: nobody is a stranger yet
        stranger = known is not None and peer not in known and peer not in self._mates
        slot, why = self._serve_gate.admit(peer, time.monotonic(), stranger)
        if slot is None:
            self._log_refusal(peer, why)
            yield averaging_pb2.DownloadData(metadata=msgpack.packb({"busy": why}))
            return
        # hivemind puts no deadline on the serving side: a stream that stalls (a downloader that stops reading)
        # is cut once it falls behind the slowest rate a downloader accepts, or a gather slot passes without
        # a part sent (the downloader's own limits: peer/exchange/state_download.py); its slot's lease follows
        task = asyncio.current_task()
        watchdog = StallCut(t, lambda: self._cut(peer, task))
        # the host copies θ and the shared state whether or not the asker still waits: a download left at
        # once keeps its place until that copy is done, or the gate would bound streams, not copies
        # (tests/exchange/test_state_serving.py::test_a_download_left_at_once_keeps_its_place_until_the_host_answered)
        fetch = asyncio.ensure_future(self._get_current_state_from_host_process())
        try:
            try:
                metadata, tensors, infos = await asyncio.shield(fetch)
            except asyncio.CancelledError:
                gate, held, slot = self._serve_gate, slot, None
                fetch.add_done_callback(lambda f: (f.cancelled() or f.exception(), gate.release(held)))
                raise
            if infos is None:
                infos = [CompressionInfo.from_tensor(tensor, key=i) for i, tensor in enumerate(tensors)]
            watchdog.begin()
            sent = 0
            for tensor, info in zip(tensors, infos):
                for part in split_for_streaming(self.state_compression.compress(tensor, info, allow_inplace=False)):
                    sent += len(part.buffer)
                    self._serve_gate.hold(slot, watchdog.sent(sent))
                    yield averaging_pb2.DownloadData(tensor_part=part, metadata=metadata or b"")
                    metadata = None
        finally:
            watchdog.cancel()
            if slot is not None:
                self._serve_gate.release(slot)

    @staticmethod
    def _cut(peer: str, task: asyncio.Task) -> None:
        logger.info(f"cut the state download of {peer}: it fell behind the slowest rate a download may take, "
                    f"or sent no part for a gather slot")
        task.cancel()

    def _log_refusal(self, peer: str, why: str) -> None:
        """One line a peer within ``REFUSALS_LOGGED_EVERY`` s, for 16 peers at most; a count for the rest."""
        log = self.__dict__.get("_refusals") or self.__dict__.setdefault(
            "_refusals", RefusalLog(logger.info, 16, REFUSALS_LOGGED_EVERY))
        log.note(peer, f"not serving our state to {peer} now: {why}",
                 lambda n, seconds: f"not serving our state to {n} more downloads in the last {seconds:.0f} s")

    async def _declare_for_download_periodically(self):
        """Nothing. hivemind stores each peer as a state source under one DHT key every
        ``declare_state_period`` (in a large swarm, many stores a second to one key of a subkey per
        peer, which time out under load) for its own loader, which trusts the highest priority anyone
        declares. A voloco peer names the peer it downloads from out of the progress records
        (peer/round/state_sync.py) and never reads that key; ``rpc_download_state`` still serves while state sharing is allowed."""
