"""One round barrier's direct questions to the peers it waits for, and their answers laid over the view.

The view of the progress records is read at most every ``Timing.read_interval`` (longer in a larger
swarm), so a peer that became ready just after a read is seen only at the next one. While a barrier
waits, it asks each peer it waits for to answer once it is done with the round
(peer/exchange/ready_notices.py); an answer is that peer's progress record, fresher than the view's
when it came after the view's last read began, and then stands in for it (``overlay``).

What is asked is bounded by whom the barrier waits for: at most ``Timing.ready_asked_max`` peers
(last round's groupmates first), one question in flight to each, asked again no sooner than
``Timing.ready_reask_s`` after an answer that did not end the wait, and never again in this barrier
after a question that got no answer (a peer that serves no questions, an older voloco or one behind
a NAT, is seen through the view as before). An answer that does not parse, or names another run
spec, is dropped. Guarded by tests/round/test_ready_asks.py.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Dict, Iterable, List, Optional, Set, Tuple

from protocol.dht.records import Progress, parse_progress
from protocol.errors import ProtocolError
from protocol.round.timing import Timing
from swarm.records import PeerView

logger = logging.getLogger("voloco.peer")


class ReadyAsks:
    """``notices``: what asks (peer/exchange/ready_notices.py's ``ask_ready``: peer, round, wait ->
    a future of bytes or None); ``digest``: our run spec's, the only one an answer may name."""

    def __init__(self, notices, round_no: int, digest: str, timing: Timing, clock: Optional[Callable[[], float]] = None):
        self.notices, self.round_no, self.digest, self.timing = notices, round_no, digest, timing
        self.clock = clock if clock is not None else time.monotonic
        self._asked: Dict[str, object] = {}  # peer -> the future of the question in flight
        self._answers: Dict[str, Tuple[float, Progress]] = {}  # peer -> (when it came, what it said)
        self._silent: Set[str] = set()  # asked and not answered: not asked again in this barrier
        self.asked = 0  # questions sent (for the tests and the log)

    def ask(self, peers: Iterable[str], first: Set[str] = frozenset()) -> None:
        """Ask each of ``peers`` (those the barrier still waits for; ``first``: asked before the rest)
        that has no question in flight, within the bound."""
        self._collect()
        now = self.clock()
        wanted = sorted(set(peers), key=lambda p: (p not in first, p))[: self.timing.ready_asked_max]
        for peer in wanted:
            if peer in self._asked or peer in self._silent:
                continue
            answered = self._answers.get(peer)
            if answered is not None and now - answered[0] < self.timing.ready_reask_s:
                continue
            try:
                self._asked[peer] = self.notices.ask_ready(peer, self.round_no, self.timing.ready_hold_s)
                self.asked += 1
            except Exception as e:  # the averager process is gone (stopping): the view alone
                logger.debug(f"could not ask {peer} whether it is done with round {self.round_no}: {e!r}")
                self._silent.add(peer)

    def _collect(self) -> None:
        for peer, future in list(self._asked.items()):
            if not future.done():
                continue
            del self._asked[peer]
            try:
                body = future.result()
            except Exception:
                body = None
            progress = self._parse(peer, body)
            if progress is None:
                self._silent.add(peer)
            else:
                self._answers[peer] = (self.clock(), progress)

    def _parse(self, peer: str, body: Optional[bytes]) -> Optional[Progress]:
        if body is None:
            return None
        try:
            progress = parse_progress(body)
        except ProtocolError as e:
            logger.debug(f"{peer} answered whether it is done with a record that does not parse: {e}")
            return None
        return progress if progress.spec == self.digest else None

    def overlay(self, views: List[PeerView], read_began: float) -> List[PeerView]:
        """``views`` with each record replaced by the answer of its peer where that answer came after
        the view's read began (``read_began``, on this object's clock)."""
        self._collect()
        fresher = {p: progress for p, (at, progress) in self._answers.items() if at > read_began}
        if not fresher:
            return views
        return [PeerView(peer_id=v.peer_id, progress=fresher[v.peer_id], expires=v.expires) if v.peer_id in fresher else v
                for v in views]
