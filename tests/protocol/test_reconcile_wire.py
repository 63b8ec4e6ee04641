"""The group's agreement on the wire (protocol/round/reconcile.py): malformed requests, answers,
envelopes and matchmaking announcements raise ``GroupError`` (fuzzed), and what members announce
decides who sends and which part each payload may claim. The agreement among lying members is
tests/protocol/test_reconcile.py's."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.round.reconcile import (
    MAX_LAST_SETS, MISANNOUNCED, Agreement, GroupError, announcement, members_of_round, parse_announcement, parse_answer,
    parse_request,
)
from protocol.wire.signed import SignatureError
from tests.protocol.test_reconcile import group
from tests.support.agreement_sim import MAX_PAYLOAD, Member, agreed, run_group

FUZZ = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- wire: requests and answers -----------------------------------------------------------------
@pytest.mark.parametrize("raw", [
    b"", b"\xc1", msgpack.packb(7), msgpack.packb([2]), msgpack.packb([1, []]), msgpack.packb([99, []]),
    msgpack.packb(["2", []]), msgpack.packb([2, [[b"a"]]], use_bin_type=True), msgpack.packb([2, [[b"a", 1]]], use_bin_type=True),
    msgpack.packb([2, [[b"a", b"d"]] * 7], use_bin_type=True), msgpack.packb([2, []]) + b"\0",
], ids=["empty", "reserved", "int", "short", "round-1", "round-99", "str-round", "short-pair", "int-digest",
        "too-many", "trailing"])
def test_malformed_request_raises_group_error(raw):
    with pytest.raises(GroupError):
        parse_request(raw, 3)


@pytest.mark.parametrize("raw", [
    b"", msgpack.packb({"k": 1}), msgpack.packb([[], [[b"o", b"d", b"s"]]], use_bin_type=True),
    msgpack.packb([[], [[b"o", b"d", 1, []]]], use_bin_type=True),
    msgpack.packb([[], [[b"o", b"d", b"s", []]] * 7], use_bin_type=True),
    msgpack.packb([[[b"k", b"v"]] * 4, []], use_bin_type=True),
    msgpack.packb([[], [[b"o", b"d", b"s", [[b"r", b"s"]] * 3]]], use_bin_type=True),
    b"\x92\x90" + b"\xdb" + (1 << 24).to_bytes(4, "big"),
], ids=["empty", "map", "short-item", "int-sig", "too-many-items", "too-many-keys", "long-chain", "huge-str"])
def test_malformed_answer_raises_group_error(raw):
    with pytest.raises(GroupError):
        parse_answer(raw, 3)


@FUZZ
@given(st.binary(max_size=400))
def test_any_bytes_give_offers_or_a_group_error(raw):
    keys, binding = group(3)
    me = Agreement(binding, keys[0], MAX_PAYLOAD)
    try:
        assert me.offers(raw, 2) == []  # random bytes never carry a valid signature
    except GroupError:
        pass


@FUZZ
@given(st.binary(max_size=400))
def test_any_bytes_as_an_envelope_are_refused(raw):
    keys, binding = group(2)
    with pytest.raises((SignatureError, GroupError)):
        Agreement(binding, keys[0], MAX_PAYLOAD).take_envelope(keys[1].peer_id, raw)


# ---- matchmaking announcements ------------------------------------------------------------------
def test_announcement_round_trip_cuts_the_hash_to_64_characters():
    assert parse_announcement(announcement(5, "ab" * 40)) == (5, "ab" * 32, "", (), None, "")
    assert parse_announcement((5, "h")) == (5, "h", "", (), None, "")  # the short form: no last round
    got = parse_announcement(announcement(5, "h", "b" * 70, ["s2", "s1", "s1"]))
    assert got.base == "b" * 64 and got.last_sets == ("s1", "s2")
    assert len(announcement(5, "h", "b", [f"{i:04d}" for i in range(200)])[3]) == MAX_LAST_SETS


def test_members_outside_the_senders_send_nothing_and_what_they_push_is_ignored_not_excluded():
    """protocol/round/eligibility.py decides the senders; a member outside them that seals and pushes
    its payload anyway (member 1) is neither kept nor excluded, at every honest member alike."""
    keys, binding = group(4)
    senders = {keys[0].peer_id, keys[2].peer_id}
    members = [Member(k, binding, b"payload of %d" % i, senders) for i, k in enumerate(keys)]
    pushy = Member(keys[1], binding, b"pushed anyway")  # its own view: everyone sends
    members[1] = pushy
    honest = [members[0], members[2], members[3]]
    outcome = agreed(run_group(members, honest))
    assert set(outcome.payloads) == senders and outcome.excluded == {}
    with pytest.raises(GroupError):
        members[3].agreement.seal(b"not a sender")
    with pytest.raises(GroupError):
        members[0].agreement.take_envelope(keys[1].peer_id, pushy.envelope)


def test_a_payload_that_claims_another_part_than_its_owner_announced_is_excluded_at_every_member():
    from tests.protocol.test_set_manifests import payload_of

    keys, binding = group(3)
    parts = {keys[0].peer_id: -1, keys[1].peer_id: (0, 2), keys[2].peer_id: -1}
    payloads = [payload_of(-1), payload_of(-1, salt=1), payload_of(-1, salt=2)]  # member 1 announced a stage
    members = [Member(k, binding, payloads[i]) for i, k in enumerate(keys)]
    for m in members:
        m.agreement.parts = parts
    outcome = agreed(run_group(members, members))
    assert set(outcome.payloads) == {keys[0].peer_id, keys[2].peer_id}
    assert outcome.excluded == {keys[1].peer_id: MISANNOUNCED}


def test_an_announced_part_round_trips_and_a_malformed_one_is_refused():
    assert parse_announcement(announcement(5, "h", "b", ["s"], part=-1)).part == -1
    assert parse_announcement(announcement(5, "h", "b", ["s"], part=(0, 2))).part == (0, 2)
    assert parse_announcement(announcement(5, "h")).part is None
    for bad in ([5, "h", "b", [], "x"], [5, "h", "b", [], [1]], [5, "h", "b", [], True], [5, "h", "b", [], [1, 2, 3]]):
        with pytest.raises(GroupError):
            parse_announcement(bad)


def test_an_announced_lineage_round_trips_with_or_without_a_part_and_a_malformed_one_is_refused():
    """The lineage a member's view names for the start vote (protocol/round/start_vote.py) follows the
    part, nil where it announces none; cut to 64 characters like every hash."""
    assert parse_announcement(announcement(5, "h", "b", ["s"], lineage="a" * 16)).lineage == "a" * 16
    assert announcement(5, "h", "b", ["s"], lineage="a" * 16)[4] is None
    got = parse_announcement(announcement(5, "h", "b", ["s"], part=(0, 2), lineage="c" * 70))
    assert got.part == (0, 2) and got.lineage == "c" * 64
    assert parse_announcement(announcement(5, "h", "b", ["s"], part=-1)).lineage == ""
    for bad in ([5, "h", "b", [], None, 7], [5, "h", "b", [], -1, b"aa"], [5, "h", "b", [], "x", "a" * 16]):
        with pytest.raises(GroupError):
            parse_announcement(bad)


@pytest.mark.parametrize("value", [None, [], [1], [1, "h", 2], ["1", "h"], [1, b"h"], {"round": 1}, 1.5,
                                   [1, "h", "b"], [1, "h", 2, []], [1, "h", "b", "s"], [1, "h", "b", [1]],
                                   [1, "h", "b", [""]], [1, "h", "b", ["s"] * (MAX_LAST_SETS + 1)],
                                   [1, "h", "b", [], None, "a" * 16, "extra"]])
def test_malformed_announcement_raises_group_error(value):
    with pytest.raises(GroupError):
        parse_announcement(value)


def test_members_announcing_another_round_or_garbage_are_left_out_and_the_rest_kept():
    assert members_of_round([[3, "x"], [3, "y", "b", ["s"]]], 3) == ({0: (3, "x", "", (), None, ""), 1: (3, "y", "b", ("s",), None, "")}, {})
    assert members_of_round([], 3) == ({}, {})
    kept, dropped = members_of_round([[3, "x"], [3 + (1 << 20), "y"], None, [3, "z"], "junk"], 3)
    assert kept == {0: (3, "x", "", (), None, ""), 3: (3, "z", "", (), None, "")}
    assert set(dropped) == {1, 2, 4} and "announced round" in dropped[1]


@settings(max_examples=200)
@given(st.lists(st.one_of(st.none(), st.integers(), st.text(max_size=4), st.lists(st.one_of(st.integers(0, 4), st.text(max_size=3)), max_size=3)), max_size=8))
def test_any_announcements_split_into_kept_and_dropped(values):
    kept, dropped = members_of_round(values, 2)
    assert set(kept) | set(dropped) == set(range(len(values))) and not set(kept) & set(dropped)
    assert all(a[0] == 2 for a in kept.values())
