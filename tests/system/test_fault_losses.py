"""tests/support/fault_losses.py: a fault's cost at equal tokens, from round records."""

import pytest

from tests.support.fault_losses import loss_at, loss_window, score, token_rounds

UNDISTURBED = {r: 3.0 - 0.05 * r for r in range(1, 40)}  # the undisturbed run's loss after r rounds


def rec(round_no, contributors=4, group=4, val_loss=None):
    return dict(round=round_no, contributors=contributors, group=["x"] * group,
                val_loss=UNDISTURBED[round_no] if val_loss is None else val_loss)


def test_token_rounds_count_each_rounds_most_contributors_in_undisturbed_rounds():
    records = [rec(1), rec(2, contributors=2, group=2), rec(2, contributors=3, group=3), rec(4, contributors=5, group=5)]
    assert token_rounds(records, 4, 5) == {1: 1.0, 2: 1.75, 3: 1.75, 4: 3.0, 5: 3.0}  # rounds 3 and 5: nobody


def test_loss_at_interpolates_between_rounds_and_knows_its_range():
    assert loss_at(UNDISTURBED, 2) == UNDISTURBED[2]
    assert loss_at(UNDISTURBED, 2.5) == pytest.approx((UNDISTURBED[2] + UNDISTURBED[3]) / 2)
    assert loss_at(UNDISTURBED, 0.5) is None and loss_at(UNDISTURBED, 39.5) is None


def test_loss_window_takes_each_rounds_largest_group():
    records = [rec(5, group=2, val_loss=9.0), rec(5, group=3, val_loss=2.0), rec(6), rec(9)]
    assert loss_window(records, range(4, 7)) == {5: 2.0, 6: UNDISTURBED[6]}


def _row(records, fault_at, recovered):
    before = loss_window(records, range(fault_at - 2, fault_at + 1))
    after = loss_window(records, range(recovered, recovered + 3))
    return dict(recovered_round=recovered, val_loss=after[recovered], val_losses_before=before, val_losses_after=after)


def test_a_fault_that_only_lost_tokens_costs_nothing_at_equal_tokens():
    # rounds 11-12 trained nothing into θ (every payload lost), and from then on the swarm's loss is
    # the undisturbed run's two rounds earlier: at equal rounds it looks 4 % worse, at equal tokens it is not
    records = [rec(r) for r in range(1, 11)] + [rec(r, contributors=0, val_loss=UNDISTURBED[10]) for r in (11, 12)]
    records += [rec(r, val_loss=UNDISTURBED[r - 2]) for r in range(13, 20)]
    equal = token_rounds(records, 4, 19)
    row = _row(records, 10, 14)
    score(row, equal, UNDISTURBED, 0.02)
    assert row["token_round"] == 12.0 and row["undisturbed_val_loss"] == UNDISTURBED[12]
    assert row["loss_cost"] == pytest.approx(0.0, abs=1e-12) and row["loss_ok"]
    assert row["val_loss"] / UNDISTURBED[14] - 1 > 0.04  # what the comparison at equal rounds said


def test_a_fault_that_set_the_swarm_back_costs_what_it_lost():
    # the swarm kept training all four peers' tokens, but its loss went back by 4 rounds' worth
    records = [rec(r) for r in range(1, 11)] + [rec(r, val_loss=UNDISTURBED[r - 4]) for r in range(11, 20)]
    row = _row(records, 10, 12)
    score(row, token_rounds(records, 4, 19), UNDISTURBED, 0.02)
    assert row["loss_cost"] > 0.02 and not row["loss_ok"]


def test_a_swarm_ahead_of_the_undisturbed_run_is_charged_only_past_even():
    # 3 % ahead before the fault, 1 % ahead after it: nothing lost against the undisturbed run
    ahead = [rec(r, val_loss=UNDISTURBED[r] * 0.97) for r in range(1, 11)]
    records = ahead + [rec(r, val_loss=UNDISTURBED[r] * 0.99) for r in range(11, 20)]
    row = _row(records, 10, 12)
    score(row, token_rounds(records, 4, 19), UNDISTURBED, 0.02)
    assert row["loss_cost"] == pytest.approx(-0.01) and row["loss_ok"]
    # 3 % ahead before, 3 % behind after: charged the 3 % past even, not the 6 % swing
    records = ahead + [rec(r, val_loss=UNDISTURBED[r] * 1.03) for r in range(11, 20)]
    row = _row(records, 10, 12)
    score(row, token_rounds(records, 4, 19), UNDISTURBED, 0.02)
    assert row["loss_cost"] == pytest.approx(0.03) and not row["loss_ok"]


def test_a_lower_loss_than_the_undisturbed_runs_passes():
    records = [rec(r) for r in range(1, 11)] + [rec(r, val_loss=UNDISTURBED[r + 3]) for r in range(11, 20)]
    row = _row(records, 10, 12)
    score(row, token_rounds(records, 4, 19), UNDISTURBED, 0.02)
    assert row["loss_cost"] < -0.02 and row["loss_ok"]
