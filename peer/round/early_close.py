"""Mixed speeds: a slower peer closes its round early instead of making the faster ones wait.

Every peer of a round trains ``H`` inner steps, unless most of the other live peers of its round
are already ready (or have moved on to a later round) while it is still training: then it stops
after at least ``ceil(outer.min_inner_fraction * H)`` steps and contributes what it has. Its
pseudo-gradient covers fewer steps, so its contribution to the round's mean is smaller in
proportion, which weights it by the tokens it trained without trusting a token count a peer
claims (a claimed count would let a liar weigh in for many peers; the median-norm clip of
peer/outer/robust.py bounds what a large update can do). Its payload states the steps it covers,
which only sets the norm the clip compares each update at (``robust.medians_at_steps``): a peer
that trained H steps is held to H / s times the norm of one that closed early after s, not to that
norm itself. The peer then meets its round on time and is
in the next round with everyone else.

Why this rather than a time-boxed round (every peer trains until a shared deadline): it needs no
clock agreement between volunteers, a round of equal peers is unchanged (the H steps of the spec),
and the floor keeps a peer that lies about being ready from cutting anyone's round below that
fraction.

The check reads the progress records in a thread of its own, so the inner loop only tests an event,
and only once the round has reached its floor of steps (``arm``): before that, nothing it could read
would close the round. It then reads every ``Timing.early_close_poll_s`` or the membership's read interval, whichever is
longer (peer/round/membership.py shares its reads with the round barrier).
"""

from __future__ import annotations

import logging
import threading
from typing import Container, FrozenSet, Iterable, Optional

from protocol.round.peer_states import DONE
from protocol.round.round_policy import min_steps
from swarm.records import PeerView

__all__ = ["EarlyClose", "min_steps", "most_are_done"]  # min_steps lives in protocol/round/round_policy.py

logger = logging.getLogger("voloco.peer")



def most_are_done(views: Iterable[PeerView], me: str, round_no: int, unawaited: Container[str] = ()) -> bool:
    """Whether at least half of the other live peers of ``round_no`` (at least one) are ready for
    its exchange or already past it, while this peer still trains it. ``unawaited``: peers whose
    "training" no barrier waits a whole allowance for (``Membership.unawaited``: skipped no-shows,
    strangers once the budget applies); a staller's claim must not keep the others' rounds open
    (tests/outer/test_overlap.py)."""
    done = training = 0
    for v in views:
        if v.peer_id == me or v.peer_id in unawaited:
            continue
        if v.progress.round > round_no or (v.progress.round == round_no and v.progress.state in DONE):
            done += 1
        elif v.progress.round == round_no and v.progress.state == "training":
            training += 1
    return done >= 1 and done >= training


class EarlyClose:
    """Watches the round this peer trains; ``due()`` turns true when it should close the round."""

    def __init__(self, membership, peer_id: str, stop: threading.Event, enabled: bool = True):
        self.membership, self.peer_id, self.stop, self.enabled = membership, peer_id, stop, enabled
        self._due = threading.Event()
        self._round: Optional[int] = None
        self._armed = False
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.lockstep: FrozenSet[str] = frozenset()  # peers that step with this one (a chain's stages): not counted

    def watch(self, round_no: int) -> None:
        """Watch ``round_no`` (the round the inner steps are for); reading starts once it is armed."""
        self._due.clear()
        self._armed = False
        if self.enabled:
            self._round = round_no

    def arm(self) -> None:
        """The round reached its floor of steps: from now on it may close (idempotent)."""
        if not self.enabled or self._round is None or self._armed:
            return
        self._armed = True
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, daemon=True, name="early-close")
            self._thread.start()
        self._wake.set()

    def unwatch(self) -> None:
        self._round = None
        self._armed = False
        self._due.clear()

    def due(self) -> bool:
        return self._due.is_set()

    def _loop(self) -> None:
        while not self.stop.is_set():
            round_no = self._round
            if round_no is None or not self._armed:
                self._wake.wait(self.membership.timing.early_close_poll_s)
                self._wake.clear()
                continue
            try:
                views = self.membership.view()
            except Exception as e:  # the DHT being slow never stops training
                logger.debug(f"early close: could not read progress records: {e!r}")
                views = []
            views = [v for v in views if v.peer_id not in self.lockstep]
            unawaited = self.membership.unawaited(views)
            if self._round == round_no and self._armed and most_are_done(views, self.peer_id, round_no, unawaited):
                self._due.set()
            self._wake.wait(max(self.membership.timing.early_close_poll_s, self.membership.read_interval()))  # or the next round's arm()
            self._wake.clear()
