"""protocol/round/eligibility.py: who sends a payload at all when a round takes at most K a part."""

from __future__ import annotations

import pytest

from protocol.round import choice, eligibility
from protocol.round.eligibility import MARGIN, ONE, EligibilityError


def _names(n):
    return [f"peer{i:04d}" for i in range(n)]


def test_the_rate_follows_p_and_a_fresh_identity_passes_about_a_quarter_as_often():
    names = _names(4000)
    p = ONE // 4
    established = sum(eligibility.eligible("seed:3", s, 5, p) for s in names)
    fresh = sum(eligibility.eligible("seed:3", s, 0, p) for s in names)
    assert 900 < established < 1100  # p = 1/4 of 4,000
    assert 180 < fresh < 360  # 1 - (3/4)^(1/4) = 6.9 % of 4,000 = 277
    assert all(eligibility.eligible("seed:3", s, 0, ONE) for s in names[:50])


def test_those_that_pass_are_the_largest_keys_so_the_draw_over_them_is_the_draw_over_everyone():
    names = _names(300)
    standing = {s: i % 5 for i, s in enumerate(names)}
    parts = {s: -1 for s in names}
    for seed in ("a:1", "b:2", "c:3"):
        passed = eligibility.contributors(parts, seed, standing, {"-1": ONE // 10})
        k = 8
        assert len(passed) >= k
        everyone = choice.choose(parts, k, seed, standing)
        assert choice.choose({s: -1 for s in passed}, k, seed, standing) == everyone
        assert set(everyone) <= passed


def test_a_member_without_a_part_sends_nothing_and_each_part_has_its_own_p():
    parts = {"a": -1, "b": (0, 2), "c": None}
    table = {"-1": 1}  # the full part: almost nobody
    got = eligibility.contributors(parts, "s:1", {}, table)
    assert "c" not in got and "b" in got  # the stage's part is absent from the table: p = 1
    assert eligibility.part_key((0, 2)) == "0:2" and eligibility.part_key(3) == "3"


def test_p_follows_the_swarm_size_towards_margin_times_k_contributions():
    k, table = 8, {}
    for n in (1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000):
        e = max(1, eligibility.probability(table, -1) * n // ONE)
        table = eligibility.update(table, {"-1": e}, k)
    assert abs(eligibility.probability(table, -1) * 1000 / ONE - MARGIN * k) < 2
    # a part with nobody in the union climbs back to p = 1 and leaves the table
    for _ in range(25):
        table = eligibility.update(table, {}, k)
    assert table == {}
    # few senders: p stays 1
    assert eligibility.update({}, {"-1": MARGIN * k}, k) == {}
    assert eligibility.update({"-1": 5}, {"-1": 3}, 0) == {}


def test_the_table_is_bounded_and_a_table_from_another_peer_is_checked():
    table = eligibility.update({}, {str(i): 10_000 for i in range(200)}, 8)
    assert len(table) == eligibility.MAX_PARTS
    assert eligibility.checked(None) == {}
    assert eligibility.checked({"-1": 5, "0:2": ONE - 1}) == {"-1": 5, "0:2": ONE - 1}
    for bad in ([1], {"-1": 0}, {"-1": ONE}, {"-1": True}, {"": 3}, {"x" * 33: 3}, {3: 3},
                {str(i): 5 for i in range(eligibility.MAX_PARTS + 1)}):
        with pytest.raises(EligibilityError):
            eligibility.checked(bad)
