"""Refusals of other peers, logged so that new identities cannot flood the log or the table behind it.

A peer is named once a window (``every_s``), for at most ``named`` peers a window; refusals of
others are counted and the count said once a window. Used where a node turns requests away: state
downloads (peer/exchange/state_serving.py) and a private run's strangers (swarm/access/admission.py);
tests/swarm/test_signed_records.py::test_refusals_of_many_new_identities_keep_a_bounded_log_and_table.
"""

from __future__ import annotations

import time
from typing import Callable, Dict


class RefusalLog:
    def __init__(self, log: Callable[[str], None], named: int, every_s: float = 60.0):
        self._log, self.named, self.every_s = log, named, every_s
        self.peers: Dict[str, float] = {}  # peer -> when it was last named (at most ``named``)
        self.more, self.since = 0, time.monotonic()  # refusals of the others, counted since

    def note(self, peer: str, line: str, more: Callable[[int, float], str]) -> None:
        """A refusal of ``peer``: ``line`` logged if it is named, else counted; ``more(count, seconds)``
        is the line for the count."""
        now = time.monotonic()
        self.peers = {p: t for p, t in self.peers.items() if now - t < self.every_s}
        if peer in self.peers:
            return
        if len(self.peers) < self.named:
            self.peers[peer] = now
            self._log(line)
            return
        self.more += 1
        if now - self.since >= self.every_s:
            self._log(more(self.more, now - self.since))
            self.more, self.since = 0, now
