"""protocol/round/no_shows.py: what a peer waited for in vain costs the swarm, over any window of rounds."""

from __future__ import annotations

import pytest

from protocol.round.no_shows import MAX_ENTRIES, NoShowLedger, WaitBudget, retry_round, skip_length
from protocol.round.timing import Timing

LONGEST, FORGIVE, EXCUSE = Timing.max_skip_rounds, Timing.forgive_after_rounds, Timing.excuse_every_rounds


def ledger() -> NoShowLedger:
    return NoShowLedger(LONGEST, FORGIVE, EXCUSE)


def waits(behaviour, rounds: int, book: NoShowLedger) -> list:
    """The rounds in which one peer was waited for and did not come. ``behaviour(r, waited)``: what it
    does in round r: "miss" (stall), "come" (a groupmate, its payload in our union), "claim" (names a
    set with an accomplice), or None (stays away, unnoticed)."""
    missed = []
    for r in range(rounds):
        waited = "x" not in book.skipped(r)
        act = behaviour(r, waited)
        if act == "come":
            book.came("x", r)
        elif waited and (act == "miss" or (act == "claim" and not book.excuse("x", r))):
            book.missed("x", r)
            missed.append(r)
    return missed


def most_in_a_window(rounds: list, window: int) -> int:
    return max((sum(1 for r in rounds if start <= r < start + window) for start in range(max(rounds, default=0) + 1)),
               default=0)


def test_an_alternating_staller_costs_one_wait_per_forgive_period():
    # it stalls whenever it is waited for and comes whenever it is skipped: before, every appearance
    # wiped its strikes, so it cost one wait every two rounds for ever
    missed = waits(lambda r, waited: "miss" if waited else "come", 1024, ledger())
    ramp = LONGEST.bit_length()  # 2, 4, ... LONGEST: the misses before the skip reaches its longest
    assert len(missed) <= ramp + 1024 // FORGIVE + 1
    for window in (16, 64, 256):
        assert most_in_a_window(missed, window) <= ramp + window // FORGIVE + 1, window


def test_a_staller_that_never_comes_costs_one_wait_per_longest_skip_at_most():
    missed = waits(lambda r, waited: "miss", 1024, ledger())
    assert missed[:5] == [0, 2, 4, 8, 16]
    assert len(missed) <= LONGEST.bit_length() + 1024 // FORGIVE + 1


def test_a_pair_that_claims_a_set_of_its_own_every_round_is_excused_now_and_then_only():
    # two identities name one fake set for every round they are waited for in: a claim, not an appearance
    missed = waits(lambda r, waited: "claim", 1024, ledger())
    book = ledger()
    excused = [r for r in range(1024) if "x" not in book.skipped(r) and book.excuse("x", r)]
    assert excused[:3] == [0, EXCUSE, 2 * EXCUSE]
    assert len(missed) <= LONGEST.bit_length() + 1024 // FORGIVE + 1


def test_an_honest_peer_that_fell_behind_once_is_waited_for_again_as_soon_as_it_comes():
    book = ledger()
    assert book.missed("x", 6) == 8 and book.skipped(7) == {"x"} and book.absent(7) == {"x"}
    book.came("x", 7)
    assert book.skipped(7) == set() and book.strikes("x") == 1
    # its strike stays for a while: a second miss soon after skips it for 4 rounds, coming or not
    assert book.missed("x", 9) == 12
    book.came("x", 10)
    assert book.skipped(10) == {"x"} and book.absent(10) == set()  # met in our groups, not waited for
    assert book.skipped(12) == set()
    # forgiven by coming: every FORGIVE rounds it comes in take a strike
    for r in range(12, 12 + FORGIVE):
        book.came("x", r)
    assert book.strikes("x") == 1
    for r in range(12 + FORGIVE, 12 + 2 * FORGIVE):
        book.came("x", r)
    assert book.strikes("x") == 0 and book.waits_again("x") == 0
    # a peer that never comes keeps its strikes, however long ago its last miss
    for r in (100, 102):
        book.missed("y", r)
    assert book.strikes("y") == 2


def test_forgive_is_a_clean_slate_and_arguments_are_checked():
    book = ledger()
    for r in (1, 3, 5, 8):
        book.missed("x", r)
    assert book.strikes("x") == 4 and "x" in book.skipped(9)
    book.forgive("x")
    assert book.strikes("x") == 0 and book.skipped(9) == set()
    with pytest.raises(ValueError):
        NoShowLedger(0, FORGIVE, EXCUSE)
    assert skip_length(0, LONGEST) == 1 and skip_length(99, LONGEST) == LONGEST
    assert retry_round(17, 2, LONGEST) == retry_round(19, 2, LONGEST) == 20


def test_a_set_counts_as_gathered_elsewhere_when_two_peers_name_it():
    from protocol.round.no_shows import claimed_elsewhere

    named = [("a", 5, "1" * 32), ("b", 5, "1" * 32), ("x", 5, "2" * 32), ("old", 3, "3" * 32), ("old2", 3, "3" * 32),
             ("none", 5, "")]
    assert claimed_elsewhere(named, 5) == {"a", "b"}  # x alone names its set; old and old2 named an earlier round's
    assert claimed_elsewhere(named, 3) == {"a", "b", "old", "old2"}


def test_the_merge_and_the_next_barrier_judging_one_absence_strike_once():
    book = ledger()
    assert book.missed("x", 7) == 8  # the merge of round 7 waited for it in vain
    assert book.missed("x", 8) == 8 and book.strikes("x") == 1  # the barrier of round 8, judging round 7
    assert book.missed("x", 10) == 12 and book.strikes("x") == 2  # a later absence is a new strike


def test_a_flood_of_identities_keeps_the_ledger_bounded():
    from protocol.round.no_shows import MAX_ENTRIES

    book = ledger()
    book.missed("old", 1)
    for i in range(MAX_ENTRIES + 10):
        book.missed(f"sybil{i}", 2 + i // 100)
    assert len(book._entries) == MAX_ENTRIES and book.strikes("old") == 0  # the stalest went first


# --- the budget for waits for strangers ------------------------------------------------------------
@pytest.mark.parametrize("train", [10.0, 2.0])
def test_waits_for_strangers_take_a_bounded_share_of_any_window(train):
    # a new identity announces every round and never comes: each barrier waits what the budget grants,
    # and at least one read of the view (peer/round/membership.py); short rounds too: the budget has no
    # floor of its own that every round would pay whatever its balance
    budget, cap, read = WaitBudget(share=0.2), 5.0, 0.1
    now, waits = 0.0, []
    for _ in range(60):
        now += train
        wait = max(budget.grant(now, cap), read)
        now += wait
        budget.spend(wait, now, cap)
        waits.append(wait)
    assert waits[0] == cap  # the first is waited for a whole allowance
    for i in range(len(waits)):  # any window of rounds: a fifth of its time, plus one allowance and its reads
        for j in range(i + 1, len(waits) + 1):
            window = sum(waits[i:j]) + train * (j - i)
            assert sum(waits[i:j]) <= 0.2 * window + cap + read * (j - i) + 1e-9
    assert sum(waits[10:]) / (sum(waits[10:]) + train * 50) <= 0.2 + read / train + 1e-9


def test_a_budget_not_spent_refills_and_grants_nothing_in_debt():
    budget = WaitBudget(share=0.2)
    assert budget.grant(0.0, 5.0) == 5.0  # full at the start: one allowance
    budget.spend(5.0, 5.0, 5.0)
    assert budget.grant(5.0, 5.0) == 0.0  # spent: the barrier's one read is all a stranger is waited
    assert budget.grant(10.0, 5.0) == pytest.approx(1.0)  # a fifth of the 5 s since
    budget.spend(3.0, 10.0, 5.0)  # waited past the grant (a slow read): a debt, repaid before the next grant
    assert budget.grant(15.0, 5.0) == 0.0 and budget.grant(20.0, 5.0) == pytest.approx(0.0)
    assert budget.grant(30.0, 5.0) == pytest.approx(2.0)
    assert budget.grant(100.0, 5.0) == 5.0  # full again
    assert budget.grant(1000.0, 2.0) == 2.0  # never more than the allowance of the moment
    for bad in (dict(share=1.0), dict(share=0.0), dict(share=0.2, after_rounds=-1)):
        with pytest.raises(ValueError):
            WaitBudget(**bad)


def test_only_strangers_past_our_first_rounds_are_limited_and_the_memory_is_bounded():
    budget = WaitBudget(share=0.2, after_rounds=2)
    assert budget.stranger("x") and not budget.limiting  # at a start everyone is a stranger: nobody is limited
    budget.grant(0.0, 5.0)
    budget.spend(20.0, 0.0, 5.0)  # ... but waits for them in vain are paid later, down to one allowance of debt
    assert budget.balance == -5.0
    budget.met(["a"])
    budget.concluded()
    budget.concluded()
    assert budget.limiting and budget.stranger("x") and not budget.stranger("a")
    budget.forget(["a", "never-met"])  # a's contribution was refused: no acquaintance from it
    assert budget.stranger("a")
    budget.met(["a"])
    budget.met(f"sybil{i}" for i in range(MAX_ENTRIES + 10))  # a flood of identities that came
    assert len(budget._met) == MAX_ENTRIES and budget.stranger("a")  # the oldest acquaintance went first


def test_the_lineage_table_is_consulted_not_copied_so_a_full_one_evicts_nobody_we_met():
    budget = WaitBudget(share=0.2, after_rounds=0)
    budget.met(["mate"])
    table = {f"sender{i}": 3 for i in range(MAX_ENTRIES)}  # a full standing table
    budget.lineage(table)
    assert not budget.stranger("mate") and not budget.stranger("sender7") and budget.stranger("x")
    assert len(budget._met) == 1
