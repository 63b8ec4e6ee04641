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
MERGED_WINDOW = 1.5  # a window of more steps than this times H spans rounds that never concluded: not read
MAX_ADVISED = 1 << 20  # the spec's largest H
SKIPPED_WINDOWS = 2  # a peer's first windows are not steady rounds (BusyAdvisor)


@dataclass(frozen=True)
class RoundTime:
    """Where one round's wall time went, as the round loop measured it: a window from the end of the
    previous round to the end of this one (peer/host/utilization.py)."""

    util: float  # compute time / wall time of the window
    steps: int  # inner steps taken in the window (with overlap, some of them the next round's)
    busy_s: float  # seconds in those inner steps
    exchange_s: float  # wall seconds from the round's last step to θ (encode, barrier, gather, outer step, evaluation)
    waited_s: float = 0.0  # of them, at the barrier waiting for the round's other peers

    @property
    def step_s(self) -> float:
        return self.busy_s / self.steps

    @property
    def idle_s(self) -> float:
        """Wall seconds of the window not in inner steps, the wait for slower peers left out."""
        return max(0.0, self.busy_s / self.util - self.busy_s - self.waited_s)


def busy_inner_steps(rounds: List[RoundTime], inner_steps: int, overlap: bool, max_overlap: float) -> Optional[int]:
    """The H at about which this peer's compute would be busy ``BUSY_TARGET`` of its wall time, from
    its last rounds; None while it is busy enough, when what idles it is the wait for slower peers (a
    larger H lengthens their rounds too), or when nothing usable was measured.

    The model, per round: H steps of ``step`` seconds, then the exchange of ``exchange`` seconds (the
    barrier's wait for others left out), of which the next round's steps hide at most
    ``max_overlap`` × H (none without overlap); what else idles the peer (``other``: checkpoints,
    catch-up, the exchange's hand-off) is what the measured idle time leaves, and is not hidden. The
    answer is the least H at which that model is busy ``BUSY_TARGET`` of the time. Step time, exchange
    and idle time are medians of the last ``ADVICE_ROUNDS`` usable rounds: an estimate. Guarded by
    tests/round/test_busy_advice.py."""
    recent = [r for r in rounds[-ADVICE_ROUNDS:] if r.steps > 0 and r.busy_s > 0 and 0.0 < r.util <= 1.0
              and r.steps <= MERGED_WINDOW * inner_steps]
    if len(recent) < ADVICE_ROUNDS or statistics.median(r.util for r in recent) >= ADVISE_BELOW:
        return None
    step = statistics.median(r.step_s for r in recent)
    idle = statistics.median(r.idle_s for r in recent)
    period = statistics.median(r.busy_s / r.util for r in recent)
    if idle < (1.0 - BUSY_TARGET) * period:
        return None  # busy but for the wait for slower peers: not this peer's H to fix
    exchange = statistics.median(max(0.0, r.exchange_s - r.waited_s) for r in recent)
    def hidden(h: int) -> float:  # the steps taken ahead of the exchange: peer/round/loop.py's max_ahead
        return max(1, math.floor(max_overlap * h + 1e-9)) * step if overlap else 0.0

    other = max(0.0, idle - max(0.0, exchange - hidden(inner_steps)))

    def busy(h: int) -> float:
        work = h * step
        return work / (work + max(0.0, exchange - hidden(h)) + other)

    if busy(inner_steps) >= BUSY_TARGET:
        return None
    low, high = inner_steps, inner_steps
    while busy(high) < BUSY_TARGET:  # busy(h) grows with h towards 1: double, then bisect
        if high >= MAX_ADVISED:
            return MAX_ADVISED
        low, high = high, min(2 * high, MAX_ADVISED)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if busy(mid) < BUSY_TARGET else (low, mid)
    return high


def busy_advice(h: int, inner_steps: int, rounds: List[RoundTime]) -> str:
    """The log line that says so, in words an operator acts on (H is the run spec's, set by the coordinator)."""
    last = rounds[-1]
    waited = (f", {last.waited_s:.1f} s of it waiting for slower peers, which a larger H does not shorten"
              if last.waited_s >= 0.1 * last.exchange_s else "")
    return (f"compute busy {last.util:.0%} of the last round ({last.busy_s:.1f} s of compute in {last.busy_s / last.util:.1f} s, "
            f"the exchange {last.exchange_s:.1f} s{waited}): the run's H = {inner_steps} inner steps a round is too short "
            f"to hide this peer's own exchange; at about H = {h} ([outer] inner_steps in the coordinator's spec) "
            f"it would be hidden{' but for that wait' if waited else f' and its compute busy about {BUSY_TARGET:.0%} of the time'}")


class BusyAdvisor:
    """Keeps a peer's last rounds' times and says, now and then, the H that would keep its compute
    busy (``busy_inner_steps``): once when it first applies, then when it moved by a quarter or more
    and ``ADVICE_EVERY`` rounds have passed. A peer's first two windows (its start and quorum, then
    the steps the first exchange held back, which is never overlapped) are not read."""

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
        if self._seen <= SKIPPED_WINDOWS:
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
