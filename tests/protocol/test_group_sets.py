"""Several groups of one round merge their agreed sets (protocol/round/group_sets.py): a served set is
checked envelope by envelope against its owners' signatures and its name, whatever the bytes, and
the union counts every payload once and an equivocator's never."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.round.group_sets import (DIGEST_CHARS, MAX_NAMES, TWO_PAYLOADS, SetError, late_union, open_set, pack_names, pack_set,
                                 repaired_key, start_keys,
                                 parse_names, set_digest, set_name, union, vouched)
from protocol.wire.signed import seal
from tests.support.agreement_sim import MAX_PAYLOAD, RUN, binding_of, signer

ROUND = 7


def agreed_set(first: int, n: int, group_id: bytes = b"group-1", payloads=None):
    """(binding, owner -> envelope, owner -> payload) of an honest group of keys first..first+n-1."""
    keys = [signer(i) for i in range(first, first + n)]
    binding = binding_of([k.peer_id for k in keys], round_no=ROUND, group_id=group_id)
    payloads = payloads or {k.peer_id: b"payload of %d" % (first + i) for i, k in enumerate(keys)}
    envelopes = {k.peer_id: seal(k, binding.context, payloads[k.peer_id])[0] for k in keys if k.peer_id in payloads}
    return binding, envelopes, payloads


def opened(binding, envelopes, payloads, **kw):
    raw = pack_set(binding, envelopes)
    return open_set(raw, kw.pop("run", RUN), kw.pop("round_no", ROUND), kw.pop("digest", set_name(binding, payloads)),
                    kw.pop("max_members", 16), MAX_PAYLOAD)


def test_a_served_set_opens_to_its_payloads_under_its_name():
    binding, envelopes, payloads = agreed_set(0, 4)
    checked = opened(binding, envelopes, payloads)
    assert checked.payloads == payloads and len(checked.digest) == DIGEST_CHARS
    assert checked.binding == binding


def test_the_name_binds_the_group_and_every_payload():
    binding, _, payloads = agreed_set(0, 3)
    other_group = binding_of(list(binding.members), round_no=ROUND, group_id=b"group-2")
    changed = {**payloads, binding.members[0]: b"another payload"}
    names = {set_digest(binding.context, payloads), set_digest(other_group.context, payloads),
             set_digest(binding.context, changed), set_digest(binding.context, dict(list(payloads.items())[:2]))}
    assert len(names) == 4


def test_a_set_that_leaves_a_payload_out_is_not_the_named_set():
    binding, envelopes, payloads = agreed_set(0, 4)
    left_out = dict(list(envelopes.items())[:3])
    with pytest.raises(SetError, match="not the one"):
        opened(binding, left_out, payloads)


def test_a_forged_or_misbound_envelope_is_refused():
    binding, envelopes, payloads = agreed_set(0, 3)
    owner = binding.members[1]
    other = binding_of(list(binding.members), round_no=ROUND, group_id=b"elsewhere")
    forged = {**envelopes, owner: seal(signer(9), binding.context, payloads[owner])[0]}  # signed by a non-owner
    misbound = {**envelopes, owner: seal(signer(1), other.context, payloads[owner])[0]}  # sealed for another group
    for bad in (forged, misbound):
        with pytest.raises(SetError):
            opened(binding, bad, payloads)


def test_a_set_of_another_run_or_round_or_too_large_a_group_is_refused():
    binding, envelopes, payloads = agreed_set(0, 5)
    with pytest.raises(SetError, match="another run or round"):
        opened(binding, envelopes, payloads, round_no=ROUND + 1)
    with pytest.raises(SetError, match="another run or round"):
        opened(binding, envelopes, payloads, run=b"other run")
    with pytest.raises(SetError):
        opened(binding, envelopes, payloads, max_members=4)


def test_an_envelope_of_a_non_member_or_twice_is_refused():
    binding, envelopes, payloads = agreed_set(0, 3)
    raw = msgpack.unpackb(pack_set(binding, envelopes), raw=False)
    outsider = signer(11)
    twice = raw[:5] + [raw[5] + [raw[5][0]]]
    stranger = raw[:5] + [raw[5][:2] + [[outsider.peer_id, seal(outsider, binding.context, b"x")[0]]]]
    for bad in (twice, stranger):
        with pytest.raises(SetError):
            open_set(msgpack.packb(bad, use_bin_type=True), RUN, ROUND, set_digest(binding.context, payloads), 16, MAX_PAYLOAD)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=4096))
def test_any_bytes_give_a_set_error_or_a_checked_set(raw):
    try:
        open_set(raw, RUN, ROUND, "0" * DIGEST_CHARS, 16, MAX_PAYLOAD)
    except SetError:
        pass


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutating_a_valid_set_never_passes_as_it(data):
    binding, envelopes, payloads = agreed_set(0, 3)
    raw = bytearray(pack_set(binding, envelopes))
    i = data.draw(st.integers(0, len(raw) - 1))
    raw[i] ^= data.draw(st.integers(1, 255))
    try:
        checked = open_set(bytes(raw), RUN, ROUND, set_digest(binding.context, payloads), 16, MAX_PAYLOAD)
    except SetError:
        return
    assert checked.payloads == payloads  # a flip in bytes nothing depends on (never in a signed field)


def test_union_counts_every_payload_once_and_an_equivocator_never():
    a = {"p1": b"one", "p2": b"two"}
    b = {"p3": b"three", "p2": b"two"}  # p2 sealed the same payload in two groups: counts once
    c = {"p4": b"four", "p1": b"ONE"}  # p1 sealed two different payloads: counts with neither
    merged, excluded = union([a, b, c])
    assert merged == {"p2": b"two", "p3": b"three", "p4": b"four"}
    assert excluded == {"p1": TWO_PAYLOADS}
    assert union([c, b, a]) == (merged, excluded)  # the same whatever order the sets came in


# ---- a member's list of the sets it merged (what groupmates tell each other) ----------------------
def test_a_list_of_set_names_round_trips_sorted_and_once():
    a, b = "0" * DIGEST_CHARS, "ab" * (DIGEST_CHARS // 2)
    assert parse_names(pack_names([b, a, b])) == (a, b)
    assert parse_names(pack_names([])) == ()


@pytest.mark.parametrize("raw", [b"0" * (DIGEST_CHARS - 1), b"G" * DIGEST_CHARS, b"0" * DIGEST_CHARS * 2,
                                 b"\xff" * DIGEST_CHARS, b"0" * DIGEST_CHARS * (MAX_NAMES + 1)])
def test_a_malformed_repeated_or_overlong_list_is_refused(raw):
    with pytest.raises(SetError):
        parse_names(raw)


def test_what_is_not_a_set_name_is_never_packed():
    with pytest.raises(SetError):
        pack_names(["not a set name"])


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=3 * DIGEST_CHARS))
def test_any_bytes_give_a_set_error_or_names_that_pack_back(raw):
    try:
        names = parse_names(raw)
    except SetError:
        return
    assert pack_names(names) == raw


# ---- the union of the last round, as the next round's group takes it --------------------------
B = "b" * 16  # a base: θ before the last round's outer step


@pytest.mark.parametrize("last, counted, union", [
    ({"a": (B, ("s1",)), "b": (B, ("s1",))}, "ab", {"s1"}),  # one group, one set: nothing new
    ({"a": (B, ("s1",)), "b": (B, ("s1", "s2")), "c": (B, ("s1", "s2"))}, "abc", {"s1", "s2"}),
    ({"a": (B, ("s1",)), "b": (B, ("s2",)), "c": (B, ("s1",))}, "abc", {"s1", "s2"}),  # one lister is enough
    ({"a": (B, ("s1",)), "b": (B, ("s1",)), "c": (B, ("s1", "s2"))}, "ab", {"s1"}),  # c's payload not counted
    ({"a": ("", ()), "b": ("c" * 16, ("s3",)), "c": (B, ("s3",))}, "abc", {"s3"}),  # any base lists
    ({}, "ab", set()),
])
def test_the_late_union_is_every_set_a_counted_member_announces(last, counted, union):
    assert late_union(last, counted) == union


def test_start_keys_count_members_that_will_hold_one_theta_as_one():
    s_short, s_full, other = "1" * 16, "2" * 16, "3" * 16
    last = {"a": (B, ("s1",)), "b": (B, ("s1", "s2")), "c": (B, ("s1", "s2")), "d": ("", ()), "e": ("e" * 16, ("s1",))}
    starts = {"a": s_short, "b": s_full, "c": s_full, "d": other, "e": other}
    u = late_union(last, starts)
    assert u == {"s1", "s2"}
    keys = start_keys(starts, last, u)
    # a's union grows to b's and c's: its start counts as theirs; d (no base) and e (another base) vote as announced
    assert keys == {"a": s_full, "b": s_full, "c": s_full, "d": other, "e": repaired_key("e" * 16, {"s1", "s2"})}
    # nobody held the grown union yet: members of one base get one key, from the base and the sets alone
    last2 = {"a": (B, ("s1", "s2")), "b": (B, ("s1", "s3")), "c": (B, ("s2", "s3"))}
    keys2 = start_keys({m: s_short for m in last2}, last2, late_union(last2, "abc"))
    assert set(keys2.values()) == {repaired_key(B, {"s1", "s2", "s3"})}


@settings(max_examples=200)
@given(st.dictionaries(st.sampled_from("abcdef"), st.tuples(st.sampled_from(["", B, "c" * 16]),
                                                              st.lists(st.sampled_from(["s1", "s2", "s3"]), max_size=3)),
                       max_size=6),
       st.data())
def test_start_keys_are_the_same_whatever_the_order_members_are_listed_in(last, data):
    last = {m: (b, tuple(sorted(set(n)))) for m, (b, n) in last.items()}
    starts = {m: data.draw(st.sampled_from(["1" * 16, "2" * 16])) for m in last}
    u = late_union(last, list(starts))
    shuffled = dict(data.draw(st.permutations(list(last.items()))))
    assert start_keys(starts, last, u) == start_keys({m: starts[m] for m in shuffled}, shuffled, u)
    # a member whose sets hold the union, or that has no base, votes with its announced start
    for m, key in start_keys(starts, last, u).items():
        if not last[m][0] or u <= set(last[m][1]):
            assert key == starts[m]


def test_a_binding_is_vouched_for_by_an_owner_we_know_or_in_our_first_round_by_most_members():
    members = ["a", "b", "s1", "s2"]
    assert vouched(members, ["a"], known={"me", "a"})  # an owner we know signed it
    assert not vouched(members, ["s1", "s2", "x"], known={"me", "a"})  # only strangers signed it
    # we know nobody (our first round): most of the members must own an envelope in it
    assert vouched(members, ["a", "b", "s1"], known={"me"})
    assert not vouched(members, ["a", "b"], known={"me"}) and not vouched(members, ["a", "b"], known=set())
