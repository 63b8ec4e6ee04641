"""Serving this peer's replica state to peers that download it (peer/round/state_download.py).

A mixin of peer/exchange/gatherer.py's ``PayloadGatherer``: hivemind's ``rpc_download_state`` serves what
``get_current_state`` returns while state sharing is allowed (peer/round/state_sync.py turns it on once
the state is the group's), here ``state_provider()``, set by the runtime. Each download is admitted by
a ``ServeGate`` first (protocol/round/serve_gate.py): a few at once, a few per peer within a window, one
slot kept for peers of our rounds; a refused one ends with no state, as a peer that does not share.
"""

from __future__ import annotations

import logging
import time
from typing import Any, AsyncIterator, Callable, Optional, Sequence, Tuple

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

from protocol.round.serve_gate import ServeGate

logger = logging.getLogger(__name__)


class StateServing:
    """What a late joiner downloads from this peer, and no DHT declaration of it."""

    state_provider: Optional[Callable[[], Tuple[Any, Sequence[torch.Tensor]]]] = None
    _serve_gate: Optional[ServeGate] = None  # made in the averager process, where downloads are served

    def get_current_state(self):
        """Called in this (host) process when a late joiner downloads our state."""
        if self.state_provider is None:
            raise RuntimeError("this peer has no state to share yet")
        return self.state_provider()

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest,
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        """hivemind's answer, once the gate admits the download (tests/exchange/test_state_serving.py)."""
        if not self.allow_state_sharing:
            return
        if self._serve_gate is None:
            t = self.timing
            self._serve_gate = ServeGate(t.serves_at_once, t.serves_per_peer, t.serve_window_s)
        peer = context.remote_id.to_base58()
        known = self._known  # this round's peers that are no strangers to us; None: not yet known
        why = self._serve_gate.admit(peer, time.monotonic(), stranger=known is not None and peer not in known)
        if why is not None:
            logger.info(f"not serving our state to {peer}: {why}")
            return
        try:
            async for part in super().rpc_download_state(request, context):
                yield part
        finally:
            self._serve_gate.release(peer)

    async def _declare_for_download_periodically(self):
        """Nothing. hivemind stores each peer as a state source under one DHT key every
        ``declare_state_period`` (in a large swarm, many stores a second to one key of a subkey per
        peer, which time out under load) for its own loader, which trusts the highest priority anyone
        declares. A voloco peer names the peer it downloads from out of the progress records
        (peer/round/state_sync.py) and never reads that key; ``rpc_download_state`` still serves while state sharing is allowed."""
