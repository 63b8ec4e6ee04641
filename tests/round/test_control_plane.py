"""The control plane's rates: how often a peer reads and writes its progress records, and what a
read that fails or misses records leaves in its view. Scripted DHT reads and a fake clock."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from hivemind.utils import get_dht_time

from peer.round import membership as membership_mod
from peer.round.early_close import EarlyClose
from peer.round.membership import Membership
from protocol.round.timing import Timing
from tests.round.test_liveness import SPEC, progress


def record(peer, round_no=3, state="training", ttl=30.0):
    return SimpleNamespace(peer_id=peer, progress=progress(round_no, state), expires=get_dht_time() + ttl)


class Reads:
    """read_progress scripted: each call returns the next list (or raises it)."""

    def __init__(self, *answers):
        self.answers, self.calls = list(answers), 0

    def __call__(self, dht, run_id):
        self.calls += 1
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


def member(monkeypatch, reads, progress_fn=lambda: None):
    monkeypatch.setattr(membership_mod, "read_progress", reads)
    return Membership(dht=None, spec=SPEC, peer_id="me", progress=progress_fn, stop=threading.Event())


def ids(views):
    return sorted(v.peer_id for v in views)


def test_reads_are_shared_and_slow_down_as_the_swarm_grows(monkeypatch, clock):
    small = Reads([record(p) for p in "abc"])
    m = member(monkeypatch, small)
    assert ids(m.view()) == ["a", "b", "c"]
    clock.sleep(Timing.read_min_s / 2)
    m.view(), m.others(), m.swarm_is_empty()
    assert small.calls == 1  # callers within the interval share one read
    clock.sleep(Timing.read_min_s)
    m.view()
    assert small.calls == 2
    big = Reads([record(f"p{i}") for i in range(32)])
    m = member(monkeypatch, big)
    m.view()
    assert m.read_interval() == 32 / Timing.swarm_reads_per_s == 4.0  # the swarm reads ~8 times a second in all
    clock.sleep(3.9)
    m.view()
    assert big.calls == 1
    clock.sleep(0.2)
    m.view()
    assert big.calls == 2
    sybils = member(monkeypatch, Reads([record(f"s{i}") for i in range(1000)]))  # one liar's 1000 identities
    sybils.view()
    assert sybils.read_interval() == Timing.read_max_s  # slow the view down no further than this


def test_a_failed_or_partial_read_keeps_the_records_that_have_not_expired(monkeypatch, clock):
    reads = Reads([record("a"), record("b"), record("gone", ttl=-5.0)], [record("a", state="ready")],
                  TimeoutError("the DHT is slow"), [])
    m = member(monkeypatch, reads)
    assert ids(m.view()) == ["a", "b", "gone"]  # a fresh read is taken as it is
    clock.sleep(1.0)
    views = {v.peer_id: v for v in m.view()}  # b missing from one read: kept; "gone" expired: dropped
    assert sorted(views) == ["a", "b"] and views["a"].progress.state == "ready"
    clock.sleep(1.0)
    assert ids(m.view()) == ["a", "b"] and not m.swarm_is_empty()  # a failed read is not an empty swarm
    clock.sleep(1.0)
    assert ids(m.view()) == ["a", "b"]
    assert reads.calls == 4


def test_a_record_missed_by_reads_stays_a_little_past_its_expiry_in_a_large_swarm(monkeypatch, clock):
    # 32 peers: reads every 4 s, so a late keep-alive and two reads that miss a record fit in its TTL
    swarm = [record(f"p{i}") for i in range(31)]
    late = record("late", ttl=-3.0)  # expired 3 s ago: its refresh is late, the swarm's reads missed it
    m = member(monkeypatch, Reads(swarm + [late], swarm))
    m.view()
    clock.sleep(m.read_interval())
    assert "late" in ids(m.view())  # within MISSED_READS_KEPT read intervals (8 s) of its expiry
    gone = record("gone", ttl=-9.0)
    m = member(monkeypatch, Reads(swarm + [gone], swarm))
    m.view()
    clock.sleep(m.read_interval())
    assert "gone" not in ids(m.view())


def test_a_read_that_outlasts_the_records_ttl_keeps_what_was_alive_when_it_began(monkeypatch, clock):
    swarm = [record(f"p{i}", ttl=5.0) for i in range(8)]

    def slow_empty_read(dht, run_id):  # a loaded host: the read takes 20 s and reaches nobody
        clock.sleep(20.0)
        monkeypatch.setattr(membership_mod, "get_dht_time", lambda: real() + 20.0)
        return []

    real = membership_mod.get_dht_time
    reads = Reads(swarm)
    m = member(monkeypatch, reads)
    m.view()
    monkeypatch.setattr(membership_mod, "read_progress", slow_empty_read)
    clock.sleep(m.read_interval())
    assert len(m.view()) == 8  # alive (and within the grace) when the read began: not a peer that left


def test_the_start_quorum_counts_a_peer_seen_started_though_later_reads_miss_it(monkeypatch, clock):
    a = record("a", round_no=0, state="waiting", ttl=-20.0)  # its refreshes are late and reads miss them
    b, c = (record(p, round_no=0, state="waiting") for p in "bc")
    reads = Reads([a, b], [b, c])
    m = member(monkeypatch, reads)
    m.wait_for_quorum(4)  # a, then b and c: 4 with us, though no single view held all three
    assert reads.calls == 2


def test_the_start_quorum_ends_when_another_peer_began_training_on_its_own_count(monkeypatch, clock):
    waiting = [record(p, round_no=0, state="waiting") for p in "abc"]
    reads = Reads(waiting, waiting, waiting + [record("d", round_no=0, state="training")])
    m = member(monkeypatch, reads)
    m.wait_for_quorum(32)  # d's view reached 32; ours only 5: we follow d instead of training round 0 minutes later
    assert reads.calls == 3


def test_a_chain_stage_linking_past_its_quorum_ends_the_wait(monkeypatch, clock):
    """The last peer to start was a chain stage: its own view reached the quorum at once, so it went
    from "waiting" to "linking" before anyone read it waiting. Its next stage, waiting here, must start
    (and listen for it), or both wait for ever and so does everyone counting to the quorum."""
    others = [record(p, round_no=0, state="waiting") for p in "ab"]
    reads = Reads(others, others + [record("stage0", round_no=0, state="linking")])
    m = member(monkeypatch, reads)
    m.wait_for_quorum(5)  # a, b, the linking stage and us: 4 of 5, but the stage is past its own quorum
    assert reads.calls == 2


def test_the_heartbeat_stores_a_record_on_a_change_or_once_a_keepalive_period(monkeypatch, clock):
    stored = []
    monkeypatch.setattr(membership_mod, "publish_progress", lambda dht, run_id, peer, p, ttl: stored.append((p.state, ttl)))
    shown = {"state": "training"}
    m = member(monkeypatch, Reads([]), progress_fn=lambda: progress(3, shown["state"]))
    keepalive = m.keepalive_s()
    assert keepalive == pytest.approx(max(SPEC.swarm.heartbeat_period, m.ttl() / 3))
    m.publish(only_if_due=True)
    assert len(stored) == 1
    for _ in range(int(keepalive / SPEC.swarm.heartbeat_period) - 1):  # heartbeats with nothing new
        clock.sleep(SPEC.swarm.heartbeat_period)
        m.publish(only_if_due=True)
    assert len(stored) == 1
    shown["state"] = "ready"
    m.publish(only_if_due=True)  # a change goes out at once
    assert [s for s, _ in stored] == ["training", "ready"]
    clock.sleep(keepalive + 0.01)
    m.publish(only_if_due=True)  # and an unchanged record is refreshed before it expires
    assert len(stored) == 3 and all(ttl == m.ttl() for _, ttl in stored) and keepalive < m.ttl() / 2
    m.publish()  # an explicit publish (a state change the caller knows of) always goes out
    assert len(stored) == 4


def test_a_heartbeat_never_stores_a_state_older_than_the_last_stored(monkeypatch):
    """The heartbeat thread reads our record, then stores it; a state change published meanwhile from
    the round's thread (a barrier that left strangers says "exchanging" at once) must not be
    overwritten by the heartbeat's older "ready" (``Membership.publish`` holds a lock)."""
    shown = {"state": "ready"}
    stored, read, release = [], threading.Event(), threading.Event()

    def store(dht, run_id, peer, p, ttl):
        if threading.current_thread().name == "beat":  # the heartbeat's store is slow
            read.set()
            release.wait(5)
        stored.append(p.state)

    monkeypatch.setattr(membership_mod, "publish_progress", store)
    m = member(monkeypatch, Reads([]), progress_fn=lambda: progress(3, shown["state"]))
    beat = threading.Thread(target=m.publish, name="beat")
    beat.start()
    assert read.wait(5)
    shown["state"] = "exchanging"
    main = threading.Thread(target=m.publish)
    main.start()
    main.join(0.3)
    release.set()
    beat.join(5), main.join(5)
    assert stored == ["ready", "exchanging"]


def test_early_close_reads_nothing_before_the_round_reaches_its_floor():
    reads = []
    done = [record("a", round_no=3, state="ready")]
    membership = SimpleNamespace(view=lambda: reads.append(1) or done, read_interval=lambda: 0.01,
                                 timing=Timing(early_close_poll_s=0.01), unawaited=lambda views: set())
    stop = threading.Event()
    early = EarlyClose(membership, "me", stop)
    try:
        early.watch(3)
        threading.Event().wait(0.2)
        assert not reads and not early.due()  # watched, not armed: no DHT read
        early.arm()
        for _ in range(200):
            if early.due():
                break
            threading.Event().wait(0.01)
        assert early.due() and reads
        early.watch(4)  # the next round: disarmed again until its floor
        assert not early.due()
    finally:
        stop.set()


def test_a_merge_reads_the_view_a_second_past_its_gather_whatever_the_swarms_size(monkeypatch, clock):
    """A round's merge ends only on a read begun past its gather (protocol/round/round_policy.py
    ``merge_wait``). In a swarm of 32 the view's own schedule reads every 4 s, up to 8 s in a large one;
    the merge asks for its read ``Timing.merge_read_after_s`` past its gather instead (peer/round/merge.py):
    one read more a round at most, none where the schedule reads first."""
    reads = Reads([record(f"p{i}") for i in range(32)])
    m = member(monkeypatch, reads)
    m.view()
    clock.sleep(0.5)
    gathered = clock.monotonic()  # our gather ends half a second after the last scheduled read
    m.view()
    assert reads.calls == 1 and m.read_began < gathered  # within the 4-s interval: no read of its own
    clock.sleep(Timing.merge_read_after_s)
    m.view(read_since=gathered)
    assert reads.calls == 2 and m.read_began > gathered  # the merge's read, 1.5 s after the last
    m.view(read_since=gathered)
    assert reads.calls == 2  # once: the read it has began past its gather
    small = Reads([record(p) for p in "abcdefg"])  # 8 peers: the schedule reads every second anyway
    m = member(monkeypatch, small)
    m.view()
    gathered = clock.monotonic()
    clock.sleep(Timing.merge_read_after_s)
    m.view(), m.view(read_since=gathered)
    assert small.calls == 2
