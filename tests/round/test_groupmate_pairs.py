"""tests/support/swarm_harness.py's check that groupmates end a round with one θ, on round records."""

import pytest

from tests.support.swarm_harness import assert_groups_identical, groupmate_pairs, groupmate_splits


def rec(round_no, group, params_hash, excluded=None):
    return dict(round=round_no, group=sorted(group), params_hash=params_hash, excluded=excluded or {}, contributors=len(group))


def status(peer, *records):
    return dict(peer_id=peer, history=list(records))


def test_groupmates_apart_are_caught():
    statuses = [status("a", rec(1, "ab", "x"), rec(2, "ab", "z")), status("b", rec(1, "ab", "y"), rec(2, "ab", "z"))]
    with pytest.raises(AssertionError, match="round 1: a has x, groupmate b has y"):
        assert_groups_identical(statuses)


def test_groupmates_apart_are_shown_with_what_their_logs_say_of_those_rounds(tmp_path, monkeypatch):
    from tests.support import swarm_harness

    log = tmp_path / "b.log"
    log.write_text("10:00 INFO voloco.peer: peer b joined the DHT\n"
                   "10:01 ERROR voloco.peer: round 0: this peer started from parameters y, its group's start vote chose x\n"
                   "10:02 WARNING voloco.peer: refused the state a served: state of round 0 is older than the swarm's round 1\n"
                   "10:03 WARNING voloco.peer: round 7: something of another round\n")
    monkeypatch.setattr(swarm_harness, "_LOGS", [log])
    statuses = [status("a", rec(1, "ab", "x"), rec(2, "ab", "z")), status("b", rec(1, "ab", "y"), rec(2, "ab", "z"))]
    with pytest.raises(AssertionError, match="start vote chose x(.|\n)*older than the swarm's round 1") as e:
        assert_groups_identical(statuses)
    assert "round 7" not in str(e.value)


def test_a_last_record_that_differs_is_not_judged_yet():
    # a's round 2 is its last record: round 3's group may still take a set into round 2's union and
    # rewrite it (b already has: it wrote its next status first)
    statuses = [status("a", rec(1, "ab", "x"), rec(2, "ab", "old")), status("b", rec(1, "ab", "x"), rec(2, "ab", "new"), rec(3, "b", "z"))]
    assert assert_groups_identical(statuses) == 2  # round 1 both ways; round 2 not judged
    alike = [status("a", rec(1, "ab", "x")), status("b", rec(1, "ab", "x"))]
    assert assert_groups_identical(alike) == 2  # a last record that agrees counts


def test_groupmates_alike_pass_and_an_excluded_member_is_not_compared():
    statuses = [status("a", rec(1, "abc", "x", {"c": "sent nothing"})), status("b", rec(1, "abc", "x", {"c": "sent nothing"})),
                status("c", rec(2, "c", "z"))]
    assert assert_groups_identical(statuses) == 2  # a-b and b-a; c sent nothing (it died) and recorded no round 1


def test_a_record_of_another_group_of_the_round_is_not_a_groupmates():
    # b was killed in round 5's gather after a and c had its payload, restarted, and gathered round 5
    # again with d: its record of round 5 is of that second group
    statuses = [status("a", rec(5, "abc", "x")), status("c", rec(5, "abc", "x")),
                status("b", rec(5, "bd", "w")), status("d", rec(5, "bd", "w"))]
    assert assert_groups_identical(statuses) == groupmate_pairs(statuses) == 4


def test_a_peer_that_took_another_groups_set_is_compared_with_its_members():
    # c found round 7 gathered without it and took a and b's set: its record names their group, not itself
    statuses = [status("a", rec(7, "ab", "x"), rec(8, "ab", "z")), status("b", rec(7, "ab", "x"), rec(8, "ab", "z")),
                status("c", rec(7, "ab", "y"), rec(8, "c", "y"))]
    with pytest.raises(AssertionError, match="round 7: c has y, groupmate a has x"):
        assert_groups_identical(statuses)


def test_a_split_back_on_one_theta_within_three_rounds_counts_as_repaired_and_a_longer_one_does_not():
    # round 5: b was cut off mid-gather and decided alone; round 6's start-hash check brought it back
    repaired = [status("a", rec(5, "ab", "x"), rec(6, "ab", "y")), status("b", rec(5, "ab", "w"), rec(6, "ab", "y"))]
    checked, ok, bad = groupmate_splits(repaired)
    assert checked == 4 and len(ok) == 2 and not bad and "round 5: a has x, groupmate b has w" in ok[0]
    lasting = [status("a", *[rec(r, "ab", f"a{r}") for r in range(5, 10)]),
               status("b", *[rec(r, "ab", f"b{r}") for r in range(5, 10)])]
    checked, ok, bad = groupmate_splits(lasting)
    assert checked == 10 and len(bad) == 8  # rounds 5-8, both ways: apart in every later round recorded
    assert len(ok) == 2 and "not seen again" in ok[0]  # round 9: the last one recorded
