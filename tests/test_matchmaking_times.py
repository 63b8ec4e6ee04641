"""Matchmaking's timeouts stretch with the host's DHT read latency (peer/exchange.py:
matchmaking_times; peer/membership.py: Membership.read_latency): a loaded host's leaders answer
late, and a follower that gives up on each after the spec's third of a second... never joins one."""

from __future__ import annotations

import pytest

from peer import membership as membership_mod
from peer.matchmaking import LATENCY_TIMEOUTS, matchmaking_times
from tests.test_control_plane import Reads, member, record
from tests.test_liveness import clock  # noqa: F401  (the clock fixture)


def test_a_quiet_host_keeps_the_specs_times():
    assert matchmaking_times(3.0, 0.0, 15.0) == (3.0, 1.0)
    assert matchmaking_times(3.0, 0.05, 15.0) == (3.0, 1.0)  # a read on a quiet host: tens of ms


def test_a_loaded_host_waits_longer_for_answers_and_for_followers():
    wait, request = matchmaking_times(3.0, 1.2, 15.0)
    assert request == pytest.approx(LATENCY_TIMEOUTS * 1.2)
    assert wait == pytest.approx(3 * request)  # hivemind: an answer's wait stays under the leader's


def test_the_stretch_is_bounded_and_never_below_the_spec():
    wait, request = matchmaking_times(3.0, 60.0, 15.0)
    assert (wait, request) == (15.0, 5.0)  # at most the limit (a quarter of round_wait)
    assert matchmaking_times(20.0, 60.0, 15.0) == (20.0, 20.0 / 3)  # the spec's own longer wait stands


def test_the_read_latency_is_the_median_of_the_last_reads(monkeypatch, clock):
    durations = iter([0.1, 5.0, 0.2, 0.3, 9.0, 0.4, 0.2])

    def timed_read(dht, run_id):
        clock.sleep(next(durations))
        return [record("a")]

    m = member(monkeypatch, Reads([]))
    assert m.read_latency() == 0.0
    monkeypatch.setattr(membership_mod, "read_progress", timed_read)
    for _ in range(7):
        clock.sleep(m.read_interval())
        m.view()
    assert m.read_latency() == pytest.approx(0.3)  # of 0.2, 0.3, 9.0, 0.4, 0.2: one slow read moves nothing


class _Step:
    def __init__(self):
        self.cancelled = False

    def done(self):
        return self.cancelled

    def cancel(self):
        self.cancelled = True


def test_a_matchmaking_left_from_an_earlier_round_is_cancelled_and_waited_out(monkeypatch):
    import asyncio
    import time
    from types import SimpleNamespace

    import peer.matchmaking as matchmaking

    step = _Step()
    mm = SimpleNamespace(step_control=step, is_looking_for_group=True)

    async def go():
        asyncio.get_running_loop().call_later(0.3, lambda: setattr(mm, "is_looking_for_group", False))
        t0 = time.monotonic()
        await matchmaking.end_stale_matchmaking(mm, 7)
        return time.monotonic() - t0

    took = asyncio.run(go())
    assert step.cancelled and 0.25 < took < 2.0
    # one that does not end is waited for no longer than the bound
    monkeypatch.setattr(matchmaking, "STALE_MATCHMAKING_WAIT_S", 0.2)
    mm.is_looking_for_group = True
    t0 = time.monotonic()
    asyncio.run(matchmaking.end_stale_matchmaking(mm, 8))
    assert time.monotonic() - t0 < 1.0
