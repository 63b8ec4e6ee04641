"""Calls other peers may have running here at once: a few from each peer, a bound over all of them.

Used by the exchange's RPCs (peer/exchange/gatherer.py, peer/exchange/ready_notices.py), the
tokenizer's serving (swarm/tokenizer_share.py) and the DHT channels a node serves
(swarm/dht/channels.py); tests/exchange/test_exchange_bounds.py, tests/swarm/test_dht_channels.py.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Hashable, Iterator, Optional


class CallLimiter:
    """At most ``per_peer`` running calls from each remote peer, and at most ``total`` from all of them
    (None: no such bound); the others are refused at once."""

    def __init__(self, per_peer: int, total: Optional[int] = None):
        self.per_peer, self.total = per_peer, total
        self._running: Dict[Hashable, int] = {}

    @contextlib.contextmanager
    def admit(self, peer: Hashable) -> Iterator[bool]:
        if self._running.get(peer, 0) >= self.per_peer or (self.total is not None and sum(self._running.values()) >= self.total):
            yield False
            return
        self._running[peer] = self._running.get(peer, 0) + 1
        try:
            yield True
        finally:
            self._running[peer] -= 1
            if not self._running[peer]:
                del self._running[peer]
