"""protocol/round/eligibility.py: who sends a payload at all when a round takes at most K a part."""

from __future__ import annotations

import pytest

from protocol.round import choice, eligibility
from protocol.round.eligibility import MARGIN, ONE, EligibilityError


def _names(n):
    return [f"peer{i:04d}" for i in range(n)]


def test_a_member_sends_with_its_parts_probability_whatever_its_standing():
    names = _names(4000)
    sent = sum(eligibility.eligible("seed:3", s, ONE // 4) for s in names)
    assert 900 < sent < 1100  # p = 1/4 of 4,000
    assert all(eligibility.eligible("seed:3", s, ONE) for s in names[:50])
    assert eligibility.contributors({s: -1 for s in names[:50]}, "seed:3", {}) == set(names[:50])


def test_the_draw_over_the_senders_still_weighs_standing():
    """Sending is independent of the draw key: the draw over the senders is a weighted draw from a
    uniform sample, so established senders are drawn about as much more often as over everyone."""
    names = _names(400)
    standing = {s: (3 if i % 2 else 0) for i, s in enumerate(names)}
    established = fresh = 0
    for r in range(40):
        seed = f"theta:{r}"
        sent = eligibility.contributors({s: -1 for s in names}, seed, {"-1": ONE // 8})
        for s in choice.choose({s: -1 for s in sent}, 8, seed, standing):
            established, fresh = established + (standing[s] > 0), fresh + (standing[s] == 0)
    assert established > 2.5 * fresh


def test_a_member_without_a_part_sends_nothing_and_each_part_has_its_own_p():
    names = _names(200)
    parts = {**{s: -1 for s in names[:100]}, **{s: (0, 2) for s in names[100:199]}, names[199]: None}
    got = eligibility.contributors(parts, "s:1", {"-1": ONE // 10})  # the stage's part is absent: p = 1
    assert names[199] not in got and set(names[100:199]) <= got and len(got & set(names[:100])) < 25
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
