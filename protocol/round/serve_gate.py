"""Who may download this peer's state now: a bound on what serving costs.

Every state download a peer serves holds a copy of its replica state (θ and the shared state) until
the stream ends, and sends it whole. Anyone may ask, as often as they like, under any number of new
identities: without a bound, a burst of downloads costs a serving peer memory in proportion to the
burst, its uplink, and the time its training loop waits for the engine's lock to copy the state. So:

- at most ``at_once`` downloads are served at the same time; one of those slots is kept for peers
  that are no strangers to us (members of our rounds, with standing), so a burst of new identities
  cannot keep a peer of the run from catching up;
- one peer begins at most ``per_peer`` downloads within ``window`` seconds (a catch-up downloads once,
  and tries another peer when one fails: peer/round/state_sync.py);
- the table of who downloaded when holds at most ``max_tracked`` peers; while it is full of peers
  seen within the window, a stranger is refused.

A refused download ends at once with no state (the downloader reads "served no state" and
tries its next source). Time is an input, never read here. Guarded by tests/protocol/test_serve_gate.py.
"""

from __future__ import annotations

from collections import deque
from typing import Deque, Dict, Hashable, Optional


class ServeGate:
    """Admits or refuses each state download; ``release`` when a served one ends."""

    def __init__(self, at_once: int, per_peer: int, window: float, max_tracked: int = 4096):
        if at_once < 1 or per_peer < 1 or window <= 0 or max_tracked < 1:
            raise ValueError("a serve gate needs at least one slot, one download a peer, a window and a table")
        self.at_once, self.per_peer, self.window, self.max_tracked = at_once, per_peer, window, max_tracked
        self.serving: Dict[Hashable, int] = {}  # peer -> downloads of it in flight
        self._begun: Dict[Hashable, Deque[float]] = {}  # peer -> when its downloads within the window began

    @property
    def in_flight(self) -> int:
        return sum(self.serving.values())

    def admit(self, peer: Hashable, now: float, stranger: bool) -> Optional[str]:
        """None, and the download counts as begun, if ``peer`` may download now; else why not."""
        self._forget(now)
        busy = self.in_flight
        if busy >= self.at_once:
            return f"serving {busy} downloads already (at most {self.at_once} at once)"
        if stranger and busy >= self.at_once - 1 and self.at_once > 1:
            return f"serving {busy} downloads; the last slot is kept for peers of our rounds"
        begun = self._begun.get(peer)
        if begun is not None and len(begun) >= self.per_peer:
            return f"began {len(begun)} downloads within {self.window:.0f} s (at most {self.per_peer})"
        if begun is None:
            if len(self._begun) >= self.max_tracked and stranger:
                return f"{len(self._begun)} peers downloaded within {self.window:.0f} s"
            begun = self._begun[peer] = deque()
        begun.append(now)
        self.serving[peer] = self.serving.get(peer, 0) + 1
        return None

    def release(self, peer: Hashable) -> None:
        """A download ``admit`` let begin has ended (served, failed or abandoned)."""
        left = self.serving.get(peer, 0) - 1
        if left > 0:
            self.serving[peer] = left
        else:
            self.serving.pop(peer, None)

    def _forget(self, now: float) -> None:
        for peer in list(self._begun):
            begun = self._begun[peer]
            while begun and now - begun[0] >= self.window:
                begun.popleft()
            if not begun:
                del self._begun[peer]
