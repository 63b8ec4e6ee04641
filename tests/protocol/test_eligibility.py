"""protocol/round/eligibility.py: who sends a payload at all when a round takes at most K a part."""

from __future__ import annotations

import pytest

from protocol.round import choice, eligibility
from protocol.round.eligibility import CAP, ONE, TOP, EligibilityError


def _names(n):
    return [f"peer{i:04d}" for i in range(n)]


def test_a_member_sends_with_its_parts_probability_weighed_by_its_standing():
    names = _names(4000)
    sent = sum(eligibility.eligible("seed:3", s, ONE // 4, TOP) for s in names)  # an established member
    assert 900 < sent < 1100  # p = 1/4 of 4,000
    fresh = sum(eligibility.eligible("seed:3", s, ONE // 4, w=1) for s in names)
    assert 200 < fresh < 300  # a quarter of that
    assert all(eligibility.eligible("seed:3", s, ONE, TOP) for s in names[:50])
    assert all(eligibility.eligible("seed:3", s, CAP, w=1) for s in names[:50])  # CAP: fresh ones too
    assert eligibility.contributors({s: -1 for s in names[:50]}, "seed:3", {}, {}) == set(names[:50])
    # the same table: fresh members send at a quarter of the rate of established ones
    standing = {s: 3 for s in names[:2000]}
    got = eligibility.contributors({s: -1 for s in names}, "seed:4", {"-1": ONE // 2}, standing)
    old, new = len(got & set(names[:2000])), len(got - set(names[:2000]))
    assert 900 < old < 1100 and 200 < new < 300 and TOP == 4


def test_the_draw_over_the_senders_still_weighs_standing():
    """Sending is independent of the draw key: the draw over the senders is a weighted draw from a
    sample already weighed by standing, so established senders are drawn far more often."""
    names = _names(400)
    standing = {s: (3 if i % 2 else 0) for i, s in enumerate(names)}
    established = fresh = 0
    for r in range(40):
        seed = f"theta:{r}"
        sent = eligibility.contributors({s: -1 for s in names}, seed, {"-1": ONE // 8}, standing)
        for s in choice.choose({s: -1 for s in sent}, 8, seed, standing):
            established, fresh = established + (standing[s] > 0), fresh + (standing[s] == 0)
    assert established > 2.5 * fresh


def test_a_member_without_a_part_sends_nothing_and_each_part_has_its_own_p():
    names = _names(200)
    parts = {**{s: -1 for s in names[:100]}, **{s: (0, 2) for s in names[100:199]}, names[199]: None}
    standing = {s: 3 for s in names}  # established: they send at p
    got = eligibility.contributors(parts, "s:1", {"-1": ONE // 10}, standing)  # the stage's part is absent: CAP
    assert names[199] not in got and set(names[100:199]) <= got and 3 < len(got & set(names[:100])) < 20
    assert eligibility.part_key((0, 2)) == "0:2" and eligibility.part_key(3) == "3"


def test_p_follows_the_swarm_size_towards_the_target():
    k, table = 8, {}
    assert eligibility.target(8) == 10 and eligibility.target(32) == 40 and eligibility.target(1) == 3
    for _ in range(12):  # 1,000 established members: each sends at p / ONE (at most 1)
        e = max(1, min(eligibility.probability(table, -1), ONE) * 1000 // ONE)
        table = eligibility.update(table, {"-1": e}, k)
    assert abs(eligibility.probability(table, -1) * 1000 / ONE - eligibility.target(k)) < 2
    # a part with nobody in the union climbs back to CAP and leaves the table
    for _ in range(25):
        table = eligibility.update(table, {}, k)
    assert table == {}
    # few senders: p stays at CAP (everyone sends)
    assert eligibility.update({}, {"-1": int(eligibility.target(k))}, k) == {}
    # a swarm of 40 fresh members (each sends at p / TOP): p settles where about MARGIN x K send
    table = {}
    for _ in range(12):
        e = max(1, eligibility.probability(table, -1) * 40 // CAP)
        table = eligibility.update(table, {"-1": e}, k)
    assert abs(eligibility.probability(table, -1) * 40 / CAP - eligibility.target(k)) < 2
    assert eligibility.update({"-1": 5}, {"-1": 3}, 0) == {}


def test_from_cap_p_moves_the_whole_way_at_once():
    """At CAP every member sent, so E is the part's size, not a draw: one round takes p to the target;
    below CAP p moves halfway (E is then a draw, and a whole step would follow its noise)."""
    k = 8
    table = eligibility.update({}, {"-1": 32}, k)  # a run's first round: 32 fresh members all sent
    assert eligibility.probability(table, -1) * 32 // CAP == eligibility.target(k)
    p = eligibility.probability(table, -1)
    assert eligibility.update(table, {"-1": 20}, k)["-1"] == p * (10 + 20) // 40  # halfway from below CAP
    # fresh members of a swarm of 32 send about target(K) from the second round on (the real decisions)
    names = [f"peer-{i}" for i in range(32)]
    sent = [sum(eligibility.eligible(f"seed-{r}", n, p, 1) for n in names) for r in range(200)]
    assert abs(sum(sent) / len(sent) - eligibility.target(k)) < 1
    assert eligibility.update({}, {"-1": 10}, k) == {}  # as many as the target: everyone goes on sending
    # established members back at CAP send 4x as often below it: the step lands above the target,
    # and the halfway steps bring it down
    table = eligibility.update({}, {"-1": 400}, k)
    sends = lambda t: sum(eligibility.eligible(f"seed-{r}", f"m{i}", eligibility.probability(t, -1), 4)  # noqa: E731
                          for i in range(400) for r in range(3)) / 3
    first = sends(table)
    assert 3 * eligibility.target(k) < first < 5 * eligibility.target(k)
    for _ in range(15):
        table = eligibility.update(table, {"-1": max(1, round(sends(table)))}, k)
    assert abs(sends(table) - eligibility.target(k)) < 4
    # a flood of made-up senders at CAP lowers p at most MAX_FALL times in one step
    assert eligibility.update({}, {"-1": 10**6}, k)["-1"] == CAP // eligibility.MAX_FALL


def test_the_table_is_bounded_and_a_table_from_another_peer_is_checked():
    table = eligibility.update({}, {str(i): 10_000 for i in range(200)}, 8)
    assert len(table) == eligibility.MAX_PARTS
    assert eligibility.checked(None) == {}
    assert eligibility.checked({"-1": 5, "0:2": CAP - 1}) == {"-1": 5, "0:2": CAP - 1}
    for bad in ([1], {"-1": 0}, {"-1": CAP}, {"-1": True}, {"": 3}, {"x" * 33: 3}, {3: 3},
                {str(i): 5 for i in range(eligibility.MAX_PARTS + 1)}):
        with pytest.raises(EligibilityError):
            eligibility.checked(bad)


def test_a_record_may_send_as_its_part_or_its_chain_stages_blocks_would():
    """The barrier's test (``may_send``) from a progress record's part and ``sends``: the same decision
    as the gather's, a chain stage's by its blocks, a peer with no part yet as one that may."""
    names = _names(400)
    table, standing = {"-1": ONE // 10, "2": ONE // 10, "0:4": ONE // 40}, {s: 3 for s in names}
    def sending(as_part):
        return eligibility.contributors({s: as_part for s in names}, "seed:9", table, standing)

    for part, sends, as_part in ((-1, "", -1), (2, "", 2)):
        got = {s for s in names if eligibility.may_send("seed:9", table, standing, s, part, sends)}
        assert got == sending(as_part) and 10 < len(got) < 80
    # a stage's record: its blocks, or the full part it shows (a record is a claim: a full replica that
    # names a stage's blocks to look like a non-sender is still waited for where it may send as one)
    got = {s for s in names if eligibility.may_send("seed:9", table, standing, s, -1, "0:4")}
    assert got == sending((0, 4)) | sending(-1) and sending(-1) - sending((0, 4)) and sending((0, 4))
    assert all(eligibility.may_send("seed:9", table, standing, s, -1, "4:8") for s in names)  # no p of its own: CAP
    assert all(eligibility.may_send("seed:9", table, standing, s, -2, "") for s in names)  # still choosing
