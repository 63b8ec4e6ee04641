"""protocol/round/round_policy.py: a round's exchange, step by step, decided from facts alone (no I/O, no clock)."""

from __future__ import annotations

import pytest

from protocol.round import round_policy as rp
from protocol.round.round_policy import MergeClock, MergeWait, Outcome, Step, StrangersWait, strangers_alone


@pytest.mark.parametrize("stopping,nobody,adoptable,step", [
    (True, False, False, Step.STOP), (True, True, True, Step.STOP),
    (False, False, False, Step.GATHER), (False, False, True, Step.GATHER),  # peers of our round to meet: gather
    (False, True, False, Step.NO_GROUP),
    (False, True, True, Step.ADOPT_ROUND_SET),  # gone on without us, their set named: taken, not their state
])
def test_after_the_barrier(stopping, nobody, adoptable, step):
    assert rp.after_barrier(stopping, nobody, adoptable) is step


@pytest.mark.parametrize("got,gave_up,mates,stopping,step", [
    (True, False, False, False, Step.CONCLUDE),
    (True, True, True, True, Step.CONCLUDE),  # a group's set counts even while stopping
    (False, True, True, False, Step.ADOPT_ROUND_SET),  # the others gathered without us: our lineage's set
    (False, True, False, False, Step.NO_GROUP),  # ... and with no lineage of ours, none can be taken
    (False, False, True, False, Step.ADOPT_OWN_SET),  # our gather timed out: our group may have our payload
    (False, False, False, False, Step.ADOPT_OWN_SET),
    (False, False, True, True, Step.NO_GROUP),  # stopping: nothing more is waited for
])
def test_after_the_gather(got, gave_up, mates, stopping, step):
    assert rp.after_gather(got, gave_up, mates, stopping) is step


@pytest.mark.parametrize("got,step", [(True, Step.CONCLUDE), (False, Step.NO_GROUP)])
def test_after_adopting(got, step):
    assert rp.after_adopt(got) is step


@pytest.mark.parametrize("alone,step", [(True, Step.ALONE), (False, Step.DEFER)])
def test_without_a_group(alone, step):
    assert rp.without_group(alone) is step


def test_every_final_step_has_one_of_three_outcomes_and_every_path_ends_in_one():
    assert set(rp.OUTCOME.values()) == set(Outcome) and len(Outcome) == 3
    ends = set()
    for stopping in (False, True):
        for nobody, adoptable in ((False, False), (True, False), (True, True)):
            step = rp.after_barrier(stopping, nobody, adoptable)
            for got in (False, True):
                for gave_up in (False, True):
                    for mates in (False, True):
                        for adopted in (False, True):
                            for alone in (False, True):
                                s = step
                                if s is Step.GATHER:
                                    s = rp.after_gather(got, gave_up, mates, stopping)
                                if s in (Step.ADOPT_OWN_SET, Step.ADOPT_ROUND_SET):
                                    s = rp.after_adopt(adopted)
                                if s is Step.NO_GROUP:
                                    s = rp.without_group(alone)
                                assert s in rp.FINAL, s
                                ends.add(rp.OUTCOME[s])
    assert ends == set(Outcome)


def clock(now, started=0.0, last=0.0, allowance=10.0, extra=0.0, round_wait=60.0):
    return MergeClock(now=now, started=started, last_arrival=last, allowance=allowance, extra=extra, round_wait=round_wait)


@pytest.mark.parametrize("c,seen,outstanding,unfetched,fresh,decision", [
    (clock(1.0), False, 5, 0, True, MergeWait.NOTHING_LEFT),  # nobody else in the records
    (clock(1.0), True, 1, 0, True, MergeWait.NOTHING_LEFT),  # one peer cannot make a group of its own
    (clock(1.0), True, 1, 0, False, MergeWait.GO_ON),  # ... unless the view predates our gather
    (clock(1.0), True, 1, 1, True, MergeWait.GO_ON),  # a named set still to fetch
    (clock(1.0), True, 2, 0, True, MergeWait.GO_ON),  # two peers may still gather and name a set
    (clock(10.5), True, 2, 0, True, MergeWait.TIMED_OUT),  # the allowance past the last arrival
    (clock(10.5, extra=60.0), True, 2, 0, True, MergeWait.GO_ON),  # ... longer while a peer finished training
    (clock(12.0, last=5.0), True, 2, 0, True, MergeWait.GO_ON),  # counted from the last arrival
    (clock(61.0, last=55.0), True, 2, 0, True, MergeWait.TIMED_OUT),  # never past round_wait
])
def test_when_the_merge_stops_waiting(c, seen, outstanding, unfetched, fresh, decision):
    assert rp.merge_wait(c, seen, outstanding, unfetched, 2, fresh) is decision


R = 7


@pytest.mark.parametrize("records,not_waited,left", [
    ([("a", R, "exchanging", -1, True), ("b", R, "exchanging", -1, True)], set(), True),  # all gathered without us
    ([("a", R, "exchanging", -1, True), ("b", R, "training", -1, False)], set(), False),  # b may still gather with us
    ([("a", R, "exchanging", -1, True), ("b", R, "training", -1, False)], {"b"}, True),  # ... unless we no longer wait for b
    ([("a", R, "ready", -1, False), ("b", R, "ready", -1, False)], set(), False),  # nobody has gathered yet
    ([("a", R, "exchanging", -1, True), ("c", R, "ready", 2, False)], set(), True),  # another part gathers apart
    ([("a", R, "exchanging", -1, True), ("d", R + 1, "training", -1, False)], set(), True),  # d left the round
    ([("me", R, "ready", -1, False), ("a", R, "exchanging", -1, True)], set(), True),  # our own record aside
])
def test_when_a_gather_can_give_up(records, not_waited, left):
    assert rp.nobody_left(records, "me", -1, R, frozenset(not_waited)) is left


def test_strangers_alone_are_those_the_merge_waits_for_with_nobody_known_among_them():
    assert strangers_alone({"n1", "n2"}, set(), known={"me"}, min_group_size=2)
    assert not strangers_alone({"n1", "a"}, set(), known={"me", "a"}, min_group_size=2)
    assert not strangers_alone({"n1", "n2"}, {"a"}, known={"me", "a"}, min_group_size=2)  # a set a peer we know named
    assert strangers_alone(set(), {"n1"}, known={"me"}, min_group_size=2)  # a set only strangers named, still to fetch
    # one stranger cannot form a group: the merge waits only for a fresh read, which costs nobody
    assert not strangers_alone({"n1"}, set(), known={"me"}, min_group_size=2)
    assert not strangers_alone(set(), set(), known={"me"}, min_group_size=2)


def test_a_wait_for_strangers_alone_is_paid_unless_something_came_of_it():
    w = StrangersWait()
    w.check(10.0, alone=True, last_arrival=9.0, asked_known=False)
    assert w.since == 10.0 and w.vain == 0.0
    w.check(12.0, alone=True, last_arrival=9.0, asked_known=False)
    w.check(13.0, alone=False, last_arrival=9.0, asked_known=False)  # they left the round, naming no set
    assert w.vain == 3.0 and w.since is None
    # a set a peer we know named was asked for meanwhile (its fetch may take long): not the strangers'
    w = StrangersWait()
    w.check(10.0, alone=True, last_arrival=9.0, asked_known=False)
    w.check(15.0, alone=True, last_arrival=9.0, asked_known=True)
    assert w.vain == 0.0 and w.since == 15.0  # a new stretch: the grant runs from here
    w.check(16.0, alone=True, last_arrival=15.5, asked_known=False)  # a set came in: not in vain, again a new stretch
    assert w.vain == 0.0 and w.since == 16.0
    w.check(17.0, alone=True, last_arrival=15.5, asked_known=False)
    assert w.vain == 1.0 and w.since == 16.0


def test_new_identities_fewer_than_the_peers_seen_cannot_set_the_round_to_catch_up_to():
    from protocol.round.round_policy import majority_round, sync_target

    assert majority_round([]) == -1 and majority_round([7]) == 7 and majority_round([9, 5]) == 5
    assert majority_round([2**62, 2**62, 10, 10, 10]) == 10 and majority_round([11, 11, 10]) == 11
    honest = {"a": 10, "b": 10, "c": 10}
    forged = {**honest, "x": 2**62, "y": 2**62}  # two new identities vouching for each other's θ
    everyone = set(forged)
    # a peer that knows two or more of them: they set the round, and only they serve and vouch for it
    assert sync_target(forged, {"a", "b"}, everyone) == (10, frozenset({"a", "b"}))
    assert sync_target({**forged, "c": 11, "d": 11}, {"a", "c", "d"}, everyone) == (11, frozenset({"a", "c", "d"}))
    # knowing one proves nothing: the active peers' majority decides, and no one peer vouches
    assert sync_target(forged, {"c"}, everyone) == (10, None)
    assert sync_target({"p": 2**62, "q": 2**62, "a": 10, "b": 10, "c": 10}, {"p"}, everyone | {"p", "q"}) == (10, None)
    # a newcomer that knows nobody: a strict majority of the active peers (two liars among five cannot move it)
    assert sync_target(forged, set(), everyone) == (10, None)
    assert sync_target({"x": 2**62, "y": 2**62, "a": 10}, set(), {"x", "y", "a"}) == (2**62, None)  # a majority of liars can
    # two newcomers that trained a round together while the swarm was ahead: the swarm's round
    assert sync_target({"q": 0, "a": 30, "b": 30}, {"q"}, {"q", "a", "b"}) == (30, None)
    assert sync_target({"q": 0, "r": 0, "a": 30, "b": 30, "c": 30}, {"q", "r"}, {"q", "r", "a", "b", "c"}) == (30, None)
    # peers still downloading a state (syncing at their old round) or waiting to start are no majority
    assert sync_target({"a": 30, "b": 30, "s": 0, "t": 0}, set(), {"a", "b"}) == (30, None)
    assert sync_target({}, {"a"}, set()) == (-1, None)
