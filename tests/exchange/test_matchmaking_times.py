"""Matchmaking's timeouts stretch with the host's DHT read latency (protocol/round/timing.py:
Timing.matchmaking; peer/round/membership.py: Membership.read_latency): a loaded host's leaders answer
late, and a follower that gives up on each after the spec's third of a second... never joins one."""

from __future__ import annotations

import pytest

from peer.round import membership as membership_mod
from protocol.round.timing import Timing
from tests.round.test_control_plane import Reads, member, record


def matchmaking_times(matchmaking_time: float, read_latency: float, limit: float):
    return Timing(matchmaking_s=matchmaking_time).matchmaking(read_latency, limit)


def test_a_quiet_host_keeps_the_specs_times():
    assert matchmaking_times(3.0, 0.0, 15.0) == (3.0, 1.0)
    assert matchmaking_times(3.0, 0.05, 15.0) == (3.0, 1.0)  # a read on a quiet host: tens of ms


def test_a_loaded_host_waits_longer_for_answers_and_for_followers():
    wait, request = matchmaking_times(3.0, 1.2, 15.0)
    assert request == pytest.approx(Timing.latency_timeouts * 1.2)
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

