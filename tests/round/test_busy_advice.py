"""peer/round/busy_advice.py: the H at which a peer's compute would be busy, from its rounds' times."""

from __future__ import annotations

import math

from peer.host.utilization import Utilization
from peer.round.busy_advice import BUSY_TARGET, BusyAdvisor, RoundTime, busy_inner_steps


def overlapped_round(h: int, step: float, exchange: float, max_overlap: float = 1.0) -> RoundTime:
    """A steady overlapped round as the loop runs it: the exchange runs beside at most max_overlap × H
    steps; the rest of the period, if the exchange is longer, the compute waits."""
    hidden = math.floor(max_overlap * h) * step
    period = h * step + max(0.0, exchange - hidden)
    return RoundTime(util=h * step / period, steps=h, busy_s=h * step, exchange_s=exchange)


def sequential_round(h: int, step: float, exchange: float) -> RoundTime:
    return RoundTime(util=h * step / (h * step + exchange), steps=h, busy_s=h * step, exchange_s=exchange)


def test_a_busy_peer_gets_no_advice():
    rounds = [overlapped_round(100, 0.038, 3.0)] * 3  # the steps hide the exchange: util 1
    assert busy_inner_steps(rounds, 100, overlap=True, max_overlap=1.0) is None


def test_an_exchange_longer_than_the_steps_asks_for_an_h_that_hides_it():
    """The figure the GPU-box issue measured: 3.8 s of steps, a longer exchange, 62-83 % busy."""
    rounds = [overlapped_round(100, 0.038, 5.1)] * 3
    assert rounds[0].util < 0.9
    h = busy_inner_steps(rounds, 100, overlap=True, max_overlap=1.0)
    assert h == math.ceil(5.1 / 0.038)
    assert overlapped_round(h, 0.038, 5.1).util >= BUSY_TARGET  # what the advice promises, in the same model
    # with at most half of H overlapped, H must be twice as long
    half = [overlapped_round(100, 0.038, 5.1, 0.5)] * 3
    h_half = busy_inner_steps(half, 100, overlap=True, max_overlap=0.5)
    assert h_half >= 2 * math.ceil(5.1 / 0.038) - 1
    assert overlapped_round(h_half, 0.038, 5.1, 0.5).util >= BUSY_TARGET


def test_without_overlap_the_exchange_must_be_a_twentieth_of_the_round():
    rounds = [sequential_round(30, 0.1, 1.0)] * 3  # 75 % busy
    h = busy_inner_steps(rounds, 30, overlap=False, max_overlap=1.0)
    assert sequential_round(h, 0.1, 1.0).util >= BUSY_TARGET - 1e-9
    assert sequential_round(h - 2, 0.1, 1.0).util < BUSY_TARGET


def test_one_slow_round_and_too_few_rounds_are_no_reason():
    slow = overlapped_round(100, 0.038, 20.0)
    fine = overlapped_round(100, 0.038, 3.0)
    assert busy_inner_steps([fine, slow, fine], 100, True, 1.0) is None  # the median round was busy
    assert busy_inner_steps([slow, slow], 100, True, 1.0) is None  # fewer than 3 rounds read
    assert busy_inner_steps([RoundTime(0.0, 0, 0.0, 5.0)] * 3, 100, True, 1.0) is None  # nothing trained


def test_the_advisor_skips_the_first_round_and_does_not_repeat_itself():
    advisor = BusyAdvisor(100, overlap=True, max_overlap=1.0)
    slow = overlapped_round(100, 0.038, 5.1)
    lines = [advisor.note(slow) for _ in range(12)]
    assert lines[:3] == [None] * 3  # the first round is not read; then three are needed
    assert lines[3] is not None and f"H = {advisor.h}" in lines[3] and "coordinator" in lines[3]
    assert lines[4:] == [None] * 8  # the same advice is said once
    slower = overlapped_round(100, 0.038, 9.0)
    later = [advisor.note(slower) for _ in range(10)]
    assert sum(line is not None for line in later) == 1  # moved by more than a quarter, 10 rounds on
    assert advisor.h == math.ceil(9.0 / 0.038)


def test_utilization_counts_the_window_s_steps_and_compute():
    now = [0.0]
    util = Utilization(clock=lambda: now[0])
    for _ in range(4):
        util.busy(0.5)
    now[0] = 4.0
    assert util.round_done() == 0.5
    assert (util.last_busy, util.last_steps) == (2.0, 4)
