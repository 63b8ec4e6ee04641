"""Standing tables (protocol/round/standing.py): how they advance and what is accepted from another peer."""

from __future__ import annotations

import pytest

from protocol.round import standing
from protocol.round.standing import MAX_COUNT, MAX_SENDERS, StandingError, advance, checked


def test_counted_senders_gain_a_round_refused_ones_start_again_and_the_rest_keep_theirs():
    table = advance({"a": 2, "b": 5, "c": 1}, counted=["a", "d"], refused=["b"])
    assert table == {"a": 3, "c": 1, "d": 1}  # b's 5 rounds are gone; c was not in the round
    assert list(table) == sorted(table)  # one order everywhere
    assert advance({"a": MAX_COUNT}, ["a"], []) == {"a": MAX_COUNT}


def test_a_table_keeps_the_senders_of_most_standing_and_drops_the_same_ones_everywhere():
    full = {f"s{i:05d}": 1 + i % 7 for i in range(MAX_SENDERS)}
    grown = advance(full, counted=["new-1", "new-2"], refused=[])
    ones = sorted(s for s, n in {**full, "new-1": 1, "new-2": 1}.items() if n == 1)
    assert len(grown) == MAX_SENDERS and (set(full) | {"new-1", "new-2"}) - set(grown) == set(ones[-2:])
    assert grown == advance(dict(reversed(full.items())), ["new-2", "new-1"], [])  # whatever the order


@pytest.mark.parametrize("raw", [
    [], {"a": 0}, {"a": -1}, {"a": True}, {"a": 1.5}, {"": 1}, {"x" * 129: 1}, {1: 1}, {"a": MAX_COUNT + 1},
    {f"s{i}": 1 for i in range(MAX_SENDERS + 1)},
], ids=["list", "zero", "negative", "bool", "float", "empty-name", "long-name", "int-name", "too-large", "too-many"])
def test_a_table_from_another_peer_that_is_not_one_is_refused(raw):
    with pytest.raises(StandingError):
        checked(raw)


def test_a_valid_table_or_none_is_accepted():
    assert checked(None) == {}
    assert checked({"b": 2, "a": 1}) == {"a": 1, "b": 2}
    assert standing.ESTABLISHED >= 2 and standing.MIN_JUDGES >= 2


def test_fresh_senders_weigh_at_most_a_third_of_a_round_once_established_ones_judge():
    from fractions import Fraction

    from protocol.round.standing import FRESH_SHARE, MIN_JUDGES, weights

    # few fresh ones beside the established, or nobody established yet: every contribution weighs 1
    assert weights([True, True, False]) == [1.0, 1.0, 1.0]
    assert weights([False] * 9) == [1.0] * 9
    assert weights([True] * (MIN_JUDGES - 1) + [False] * 9) == [1.0] * (MIN_JUDGES - 1 + 9)
    assert weights([]) == []
    for e, f in [(2, 2), (3, 4), (2, 100), (5, 3), (3, 1000)]:
        w = weights([True] * e + [False] * f)
        assert w[:e] == [1.0] * e and len(set(w[e:])) == 1 and w[e] < 1.0
        share = Fraction(sum(w[e:])) / (e + Fraction(sum(w[e:])))
        assert abs(share - FRESH_SHARE) < Fraction(1, 10**12), (e, f, float(share))
    # the order of the contributions does not change any one's weight
    mixed = weights([False, True, False, True, False])
    assert mixed[1] == mixed[3] == 1.0 and mixed[0] == mixed[2] == mixed[4] == weights([True, True, False, False, False])[4]


def test_a_fresh_sender_with_a_weak_but_steady_direction_counts_once_its_pooled_scores_reach_the_bar():
    from protocol.round.standing import convinced, gather

    evidence, table, counted_rounds = {}, {}, []
    for r, z in enumerate([2.0, 2.2, 1.9, 2.1, 2.0]):  # a chain stage's scores: below 3 every round
        counts = convinced(evidence.get("chain"), z, 3.0)
        counted_rounds += [r] if counts else []
        table = advance(table, ["chain"] if counts else [], [] if counts else ["chain"])
        evidence = gather(evidence, {"chain": z}, [] if counts else ["chain"], [], table, [] if counts else ["chain"])
    assert counted_rounds == [2, 3, 4]  # (2 + 2.2 + 1.9) / sqrt(3) = 3.52
    assert "chain" not in evidence and table["chain"] == 3  # without scores every counted round earns standing
    assert convinced(None, 3.0, 3.0) and convinced({"x": (9000, 8)}["x"], 3.5, 3.0)  # never stricter than one round
    assert not convinced((9000, 3), 0.0, 3.0) and not convinced((9000, 3), -1.0, 3.0)


def test_a_score_at_or_below_zero_or_a_refusal_for_another_reason_starts_the_pool_again():
    from protocol.round.standing import EVIDENCE_ROUNDS, gather

    pools = gather({}, {"a": 2.0, "b": 1.5, "c": -0.5}, ["a", "b", "c"], [], {}, unconvinced=["a", "b"])
    assert pools == {"a": (2000, 1), "b": (1500, 1)}
    assert gather({}, {"a": 2.0}, ["a"], [], {}) == {}  # scored, then refused for another reason (a non-finite step)
    assert gather(pools, {"a": -0.1}, ["a"], [], {}) == {"b": (1312, 1)}  # (b, not scored, fades by 1/8)
    assert gather(pools, {}, ["b"], [], {}) == {"a": (1750, 1)}  # refused unscored: a bad payload
    assert gather(pools, {"a": 2.0}, [], ["a"], {}) == {"a": (2000, 1), "b": (1312, 1)}  # a copy pools nothing
    full = {"a": (16000, EVIDENCE_ROUNDS)}
    assert gather(full, {"a": 1.0}, [], [], {}) == {"a": (14000 + 1000, EVIDENCE_ROUNDS)}  # the oldest fade


def test_a_departed_senders_pool_fades_each_round_and_is_gone_within_absent_rounds():
    """Before, a pool stayed until the table's cap pushed it out: identities that left with pools
    larger than an honest chain stage's could push the stage's pool out of a full table."""
    from protocol.round.standing import ABSENT_ROUNDS, EVIDENCE_ROUNDS, MAX_MILLI, gather

    pools, rounds = {"gone": (MAX_MILLI, EVIDENCE_ROUNDS), "stage": (2500, 1)}, 0
    pools = gather(pools, {"stage": 1.5}, [], [], {})
    assert pools["gone"] == (MAX_MILLI * 7 // 8, EVIDENCE_ROUNDS) and pools["stage"] == (4000, 2)
    while "gone" in pools:
        pools, rounds = gather(pools, {"stage": 0.5}, [], [], {}), rounds + 1
    assert rounds < ABSENT_ROUNDS and "stage" in pools
    skipped = gather({"stage": (4000, 2)}, {}, [], [], {})  # an honest sender missing one round keeps 7/8
    assert skipped == {"stage": (3500, 2)}


def test_noise_passes_the_pooled_bar_about_as_seldom_as_the_single_round_bar():
    """Scores of an update without direction, drawn N(0, 1): the share of rounds that count with
    pooling (0.47 % for this seed) against z >= 3 alone (0.13 %): the price of not refusing a weak
    honest sender for ever."""
    import random

    from protocol.round.standing import convinced, gather

    rng, evidence, table, passed, rounds = random.Random(7), {}, {}, 0, 200_000
    for _ in range(rounds):
        z = rng.gauss(0.0, 1.0)
        counts = convinced(evidence.get("n"), z, 3.0)
        passed += counts
        table = {"n": 1} if counts else {}  # never established: judged as fresh every round
        evidence = gather(evidence, {"n": z}, [] if counts else ["n"], [], table, [] if counts or z <= 0 else ["n"])
    assert passed / rounds < 4 * 0.00135, passed / rounds


@pytest.mark.parametrize("raw", [
    [], {"a": [1]}, {"a": [0, 1]}, {"a": [5, 0]}, {"a": [5, 9]}, {"a": [True, 1]}, {"a": [1.5, 1]}, {"": [1, 1]},
    {"a": "x"}, {f"s{i}": [1, 1] for i in range(MAX_SENDERS + 1)},
], ids=["list", "short", "zero-sum", "zero-rounds", "too-many-rounds", "bool", "float", "empty-name", "str",
        "too-many"])
def test_an_evidence_table_from_another_peer_that_is_not_one_is_refused(raw):
    with pytest.raises(StandingError):
        standing.checked_evidence(raw)
    assert standing.checked_evidence(None) == {} and standing.checked_evidence({"b": [5, 2], "a": (1, 1)}) == {
        "a": (1, 1), "b": (5, 2)}


def test_standing_is_earned_by_agreement_and_spent_by_a_contribution_no_better_than_chance():
    """With the round's scores, a sender gains a round only where it passed the bar on its own: a
    fresh one counted on pooled evidence and an established one with a weak direction keep their
    count; an established one at or below chance that still counted loses one; a refusal is 0."""
    table = {"est-weak": 5, "est-zero": 5, "est-neg": 9, "est-new": 3, "fresh-pooled": 1, "fresh-strong": 2}
    scores = {"est-weak": 0.4, "est-zero": 0.0, "est-neg": -2.0, "est-new": -0.5, "fresh-pooled": 2.2,
              "fresh-strong": 3.0, "new": 3.5}
    after = advance(table, list(scores), [], scores, 3.0)
    assert after == {"est-weak": 5, "est-zero": 4, "est-neg": 8, "est-new": 2, "fresh-pooled": 1, "fresh-strong": 3, "new": 1}
    assert advance(table, list(scores), [], scores, 0.0) == advance(table, list(scores), [])  # check off: counting alone
    assert advance(table, ["unscored"], ["fresh-strong"], scores, 3.0) == {
        "est-weak": 5, "est-zero": 5, "est-neg": 9, "est-new": 3, "fresh-pooled": 1, "unscored": 1}  # no score: counting alone


def test_a_fresh_full_replica_must_reach_a_share_of_its_rounds_median_score():
    """standing.fresh_bar: min_z, or the fraction of the lower median of the round's full-replica
    scores where higher; a minority cannot lift it past the majority's scores; 0 turns it off."""
    from protocol.round.standing import fresh_bar
    honest, garbage = [18.0, 22.0, 26.0, 20.0, 24.0, 19.0], [3.5, 2.8, 3.1]
    bar = fresh_bar(3.0, 0.25, honest + garbage)
    assert bar == 0.25 * 19.0 and all(z < bar for z in garbage) and all(z >= bar for z in honest)
    assert fresh_bar(3.0, 0.25, [4.0, 5.0, 6.0]) == 3.0  # weak rounds: the fixed bar stands
    assert fresh_bar(3.0, 0.0, honest) == 3.0 and fresh_bar(3.0, 0.25, []) == 3.0
    # a minority scoring itself sky-high does not lift the bar past the honest majority
    assert fresh_bar(3.0, 0.25, honest + [1e6] * 5) <= 0.25 * max(honest)
    assert fresh_bar(3.0, 1.0, [10.0, 20.0]) == 10.0  # the lower median of an even count


def test_lower_median_is_the_lower_of_two_middles_whatever_the_order():
    assert standing.lower_median([4.0, 1.0, 3.0, 2.0]) == 2.0
    assert standing.lower_median([5.0, 1.0, 3.0]) == 3.0
    assert standing.lower_median([7.0]) == 7.0
