"""peer/round/busy_advice.py: the H at which a peer's compute would be busy, from its rounds' times."""

from __future__ import annotations

import math

from peer.host.utilization import Utilization
from peer.round.busy_advice import BUSY_TARGET, BusyAdvisor, RoundTime, busy_inner_steps


def overlapped_round(h: int, step: float, exchange: float, max_overlap: float = 1.0, waited: float = 0.0,
                     other: float = 0.0) -> RoundTime:
    """A steady overlapped round as the loop runs it: the exchange (``waited`` of it at the barrier)
    runs beside at most max_overlap × H steps; what it outlasts them by, and ``other``, idle the compute."""
    hidden = math.floor(max_overlap * h) * step
    period = h * step + max(0.0, exchange - hidden) + other
    return RoundTime(util=h * step / period, steps=h, busy_s=h * step, exchange_s=exchange, waited_s=waited)


def sequential_round(h: int, step: float, exchange: float, other: float = 0.0) -> RoundTime:
    return RoundTime(util=h * step / (h * step + exchange + other), steps=h, busy_s=h * step, exchange_s=exchange)


def test_a_busy_peer_gets_no_advice():
    rounds = [overlapped_round(100, 0.038, 3.0)] * 3  # the steps hide the exchange: util 1
    assert busy_inner_steps(rounds, 100, overlap=True, max_overlap=1.0) is None


def test_an_exchange_longer_than_the_steps_asks_for_the_least_h_that_hides_it():
    """The figure the GPU-box issue measured: 3.8 s of steps, a longer exchange, 62-83 % busy."""
    for max_overlap in (1.0, 0.5):
        rounds = [overlapped_round(100, 0.038, 5.1, max_overlap)] * 3
        assert rounds[0].util < 0.9
        h = busy_inner_steps(rounds, 100, overlap=True, max_overlap=max_overlap)
        assert overlapped_round(h, 0.038, 5.1, max_overlap).util >= BUSY_TARGET - 1e-9  # what it promises
        assert overlapped_round(h - 2, 0.038, 5.1, max_overlap).util < BUSY_TARGET  # and not far more
    # at most half of H overlapped: about twice as long an H
    whole = busy_inner_steps([overlapped_round(100, 0.038, 5.1)] * 3, 100, True, 1.0)
    assert busy_inner_steps([overlapped_round(100, 0.038, 5.1, 0.5)] * 3, 100, True, 0.5) > 1.8 * whole


def test_without_overlap_the_exchange_must_be_a_twentieth_of_the_round():
    rounds = [sequential_round(30, 0.1, 1.0, other=0.2)] * 3  # 71 % busy; checkpoints and the like idle it too
    h = busy_inner_steps(rounds, 30, overlap=False, max_overlap=1.0)
    assert sequential_round(h, 0.1, 1.0, other=0.2).util >= BUSY_TARGET - 1e-9
    assert sequential_round(h - 2, 0.1, 1.0, other=0.2).util < BUSY_TARGET


def test_a_fast_peer_paced_by_slower_ones_gets_no_advice():
    """Its idle time is the barrier's wait for them: a larger H lengthens their rounds as much."""
    rounds = [overlapped_round(100, 0.019, 4.3, waited=3.8)] * 3  # twice as fast as the others
    assert rounds[0].util < 0.9
    assert busy_inner_steps(rounds, 100, overlap=True, max_overlap=1.0) is None
    # the same peer whose own exchange also outlasts its steps is advised for that part only
    slow_exchange = [overlapped_round(100, 0.019, 7.3, waited=3.8)] * 3
    h = busy_inner_steps(slow_exchange, 100, overlap=True, max_overlap=1.0)
    assert h is not None and h * 0.019 < 7.3 - 3.8 + 0.2


def test_one_slow_round_too_few_rounds_and_merged_windows_are_no_reason():
    slow = overlapped_round(100, 0.038, 20.0)
    fine = overlapped_round(100, 0.038, 3.0)
    assert busy_inner_steps([fine, slow, fine], 100, True, 1.0) is None  # the median round was busy
    assert busy_inner_steps([slow, slow], 100, True, 1.0) is None  # fewer than 3 rounds read
    assert busy_inner_steps([RoundTime(0.0, 0, 0.0, 5.0)] * 3, 100, True, 1.0) is None  # nothing trained
    # a window over a round that never concluded (deferred, restarted) holds twice the steps: not read
    merged = RoundTime(util=0.5, steps=200, busy_s=7.6, exchange_s=5.1)
    assert busy_inner_steps([merged, slow, slow], 100, True, 1.0) is None


def test_the_advisor_skips_the_first_windows_and_does_not_repeat_itself():
    advisor = BusyAdvisor(100, overlap=True, max_overlap=1.0)
    slow = overlapped_round(100, 0.038, 5.1)
    lines = [advisor.note(slow) for _ in range(12)]
    assert lines[:4] == [None] * 4  # two windows skipped; then three are needed
    assert lines[4] is not None and f"H = {advisor.h}" in lines[4] and "coordinator" in lines[4]
    assert lines[5:] == [None] * 7  # the same advice is said once
    slower = overlapped_round(100, 0.038, 9.0)
    later = [advisor.note(slower) for _ in range(10)]
    assert sum(line is not None for line in later) == 1  # moved by more than a quarter, 10 rounds on
    assert overlapped_round(advisor.h, 0.038, 9.0).util >= BUSY_TARGET - 1e-9


def test_utilization_counts_the_window_s_steps_and_compute():
    now = [0.0]
    util = Utilization(clock=lambda: now[0])
    for _ in range(4):
        util.busy(0.5)
    now[0] = 4.0
    assert util.round_done() == 0.5
    assert (util.last_busy, util.last_steps) == (2.0, 4)
