"""Serving this peer's replica state to peers that download it (peer/round/state_download.py).

A mixin of peer/exchange/gatherer.py's ``PayloadGatherer``: hivemind's ``rpc_download_state`` serves what
``get_current_state`` returns while state sharing is allowed (peer/round/state_sync.py turns it on once
the state is the group's), here ``state_provider()``, set by the runtime.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple

import torch


class StateServing:
    """What a late joiner downloads from this peer, and no DHT declaration of it."""

    state_provider: Optional[Callable[[], Tuple[Any, Sequence[torch.Tensor]]]] = None

    def get_current_state(self):
        """Called in this (host) process when a late joiner downloads our state."""
        if self.state_provider is None:
            raise RuntimeError("this peer has no state to share yet")
        return self.state_provider()

    async def _declare_for_download_periodically(self):
        """Nothing. hivemind stores each peer as a state source under one DHT key every
        ``declare_state_period`` (in a large swarm, many stores a second to one key of a subkey per
        peer, which time out under load) for its own loader, which trusts the highest priority anyone
        declares. A voloco peer names the peer it downloads from out of the progress records
        (peer/round/state_sync.py) and never reads that key; ``rpc_download_state`` still serves while state sharing is allowed."""
