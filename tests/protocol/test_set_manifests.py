"""A set's list of its payloads (protocol/round/set_manifests.py): checked by the set's name alone, an
envelope fetched for one entry checked against it, and the union of lists taken as the union of
sets takes payloads."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.round.group_sets import TWO_PAYLOADS, SetError, empty_set_name, entries_digest, set_digest, set_name
from protocol.round.set_manifests import (Entry, conflicts, entries_of, manifest_union, max_manifest_bytes, open_manifest,
                                          open_member, pack_manifest, part_mismatch)
from protocol.wire.payload import encode_payload
from protocol.wire.signed import payload_digest, seal
from tests.protocol.test_group_sets import ROUND, agreed_set, opened
from tests.support.agreement_sim import MAX_PAYLOAD, RUN, binding_of, signer


class _Codec:
    name = "dense"

    def encode(self, t):
        return [], t


def payload_of(part, salt: int = 0) -> bytes:
    """A payload whose header claims ``part`` (no tensors: the header is what a list records)."""
    return encode_payload(_Codec(), {}, run_digest=f"run-{salt}", round=ROUND, steps=1, part=part)[0]


def test_a_served_list_opens_under_its_sets_name_with_each_payloads_digest_and_part():
    payloads = {signer(i).peer_id: payload_of(p) for i, p in enumerate([-1, 2, (0, 3)])}
    binding, envelopes, payloads = agreed_set(0, 3, payloads=payloads)
    name = set_digest(binding.context, payloads)
    manifest = open_manifest(pack_manifest(binding, envelopes), RUN, ROUND, name, 16)
    assert manifest.binding == binding and manifest.digest == name
    assert {o: e.part for o, e in manifest.entries.items()} == dict(zip(binding.members, [-1, 2, (0, 3)]))
    assert all(manifest.entries[o].digest == payload_digest(p) for o, p in payloads.items())
    for owner, envelope in envelopes.items():  # one envelope, checked against its entry
        assert open_member(manifest, owner, envelope, MAX_PAYLOAD) == payloads[owner]


def test_a_group_whose_members_all_sat_the_round_out_has_an_empty_set_and_list():
    """protocol/round/eligibility.py can leave every member of a group without a payload to send: its
    set and list are named as the round's empty set, whatever the group (``empty_set_name``)."""
    binding, _, _ = agreed_set(0, 3)
    other, _, _ = agreed_set(1, 2)
    name = empty_set_name(RUN, ROUND)
    assert set_name(binding, {}) == set_name(other, {}) == name != empty_set_name(RUN, ROUND + 1)
    assert open_manifest(pack_manifest(binding, {}), RUN, ROUND, name, 16).entries == {}
    assert opened(binding, {}, {}).payloads == {}
    with pytest.raises(SetError):  # still the named one
        open_manifest(pack_manifest(binding, {}), RUN, ROUND, set_digest(binding.context, {b"x": b"y"}), 16)
    with pytest.raises(SetError, match="not the one"):  # the context-bound name of nothing is not it
        open_manifest(pack_manifest(binding, {}), RUN, ROUND, set_digest(binding.context, {}), 16)


def test_a_list_with_entries_is_not_the_empty_set():
    """Naming the round's empty set does not make a list with entries pass for it."""
    payloads = {signer(i).peer_id: payload_of(-1, i) for i in range(2)}
    binding, envelopes, payloads = agreed_set(0, 2, payloads=payloads)
    with pytest.raises(SetError, match="not the one"):
        open_manifest(pack_manifest(binding, envelopes), RUN, ROUND, empty_set_name(RUN, ROUND), 16)


def test_a_list_that_misstates_a_part_or_drops_an_entry_is_not_the_named_set():
    payloads = {signer(i).peer_id: payload_of(-1, i) for i in range(3)}
    binding, envelopes, payloads = agreed_set(0, 3, payloads=payloads)
    name = set_digest(binding.context, payloads)
    raw = msgpack.unpackb(pack_manifest(binding, envelopes), raw=False)
    misstated = [*raw[:5], [[o, d, 1, k, g] for o, d, _, k, g in raw[5]]]
    dropped = [*raw[:5], raw[5][:2]]
    for bad in (misstated, dropped):
        with pytest.raises(SetError, match="not the one"):
            open_manifest(msgpack.packb(bad, use_bin_type=True), RUN, ROUND, name, 16)
    with pytest.raises(SetError, match="another run or round"):
        open_manifest(pack_manifest(binding, envelopes), RUN, ROUND + 1, name, 16)
    with pytest.raises(SetError, match="size limit"):
        open_manifest(b"\x00" * (max_manifest_bytes(16) + 1), RUN, ROUND, name, 16)


def test_a_list_naming_a_payload_its_owner_did_not_sign_for_that_group_is_refused():
    # anyone can name a set: a list that puts another digest in an honest owner's name (which would
    # exclude it as an equivocator), or an owner's claim for another group, does not open
    binding, envelopes, payloads = agreed_set(0, 3)
    raw = msgpack.unpackb(pack_manifest(binding, envelopes), raw=False)
    forged = {o: (payload_digest(b"not its payload") if o == binding.members[0] else payload_digest(p), -1)
              for o, p in payloads.items()}
    items = [[o, forged[o][0], None, k, g] for o, _, _, k, g in raw[5]]
    other = binding_of(list(binding.members), round_no=ROUND, group_id=b"group-2")
    elsewhere = [[o, d, p, k, seal(signer(i), other.context, payloads[o])[1]] for i, (o, d, p, k, _) in enumerate(raw[5])]
    unkeyed = [[o, d, p, b"", g] for o, d, p, _, g in raw[5]]
    for bad, why in ((items, "not signed"), (elsewhere, "not signed"), (unkeyed, "key is refused")):
        name = entries_digest(binding.context, {o: (d, p) for o, d, p, _, _ in bad})
        with pytest.raises(SetError, match=why):
            open_manifest(msgpack.packb([*raw[:5], bad], use_bin_type=True), RUN, ROUND, name, 16)


def test_an_envelope_of_another_payload_or_binding_is_refused_for_an_entry():
    binding, envelopes, payloads = agreed_set(0, 3)
    manifest = open_manifest(pack_manifest(binding, envelopes), RUN, ROUND, set_digest(binding.context, payloads), 16)
    a, b = binding.members[:2]
    with pytest.raises(SetError, match="does not verify"):
        open_member(manifest, a, envelopes[b], MAX_PAYLOAD)  # b's envelope for a's entry
    other = binding_of(list(binding.members), round_no=ROUND, group_id=b"group-2")
    with pytest.raises(SetError, match="does not verify"):
        open_member(manifest, a, seal(signer(0), other.context, payloads[a])[0], MAX_PAYLOAD)
    with pytest.raises(SetError, match="another payload"):
        open_member(manifest, a, seal(signer(0), binding.context, b"another")[0], MAX_PAYLOAD)
    with pytest.raises(SetError, match="no entry"):
        open_member(manifest, signer(9).peer_id, envelopes[a], MAX_PAYLOAD)


def test_the_union_of_lists_counts_a_payload_once_an_equivocator_never_and_names_part_conflicts():
    one, two = Entry(b"1" * 32, -1), Entry(b"2" * 32, -1)
    misstated = Entry(b"1" * 32, 3)
    merged, excluded = manifest_union([{"a": one, "b": one}, {"a": one, "b": two, "c": misstated}])
    assert merged == {"a": one, "c": misstated} and excluded == {"b": TWO_PAYLOADS}
    assert conflicts([{"a": one}, {"a": misstated}, {"b": two}]) == {"a"}
    assert conflicts([{"a": one}, {"a": one}]) == set()
    assert part_mismatch(Entry(b"x" * 32, 3), payload_of(-1)) and not part_mismatch(Entry(b"x" * 32, -1), payload_of(-1))
    assert entries_of({b"o": b"not a payload"})[b"o"].part is None


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=600))
def test_any_bytes_open_to_a_manifest_or_raise_set_error(raw):
    try:
        open_manifest(raw, RUN, ROUND, "0" * 32, 16)
    except SetError:
        pass


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(st.none(), st.integers(-3, 8), st.tuples(st.integers(0, 8), st.integers(0, 8))), min_size=2,
                max_size=5))
def test_any_parts_round_trip_through_a_list(parts):
    payloads = {signer(i).peer_id: payload_of(p, i) for i, p in enumerate(parts)}
    binding, envelopes, payloads = agreed_set(0, len(parts), payloads=payloads)
    manifest = open_manifest(pack_manifest(binding, envelopes), RUN, ROUND, set_digest(binding.context, payloads), 16)
    assert [manifest.entries[o].part for o in binding.members] == [None if p is None else p for p in parts]
