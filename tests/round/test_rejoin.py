"""Two honest peers that lost each other once find each other again, and a group's start-hash vote
counts only members whose payload counted. Scripted views and a fake clock: no processes."""

from __future__ import annotations

import dataclasses
import threading

from peer.round.barrier import Barrier
from peer.round.membership import Membership
from peer.host.runtime import majority_hash
from protocol.round.no_shows import retry_round
from protocol.round.timing import Timing
from tests.conftest import Clock  # noqa: F401
from tests.round.test_liveness import SPEC, view


def barrier(monkeypatch, clock, script):
    m = Membership(dht=None, spec=SPEC, peer_id="me", progress=lambda: None, stop=threading.Event())
    m.train_seconds = 4.0
    monkeypatch.setattr(m, "view", lambda: script(m))
    return m


def test_a_peer_that_fell_behind_once_is_waited_for_again_within_two_rounds(monkeypatch, clock):
    # round 6: "a" announced itself and did not come (a lost matchmaking reply, an overloaded host)
    state = {"round": 6, "a": "training"}
    m = barrier(monkeypatch, clock, lambda m: [view("me", state["round"]), view("a", state["round"], state["a"])])
    b = m.wait_for_round(6, set(), first_round=False)
    assert b.expected == 1 and m._waited == {"a"}
    # round 7: "a" is skipped (we go alone at once, not after the allowance)
    state["round"] = 7
    t0 = clock.now
    b = m.wait_for_round(7, set(), first_round=False)
    assert m.no_shows == {"a"} and clock.now - t0 < 0.5 and b.alone
    # round 8 (a multiple of the skip length, 2): "a" caught up and trains our round: we wait for it again
    state["round"] = 8
    t0 = clock.now
    m.wait_for_round(8, set(), first_round=False)
    assert "a" not in m.no_shows and clock.now - t0 >= 4.0  # waited (the straggler allowance), not skipped


def test_the_skip_doubles_with_every_miss_and_a_group_ends_a_first_miss_only(monkeypatch, clock):
    state = {"round": 0}
    m = barrier(monkeypatch, clock, lambda m: [view("me", state["round"]), view("x", state["round"], "training")])
    waited_rounds = []
    for r in range(1, 200):
        state["round"] = r
        m.wait_for_round(r, set(), first_round=False)
        if m._waited:  # x was waited for (in vain) this round
            waited_rounds.append(r)
    # the skip doubles (2, 4, ... Timing.max_skip_rounds) and ends on a multiple of its length
    assert waited_rounds[:6] == [1, 4, 8, 16, 32, 64]
    assert {b - a for a, b in zip(waited_rounds[5:], waited_rounds[6:])} == {Timing.max_skip_rounds}
    # a staller costs one allowance per skip period: about 1 round in Timing.max_skip_rounds in the long run
    assert len(waited_rounds) <= 200 // Timing.max_skip_rounds + 6
    # x turning up in our group does not wipe its strikes: it stays skipped until its skip ends
    m.wait_for_round(200, {"x"}, first_round=False)
    assert "x" in m.no_shows and m.ledger.strikes("x") > 1 and "x" not in m.absent  # met, not waited for
    # a peer with a single miss is waited for again as soon as it comes
    m.missed({"y"}, 200)
    assert "y" in m.no_shows
    m.came_in(201, {"y"})
    assert "y" not in m.no_shows


def test_peers_that_missed_a_staller_in_neighbouring_rounds_wait_for_it_again_together(monkeypatch, clock):
    # "a" saw the staller's claim a read earlier than "b" and waited for it one round before "b" did
    rounds = {"a": 14, "b": 15}
    members = {}
    for name in rounds:
        members[name] = barrier(monkeypatch, clock, lambda m, name=name: [view("me", rounds[name]), view("x", rounds[name], "training")])
    for name, m in members.items():
        m.wait_for_round(rounds[name], set(), first_round=False)
    waits = {name: [] for name in members}
    for r in range(16, 41):
        for name, m in members.items():
            rounds[name] = r
            m.wait_for_round(r, set(), first_round=False)
            if m._waited:
                waits[name].append(r)
    assert waits["a"] == waits["b"] == [18, 20, 24, 32]
    assert retry_round(17, 2) == retry_round(19, 2) == 20 and retry_round(20, 2) == 20
    assert retry_round(1000, 40) == 1024 and retry_round(1025, 40) == 1024 + Timing.max_skip_rounds


def test_only_members_whose_payload_counted_vote_on_the_start_hash():
    mine, other = "0123456789abcdef", "fedcba9876543210"
    # a two-member group: the attacker's payload was refused, so its (smallest) hash does not vote
    assert majority_hash({"me": mine, "x": ""}, excluded={"x"}, me="me") == mine
    assert majority_hash({"me": mine, "x": "0000000000000000"}, excluded={"x"}, me="me") == mine
    # malformed hashes never vote, even from a counted member
    assert majority_hash({"me": mine, "x": ""}, me="me") == mine
    assert majority_hash({"me": mine, "x": "0" * 64}, me="me") == mine
    # honest members: the majority wins; a tie goes to the smallest hash, the same on every member
    assert majority_hash({"me": mine, "a": other, "b": other}, me="me") == other
    assert majority_hash({"me": other, "a": mine}, me="me") == mine
    assert majority_hash({"a": mine, "me": other}, me="a") == mine


def test_a_tie_goes_to_a_start_that_a_member_able_to_serve_its_state_holds():
    small, large = "0123456789abcdef", "fedcba9876543210"
    # a full peer and a --client-mode peer that each trained round 0 alone: the client's smaller hash
    # would win the tie, and the full peer could not download it (a client shares no state)
    for me in ("full", "client"):
        assert majority_hash({"full": large, "client": small}, me=me, unservable={"client"}) == large
    # the count still comes first: two clients outvote one full peer (the full peer serves them)
    assert majority_hash({"full": large, "c1": small, "c2": small}, me="full", unservable={"c1", "c2"}) == small
    # no member able to serve either: the smallest, as before
    assert majority_hash({"c1": large, "c2": small}, me="c1", unservable={"c1", "c2"}) == small


def test_peers_forgiven_are_waited_for_again_at_once(monkeypatch, clock):
    m = barrier(monkeypatch, clock, lambda m: [view("me", 7), view("a", 7, "training")])
    for r in (1, 2, 4):
        m.missed({"a"}, r)
    m.wait_for_round(7, set(), first_round=False)
    assert m.no_shows == {"a"}
    m.forgive(["a"])
    assert m.no_shows == set() and m.ledger.strikes("a") == 0
    t0 = clock.now
    m.wait_for_round(7, set(), first_round=False)
    assert clock.now - t0 >= 4.0  # waited for (the straggler allowance)


def test_a_pair_naming_a_fake_set_every_round_is_struck_and_a_sender_in_our_union_is_not(monkeypatch, clock):
    # x and y claim "training" in every round we reach, then both name one set of it that we never get:
    # before, that claim ("we gathered in a group of our own") kept them from ever being struck, so
    # the pair cost one straggler allowance every round. z came: its signed payload is in our union
    state = {"round": 10}

    def script(m):
        r = state["round"]
        claims = [view(p, r, "training") for p in ("x", "y", "z")]
        for v in claims:
            v.progress = dataclasses.replace(v.progress, gathered_round=r - 1, gathered="1" * 32)
        return [view("me", r)] + claims

    m = barrier(monkeypatch, clock, script)
    waited = []
    for r in range(10, 10 + 4 * Timing.excuse_every_rounds):
        state["round"] = r
        m.wait_for_round(r, set(), first_round=False)
        m.came_in(r, {"z"})
        waited.append(r) if "x" in m._waited else None
        assert "z" not in m.no_shows
    # one excuse per Timing.excuse_every_rounds, and the skip grows between the excuses
    assert len(waited) <= 4 + 4 + Timing.max_skip_rounds.bit_length(), waited
    assert {"x", "y"} <= m.no_shows


def test_a_groupmate_that_sent_nothing_is_refused_in_matchmaking_for_a_skip_period(monkeypatch, clock):
    m = barrier(monkeypatch, clock, lambda m: [view("me", 9)])
    m.came_in(9, {"a"}, silent={"s"})
    assert m.refused(10) == m.refused(11) == {"s"} and m.refused(12) == set()  # the next rounds, to a multiple of 2
    # its payload in our union meanwhile (another group's set): a first strike is over
    m.came_in(10, {"s"})
    assert m.refused(11) == set()
    # silent again: the refusal doubles and outlives an appearance
    m.came_in(11, set(), silent={"s"})
    assert m.refused(12) == m.refused(15) == {"s"} and m.refused(16) == set()
    m.came_in(12, {"s"})
    assert m.refused(13) == {"s"}


def test_a_silent_groupmate_the_barrier_does_not_wait_for_takes_no_seat(monkeypatch, clock):
    # its refusal over (round 12), "s" is still a no-show of the barrier: matched, it filled a ready
    # honest peer's seat before a group's target counted only ready peers (bench/hostile.py --attacks
    # silent-member --sequential, round 3), and would hold the group a grace now: refused until the
    # barrier waits for it again
    m = barrier(monkeypatch, clock, lambda m: [view("me", 9)])
    m.came_in(9, {"a"}, silent={"s"})
    assert m.refused(12) == set()
    m.missed({"s", "late"}, 12)  # the barrier gave up on both: only the one that was silent is refused
    assert m.refused(12) == m.refused(13) == {"s"} and m.refused(14) == set()
    # given up on in this very round (not yet struck), or not waited for: the same
    assert m.refused(14, {"s", "late"}) == {"s"} and m.refused(14, {"late"}) == set()
    # ready by its record, it is still refused, and the group's target keeps it no seat
    b = Barrier(expected=3, alone=False, behind=False, ready=frozenset({"a", "s"}))
    assert b.without(m.refused(12)).ready == {"a"} and b.without(m.refused(12)).gather_size == 2
    assert b.without(frozenset()) is b
    # forgiven by time: one strike falls per Timing.forgive_after_rounds rounds it came in
    for r in range(14, 14 + Timing.forgive_after_rounds):
        m.came_in(r, {"s"})
    assert m.refused(20, {"s"}) == set()


def test_a_groupmate_that_held_our_requests_is_refused_even_though_its_payload_came(monkeypatch, clock):
    # "h" served its payload to another member and held ours (peer/exchange/gatherer.py ``GatherResult.held``):
    # its payload is in our union, and still this peer refuses it, as every member it held does
    m = barrier(monkeypatch, clock, lambda m: [view("me", 9)])
    m.came_in(9, {"a", "h"}, held={"h"})
    assert m.refused(10) == m.refused(11) == {"h"} and m.refused(12) == set()
    assert "h" not in m.no_shows  # it came: the barrier waits for it as for anyone
    m.came_in(11, {"h"}, held={"h"})  # again: the refusal doubles
    assert m.refused(15) == {"h"} and m.refused(16) == set()
    m.came_in(12, set(), silent=(p for p in ["s"]), held={"s"})  # cut, and nothing of it reached the group: one strike, not two
    assert "s" in m.refused(13) and "s" not in m.refused(14)


def test_a_peer_that_refuses_every_other_peer_in_rounds_is_cut_off(monkeypatch, clock):
    # two peers, one refusing the other until a later round: its rounds without a group train alone,
    # so that the refusal's rounds pass (deferred, both stayed in round 4 for ever)
    m = barrier(monkeypatch, clock, lambda m: [view("me", 4), view("s", 4, "training")])
    assert not m.cut_off(4)  # nobody refused: defer and catch up as before
    m.came_in(3, {"me"}, silent={"s"})
    assert m.refused(4) == {"s"} and m.cut_off(4)
    assert not m.cut_off(6)  # the refusal's end: it is waited for again
    m2 = barrier(monkeypatch, clock, lambda m: [view("me", 4), view("s", 4, "training"), view("t", 4, "training")])
    m2.came_in(3, {"me", "t"}, silent={"s"})
    assert not m2.cut_off(4)  # another peer to group with: no
    m3 = barrier(monkeypatch, clock, lambda m: [view("me", 4)])
    assert not m3.cut_off(4)  # alone is the barrier's finding, not this one
