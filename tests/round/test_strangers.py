"""Strangers (peers never seen in our groups or union, without standing): the barrier's waits for them
come from a budget (protocol/round/no_shows.py ``WaitBudget``), they lead no peer that knows better,
and a group they cost time keeps them out for a share of it. Scripted views and a fake clock: no
processes. Peers that lost each other and find each other again are tests/round/test_rejoin.py's."""

from __future__ import annotations

from peer.round.barrier import Barrier
from protocol.round.timing import Timing
from tests.round.test_liveness import view
from tests.round.test_rejoin import barrier


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


def test_the_merge_waits_for_strangers_alone_what_the_budget_grants(monkeypatch, clock):
    # peer/round/merge.py asks how long it may wait for peers of the round that never name a set: the
    # whole allowance (None) in our first round or where a peer we know is among them; for strangers
    # alone, what the budget grants (one read at least), and what it waits in vain is paid from it
    m = barrier(monkeypatch, clock, lambda m: [view("me", 7)])
    cap = m.straggler_allowance()
    assert m.strangers_wait({"n1", "n2"}) is None  # our first round: nobody limits
    m.came_in(6, {"a"})
    assert m.strangers_wait({"n1", "a"}) is None and m.strangers_wait(set()) is None
    assert m.strangers_wait({"n1", "n2"}) == cap  # the budget starts full: one allowance
    m.waited_for_strangers(cap)
    assert m.strangers_wait({"n1"}) == min(cap, m.read_interval() + m.read_latency())  # spent: one read
    clock.sleep(cap / m.wait_budget.share)
    assert m.strangers_wait({"n1"}) == cap  # refilled at its share of wall time
