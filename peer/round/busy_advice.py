"""The H that would keep a peer's compute busy, from its last rounds' times: a peer whose exchange
outlasts what its steps can hide (a fast GPU, a slow link) logs it, and its status file says it
(``busy_at_inner_steps``). H is the run spec's, so the line is for whoever runs the coordinator.
Pure but for the clock-free numbers the round loop passes in; guarded by
tests/round/test_busy_advice.py."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import List, Optional

BUSY_TARGET = 0.95  # the utilization the advice aims for
ADVISE_BELOW = 0.90  # advise only when the recent rounds' median utilization is below this
ADVICE_ROUNDS = 3  # rounds the advice reads (medians: one slow round is no reason)


@dataclass(frozen=True)
class RoundTime:
    """Where one round's wall time went, as the round loop measured it."""

    util: float  # compute time / wall time from the previous round's end to this one's
    steps: int  # inner steps taken in that window (with overlap, some of them the next round's)
    busy_s: float  # seconds in those inner steps
    exchange_s: float  # wall seconds from the last step's end to θ (encode, barrier, gather, outer step, evaluation)


def busy_inner_steps(rounds: List[RoundTime], inner_steps: int, overlap: bool, max_overlap: float) -> Optional[int]:
    """The H at about which this peer's compute would be busy ``BUSY_TARGET`` of its wall time, from
    its last rounds; None while it is busy enough (or nothing was measured).

    With overlap the next round's steps hide the exchange, at most ``max_overlap`` × H of them: H
    steps must last a round's whole period as it is now (steps and idle time) and at least the
    exchange / ``max_overlap``. Without overlap nothing hides the exchange: H grows until the
    exchange is (1 − target) of the round. Step time, period and exchange are medians of the last
    ``ADVICE_ROUNDS`` rounds; the exchange's length is taken as it is (waits for slower peers and
    matchmaking do not shrink with H), so the figure is an estimate. Guarded by
    tests/round/test_busy_advice.py."""
    recent = [r for r in rounds[-ADVICE_ROUNDS:] if r.steps > 0 and r.busy_s > 0 and 0.0 < r.util <= 1.0]
    if len(recent) < ADVICE_ROUNDS or statistics.median(r.util for r in recent) >= ADVISE_BELOW:
        return None
    step = statistics.median(r.busy_s / r.steps for r in recent)
    exchange = statistics.median(r.exchange_s for r in recent)
    if overlap:
        period = statistics.median(r.busy_s / r.util for r in recent)
        needed = max(exchange / max_overlap, period)
    else:
        needed = exchange * BUSY_TARGET / (1.0 - BUSY_TARGET)
    h = math.ceil(needed / step)
    return h if h > inner_steps else None


def busy_advice(h: int, inner_steps: int, rounds: List[RoundTime]) -> str:
    """The log line that says so, in words an operator acts on (H is the run spec's, set by the coordinator)."""
    last = rounds[-1]
    return (f"compute busy {last.util:.0%} of the last round ({last.busy_s:.1f} s of compute in {last.busy_s / last.util:.1f} s, "
            f"the exchange {last.exchange_s:.1f} s): the run's H = {inner_steps} inner steps a round is too short "
            f"to hide the exchange on this peer; at about H = {h} ([outer] inner_steps in the coordinator's spec) "
            f"its compute would be busy about {BUSY_TARGET:.0%} of the time")


class BusyAdvisor:
    """Keeps a peer's last rounds' times and says, now and then, the H that would keep its compute
    busy (``busy_inner_steps``): once when it first applies, then when it moved by a quarter or more
    and ``ADVICE_EVERY`` rounds have passed. A peer's first round (its start, the quorum, a first
    exchange that is never overlapped) is not read."""

    ADVICE_EVERY = 10

    def __init__(self, inner_steps: int, overlap: bool, max_overlap: float):
        self.inner_steps, self.overlap, self.max_overlap = inner_steps, overlap, max_overlap
        self._rounds: List[RoundTime] = []
        self._seen = 0
        self._said: Optional[int] = None
        self._said_at = 0
        self.h: Optional[int] = None  # the current advice (the status file's ``busy_at_inner_steps``)

    def note(self, round_time: RoundTime) -> Optional[str]:
        """Count one round; returns the advice's log line when it is due, else None."""
        self._seen += 1
        if self._seen == 1:
            return None
        self._rounds = (self._rounds + [round_time])[-ADVICE_ROUNDS:]
        self.h = busy_inner_steps(self._rounds, self.inner_steps, self.overlap, self.max_overlap)
        if self.h is None:
            return None
        moved = self._said is None or abs(self.h - self._said) >= 0.25 * self._said
        if not moved or (self._said is not None and self._seen - self._said_at < self.ADVICE_EVERY):
            return None
        self._said, self._said_at = self.h, self._seen
        return busy_advice(self.h, self.inner_steps, self._rounds)
