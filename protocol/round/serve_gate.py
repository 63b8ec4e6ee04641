"""Who may download this peer's state now: a bound on what serving costs.

Every state download a peer serves holds a copy of its replica state (θ and the shared state) until
the stream ends, and sends it whole. Anyone may ask, as often as they like, under any number of new
identities: without a bound, a burst of downloads costs a serving peer memory in proportion to the
burst, its uplink, and the time its training loop waits for the engine's lock to copy the state. So:

- at most ``at_once`` downloads are served at the same time, strangers (peers that are not members of
  our rounds and have no standing) at most ``at_once - 1`` of them: a burst of new identities cannot
  take every slot;
- one peer has one download in flight at most, and begins at most ``per_peer`` within ``window``
  seconds;
- each download holds its slot until it is released or its lease ends; the lease is renewed as the
  download keeps up with the slowest rate a downloader accepts (``hold``), so a stream that stalls,
  or whose end is never seen, frees its slot a gather slot later at most;
- the table of who downloaded when holds at most ``max_tracked`` peers; while it is full of peers
  seen within the window, a stranger is refused.

A refused download is answered "busy" at once (peer/exchange/state_serving.py), and the downloader
asks again a little later or asks another source (peer/round/state_sync.py). Time is an input, never
read here. Guarded by tests/protocol/test_serve_gate.py.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, Hashable, List, Optional, Tuple


@dataclass
class Slot:
    """One download being served: whose, and until when it holds its slot at most."""

    peer: Hashable
    stranger: bool
    until: float


class ServeGate:
    """Admits or refuses each state download; ``release`` its slot when the download ends."""

    def __init__(self, at_once: int, per_peer: int, window: float, lease: float, max_tracked: int = 4096):
        if at_once < 1 or per_peer < 1 or window <= 0 or lease <= 0 or max_tracked < 1:
            raise ValueError("a serve gate needs at least one slot, one download a peer, a window, a lease and a table")
        self.at_once, self.per_peer, self.window, self.lease = at_once, per_peer, window, lease
        self.max_tracked = max_tracked
        self.slots: List[Slot] = []
        self._begun: Dict[Hashable, Deque[float]] = {}  # peer -> when its downloads within the window began

    def in_flight(self, now: float) -> Tuple[int, int]:
        """(downloads being served, of which strangers'), leases ended left out."""
        self.slots = [s for s in self.slots if s.until > now]
        return len(self.slots), sum(s.stranger for s in self.slots)

    def admit(self, peer: Hashable, now: float, stranger: bool) -> Tuple[Optional[Slot], str]:
        """(its slot, "") if ``peer`` may download now, the download counted as begun; else (None, why not)."""
        self._forget(now)
        busy, strangers = self.in_flight(now)
        if busy >= self.at_once:
            return None, f"serving {busy} downloads already (at most {self.at_once} at once)"
        if stranger and self.at_once > 1 and strangers >= self.at_once - 1:
            return None, f"serving {strangers} downloads to new peers already; the last slot is kept for peers of our rounds"
        if any(s.peer == peer for s in self.slots):  # an honest downloader downloads one state at a time
            return None, "already downloading our state"
        begun = self._begun.get(peer)
        if begun is not None and len(begun) >= self.per_peer:
            return None, f"began {len(begun)} downloads within {self.window:.0f} s (at most {self.per_peer})"
        if begun is None:
            if len(self._begun) >= self.max_tracked and stranger:
                return None, f"{len(self._begun)} peers downloaded within {self.window:.0f} s"
            begun = self._begun[peer] = deque()
        begun.append(now)
        slot = Slot(peer, stranger, now + self.lease)
        self.slots.append(slot)
        return slot, ""

    def hold(self, slot: Slot, until: float) -> None:
        """The download of ``slot`` may hold it until ``until`` (renewed as it makes progress); a slot whose
        lease ended a moment before counts again."""
        slot.until = until
        if all(s is not slot for s in self.slots):
            self.slots.append(slot)

    def release(self, slot: Slot) -> None:
        """The download of ``slot`` has ended (served, failed or abandoned); twice is harmless."""
        self.slots = [s for s in self.slots if s is not slot]

    def _forget(self, now: float) -> None:
        for peer in list(self._begun):
            begun = self._begun[peer]
            while begun and now - begun[0] >= self.window:
                begun.popleft()
            if not begun:
                del self._begun[peer]
