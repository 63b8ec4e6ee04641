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


def test_waits_for_strangers_come_from_a_budget_and_acquaintances_get_the_whole_allowance(monkeypatch, clock):
    # rounds 10-13: a new identity announces each round and never comes; "a" (a groupmate) and "b" (a
    # sender with standing in our lineage) are waited for the whole allowance whatever the budget holds
    state = {"round": 10, "stall": "s10", "late": None}
    ready_at = {}

    def script(m):
        out = [view("me", state["round"]), view(state["stall"], state["round"], "training")]
        if state["late"] is not None:
            p = state["late"]
            out.append(view(p, state["round"], "ready" if clock.now >= ready_at[p] else "training"))
        return out

    m = barrier(monkeypatch, clock, script)
    cap = m.straggler_allowance()
    t0 = clock.now
    m.wait_for_round(10, set(), first_round=False)
    assert clock.now - t0 >= cap  # our first round: strangers get the whole allowance (paid from the budget)
    m.came_in(10, {"a"})
    clock.sleep(cap / m.wait_budget.share)  # its share of that refills the budget: one allowance
    state.update(round=12, stall="s12")
    t0 = clock.now
    m.wait_for_round(12, set(), first_round=False)
    assert cap <= clock.now - t0 < cap + 1.0  # the budget starts full: one allowance, now spent
    state.update(round=13, stall="s13")
    t0 = clock.now
    m.wait_for_round(13, set(), first_round=False)
    assert clock.now - t0 < m.read_interval() + 0.5  # spent: one read of the view, no heartbeat's floor
    for p, known in (("a", ()), ("b", ("b",))):  # a groupmate, a sender with standing: the whole allowance
        state.update(round=state["round"] + 1, stall=f"s{state['round'] + 1}", late=p)
        ready_at[p] = clock.now + cap - 1.0
        b = m.wait_for_round(state["round"], set(), first_round=False, known=known)
        assert p in b.ready


def test_in_our_first_round_strangers_get_the_whole_allowance_even_with_the_budget_spent(monkeypatch, clock):
    state = {"round": 3, "stall": "s3"}
    m = barrier(monkeypatch, clock, lambda m: [view("me", state["round"]), view(state["stall"], state["round"], "training")])
    cap = m.straggler_allowance()
    for r in (3, 4):  # two vain waits before we concluded a round: the budget is spent, not applied
        state.update(round=r, stall=f"s{r}")
        t0 = clock.now
        m.wait_for_round(r, set(), first_round=False)
        assert clock.now - t0 >= cap
    assert m.wait_budget.balance < 0
    m.came_in(4, set())  # one round concluded (Timing.budget_after_rounds): from now on the budget applies
    state.update(round=5, stall="s5")
    t0 = clock.now
    m.wait_for_round(5, set(), first_round=False)
    assert clock.now - t0 < 2.0  # in debt: one read of the view


def test_a_stranger_whose_record_claims_it_ended_the_round_is_still_a_stranger(monkeypatch, clock):
    # round 20: "n" (a new identity) is waited for what the spent budget holds, then says it ended round
    # 20: a claim, not an appearance (a new identity made it after each wait and was waited for the whole
    # allowance the next round: bench/hostile.py --attacks silent-fresh); its payload in our union is one
    state = {"round": 20, "n": "training"}
    m = barrier(monkeypatch, clock, lambda m: [view("me", state["round"]), view("n", 20, state["n"])])
    m.came_in(18, set())
    m.came_in(19, set())
    m.wait_budget.spend(100.0, clock.now, m.straggler_allowance())
    t0 = clock.now
    m.wait_for_round(20, set(), first_round=False)
    assert clock.now - t0 < m.straggler_allowance() and m.wait_budget.stranger("n")
    state.update(round=21, n="exchanging")
    m.wait_for_round(21, set(), first_round=False)
    assert m.wait_budget.stranger("n")
    m.came_in(21, {"n"})  # its signed payload is in our union of a round: it came
    assert not m.wait_budget.stranger("n")


def test_a_sender_whose_update_was_refused_is_still_a_stranger(monkeypatch, clock):
    # a silent member served one groupmate its zero update and held everyone else: its payload reached
    # every member's union (it "came"), the direction check refused it, and each barrier after a strike
    # lapsed waited a whole allowance for it as for a peer we know (bench/hostile.py --attacks
    # silent-member, seed 2: 5.4-5.9 s in rounds 2 and 4). A refused contribution makes no acquaintance
    state = {"round": 30}
    m = barrier(monkeypatch, clock, lambda m: [view("me", state["round"]), view("x", state["round"], "training")])
    m.came_in(29, {"x", "a"})  # x's payload in our union
    m.wait_budget.spend(100.0, clock.now, m.straggler_allowance())
    t0 = clock.now
    m.wait_for_round(30, set(), first_round=False, refused={"x"})  # ... and refused by the round's checks
    assert clock.now - t0 < m.straggler_allowance() and m.wait_budget.stranger("x") and not m.wait_budget.stranger("a")
    state["round"] = 31
    t0 = clock.now
    m.wait_for_round(31, {"x"}, first_round=False, refused={"x"})  # a groupmate still, refused again
    assert m.wait_budget.stranger("x")
    # what the next barrier is given (peer/round/barrier.py meet_round): the refusals of the round's checks
    # only, not exclusions a peer may owe to others (a fetch that timed out, a list that misstated parts)
    from peer.round.draw import NOT_FETCHED
    from peer.round.report import RoundRecord
    from protocol.round import reconcile
    record = RoundRecord(round=31, params_hash="", group=["me", "x", "y", "z"], contributors=1, bytes_sent=0,
                         excluded={"x": "refused update: its direction ...", "y": NOT_FETCHED, "z": reconcile.SILENT},
                         bytes_received=0, loss=0.0, val_loss=0.0, seconds=0.0)
    assert record.refused() == {"x"}


def test_an_overlapped_peer_is_told_while_its_barrier_waits_for_strangers_alone(monkeypatch, clock):
    """``Membership.waiting_for_strangers`` pauses an overlapped peer's steps (peer/round/loop.py
    ``_pause_for_no_shows``): set only while every peer still waited for is a stranger and the budget
    applies (not while an acquaintance is still coming), clear once the barrier ends."""
    ready_at = clock.now + 1.0
    seen = []  # (is the acquaintance ready, the flag as the read found it)

    def script(m):
        a = "ready" if clock.now >= ready_at else "training"
        seen.append((a, m.waiting_for_strangers.is_set()))
        return [view("me", 7), view("s7", 7, "training"), view("a", 7, a)]

    m = barrier(monkeypatch, clock, script)
    m.came_in(6, {"a"})  # "a" came (an acquaintance), and one round concluded: the budget applies
    b = m.wait_for_round(7, set(), first_round=False)
    assert "a" in b.ready and "s7" in b.gave_up
    assert not any(flag for a, flag in seen[:2]), seen  # "a" still coming: no pause
    assert any(flag for a, flag in seen if a == "ready"), seen  # the stranger alone: paused
    assert not m.waiting_for_strangers.is_set()


def test_early_close_does_not_count_the_claims_no_barrier_waits_for(monkeypatch, clock):
    """``Membership.unawaited``: skipped no-shows always, strangers once the budget applies; with
    them left out a staller's "training" record no longer keeps the others' rounds open
    (peer/round/early_close.py ``most_are_done``)."""
    from peer.round.early_close import most_are_done

    views = [view("me", 7), view("a", 7, "ready"), view("b", 7, "training"), view("s", 7, "training"),
             view("x", 7, "training")]
    m = barrier(monkeypatch, clock, lambda m: views)
    assert m.unawaited(views) == set()  # our first round: nobody is a stranger to us yet
    m.came_in(6, {"a", "b"})  # one round concluded, "a" and "b" came: "s" and "x" are strangers now
    m.no_shows.add("x")
    assert m.unawaited(views) == {"s", "x"}
    assert not most_are_done(views, "me", 7)  # one ready against three training
    assert most_are_done(views, "me", 7, m.unawaited(views))  # one ready against "b" alone


def test_strangers_that_cost_our_group_time_keep_strangers_out_for_a_share_of_it(monkeypatch, clock):
    # a new identity every round joins our group and holds it (bench/hostile.py --attacks silent-fresh):
    # no strike reaches the next one, so the time they cost is charged, and while it is owed our
    # matchmaking admits no stranger: only peers seen to come (or with standing), and ourselves
    m = barrier(monkeypatch, clock, lambda m: [view("me", 9), view("a", 9), view("x2", 9)])
    m.came_in(8, {"a"})
    assert m.admits_strangers() and m.admitted() is None and m.refused(9) == set()
    clock.now += 20.0  # the matchmaking and gather the stranger x1 held
    m.came_in(9, {"a"}, silent={"x1"}, cost_s=20.0)
    assert not m.admits_strangers()
    assert m.refused(10) == {"x1", "x2"} and m.admitted() == {"a", "me"}  # x1 struck; x2: a stranger in our view
    assert Barrier(expected=3, alone=False, behind=False, ready=frozenset({"a", "x2"})).without(m.refused(10)).ready == {"a"}
    # owed: the 20 s (the budget holds nothing in advance), refilled at half of vain_wait_share of wall time
    owed = 20.0 / m.stranger_seats.share
    clock.now += owed - 1.0
    assert not m.admits_strangers()
    clock.now += 2.0
    assert m.admits_strangers() and m.admitted() is None and m.refused(12) == set()
    # a peer we know that sends nothing is struck as ever, and costs no stranger any seat
    clock.now += 20.0
    m.came_in(12, set(), silent={"a"}, cost_s=20.0)
    assert m.admits_strangers() and m.refused(13) == {"a"}


def test_a_stranger_not_waited_for_in_a_later_agreement_round_is_charged_but_not_struck(monkeypatch, clock):
    # it served its payload and held our round-2 request (peer/exchange/agreement_rounds.py): its payload
    # counts, no matchmaking refusal (an honest newcomer on a slow link answers late too), but the time
    # is charged to the strangers' budget, so a new identity every round costs a share of wall time
    m = barrier(monkeypatch, clock, lambda m: [view("me", 9), view("a", 9), view("x2", 9)])
    m.came_in(8, {"a"})
    clock.now += 8.0
    m.came_in(9, {"a", "x1"}, lagged={"x1"}, cost_s=8.0)
    assert not m.admits_strangers() and "x1" not in m.silent.skipped(10)
    assert m.refused(10) == {"x2"}  # x1 came (its payload is in our union): no stranger now, nor refused
    # a peer we know that is not waited for costs nothing
    clock.now += 8.0 / m.stranger_seats.share + 1.0
    m.came_in(10, {"a", "x1"}, lagged={"a"}, cost_s=8.0)
    assert m.admits_strangers()


def test_a_new_silent_identity_every_round_costs_a_bounded_share_of_any_window(monkeypatch, clock):
    # rounds of 10 s; whenever our matchmaking admits strangers, a new one joins and holds the exchange 20 s
    m = barrier(monkeypatch, clock, lambda m: [view("me", 0)])
    start, held = clock.now, 0.0
    for r in range(400):
        cost = 20.0 if m.admits_strangers() else 0.0
        clock.now += 10.0 + cost
        held += cost
        m.came_in(r, set(), silent={f"x{r}"} if cost else set(), cost_s=cost + 1.0)
    window = clock.now - start
    assert held / window <= Timing.vain_wait_share / 2 * 1.1  # the seats' half of the strangers' share
    assert held / window >= Timing.vain_wait_share / 4
    assert held > 0  # strangers are admitted again once the budget holds time


def test_a_stranger_leads_no_peer_that_knows_a_ready_peer(monkeypatch, clock):
    # a new identity that leads closes its group at whatever size suits it (bench/hostile.py --attacks
    # silent-fresh, seed 0: a group of two honest peers and itself, the third honest peer out of the round)
    m = barrier(monkeypatch, clock, lambda m: [view("me", 9)])
    assert m.leaders({"a", "x"}) is None  # nobody known yet (a run's start): anyone may lead
    m.came_in(8, {"a"})
    assert m.leaders({"a", "x"}) == {"a", "me"}
    m.wait_budget.lineage({"b": 4})  # standing in our lineage makes a peer known too
    assert m.leaders({"a", "x"}) == {"a", "b", "me"}
    assert m.leaders({"x", "y"}) is None  # none we know is ready: strangers lead strangers
    m.came_in(9, {"a"}, silent={"z"}, cost_s=10.0)  # a stranger held our group: ``admitted`` restricts instead
    assert m.admitted() == {"a", "b", "me"} and m.leaders({"a", "x"}) is None


def test_while_strangers_are_refused_the_barrier_waits_for_none_of_them(monkeypatch, clock):
    # "x" (a new identity) announces the round and never comes: waited for what the budget for strangers
    # holds (one allowance at first), but not at all while our matchmaking would refuse it anyway
    r = {"round": 9}
    m = barrier(monkeypatch, clock, lambda m: [view("me", r["round"]), view("a", r["round"]),
                                               view(f"x{r['round']}", r["round"], "training")])
    m.came_in(8, {"a"})
    t0 = clock.now
    m.wait_for_round(9, set(), first_round=False)
    assert clock.now - t0 >= 4.0
    clock.now += 20.0
    m.came_in(9, {"a"}, silent={"y"}, cost_s=20.0)
    r["round"] = 10
    t0 = clock.now
    b = m.wait_for_round(10, set(), first_round=False)
    # not even the one read a stranger gets while admitted (0.5 s a round, bench/hostile.py --attacks silent-fresh);
    # given up at once: the merge does not wait for it while it trains, and it is struck if it never comes
    assert clock.now - t0 < m.read_interval() and "x10" in b.gave_up and "x10" not in b.unawaited
    r["round"] = 11
    m.wait_for_round(11, set(), first_round=False)
    assert "x10" in m.no_shows


def test_a_groupmate_that_sent_nothing_or_held_our_requests_is_no_mate_of_the_next_barrier():
    from peer.round.report import RoundRecord
    from protocol.round import reconcile
    record = RoundRecord(round=3, params_hash="", group=["a", "me", "s", "q"], contributors=2,
                         excluded={"s": reconcile.SILENT, "q": "refused update: its direction ..."}, bytes_sent=0,
                         bytes_received=0, loss=0.0, val_loss=0.0, seconds=0.0)
    assert record.mates("me") == {"a", "q"}
    # nor one that held our requests, or a stranger a later agreement round stopped waiting for
    record.held = ["q"]
    assert record.mates("me") == {"a"}
    assert record.judged("me") == {"s", "q"}  # the next barrier's peers still exchanging the round exclude them


def test_a_member_that_held_last_round_is_not_waited_for_while_it_finishes_it(monkeypatch, clock):
    # "f" (a new identity) got into our group of round 7, its payload reached the group, and it held our
    # requests: its record says it is still exchanging round 7 for as long as it lives (bench/hostile.py
    # --attacks silent-fresh --rounds 15: 5.0-5.7 s each round after one it got into). Judged
    # (``RoundRecord.judged``), it is no peer still exchanging the round before
    state = {"f": view("f", 7, "exchanging")}
    m = barrier(monkeypatch, clock, lambda m: [view("me", 8), view("a", 8), state["f"]])
    m.came_in(7, {"a", "f"}, held={"f"})
    t0 = clock.now
    b = m.wait_for_round(8, {"a"}, first_round=False, judged={"f"})
    assert clock.now - t0 < 2.0 and "f" not in b.gave_up | b.unawaited
    # announcing round 8 while our matchmaking refuses it: given up at once, and no second strike
    state["f"] = view("f", 8, "training")
    t0 = clock.now
    b = m.wait_for_round(8, {"a"}, first_round=False, judged={"f"})
    assert clock.now - t0 < 2.0 and "f" in b.gave_up and "f" not in m._waited
    # a judged stranger our matchmaking does not refuse, still in round 7's exchange: not waited for;
    # not judged, it is waited for as any peer still exchanging the round before
    m2 = barrier(monkeypatch, clock, lambda m: [view("me", 8), view("a", 8), view("g", 7, "exchanging")])
    m2.came_in(7, {"a"})
    t0 = clock.now
    m2.wait_for_round(8, {"a"}, first_round=False, judged={"g"})
    assert clock.now - t0 < 2.0
    t0 = clock.now
    b = m2.wait_for_round(8, {"a"}, first_round=False)
    assert clock.now - t0 >= 2.0 and "g" in b.gave_up


def test_a_wait_for_strangers_alone_ends_once_a_ready_peer_we_know_has_left_its_barrier(monkeypatch, clock):
    # "a" (known) owes the strangers' budget and did not wait for "s" (new); we hold a full budget and
    # would wait an allowance, and "a"'s group would form without us (bench/hostile.py --attacks
    # lurk-fresh, seed 1: an honest peer left out of 3 rounds so). Once "a" says "exchanging" (stored at
    # once by a barrier that left strangers: ``Barrier.left_strangers``), we follow
    left_at = clock.now + 1.0
    m = barrier(monkeypatch, clock, lambda m: [view("me", 9), view("s", 9, "training"),
                                               view("a", 9, "exchanging" if clock.now >= left_at else "ready")])
    m.came_in(8, {"a"})
    t0 = clock.now
    b = m.wait_for_round(9, set(), first_round=False)
    assert 1.0 <= clock.now - t0 < 2.5 < m.straggler_allowance() and "s" in b.gave_up and b.left_strangers
    # nobody we know left: the budget's wait, as before; nobody new still coming: nothing to tell
    m2 = barrier(monkeypatch, clock, lambda m: [view("me", 9), view("s", 9, "training"), view("a", 9, "ready")])
    m2.came_in(8, {"a"})
    t0 = clock.now
    assert m2.wait_for_round(9, set(), first_round=False).left_strangers and clock.now - t0 >= m2.straggler_allowance()
    m3 = barrier(monkeypatch, clock, lambda m: [view("me", 9), view("a", 9, "exchanging")])
    m3.came_in(8, {"a"})
    assert not m3.wait_for_round(9, set(), first_round=False).left_strangers
    # most, not one: a known identity that says "exchanging" early while "b", known too, still waits
    # (and a stranger that says so) ends no wait for newcomers
    m4 = barrier(monkeypatch, clock, lambda m: [view("me", 9), view("s", 9, "training"), view("a", 9, "exchanging"),
                                                view("b", 9, "ready"), view("t", 9, "exchanging")])
    m4.came_in(8, {"a", "b"})
    t0 = clock.now
    m4.wait_for_round(9, set(), first_round=False)
    assert clock.now - t0 >= m4.straggler_allowance()
