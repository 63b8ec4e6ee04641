"""Reconciliation of a group's all-gather (protocol/reconcile.py): which payloads the members agree
on, who is excluded and why, what is re-fetched from whom; digest-table and announcement parsing.

The rules pinned here are today's: the tables are trusted. Tests named ``..._today`` document a
behaviour that a table-lying member can exploit, so that hardening it changes these on purpose.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.errors import ProtocolError
from protocol.reconcile import (
    EQUIVOCATED,
    LOST,
    SILENT,
    GroupError,
    Refetch,
    announcement,
    digest_table,
    encode_digest_table,
    finalize,
    parse_announcement,
    parse_announcements,
    parse_digest_table,
    payload_digest,
    reconcile,
)

A, B, C, D = b"peer-a", b"peer-b", b"peer-c", b"peer-d"  # A is "me" throughout
GROUP = [A, B, C, D]
P = {m: b"payload of " + m for m in GROUP}
ALL = digest_table(P)
FUZZ = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def gather(members, held: Mapping[bytes, bytes], tables, serves: Optional[Dict[bytes, Dict[bytes, bytes]]] = None):
    """The exchange's loop without the network: reconcile, re-fetch from each holder in turn, finalize.

    ``serves``: holder -> owner -> the bytes that holder answers with (absent: the fetch fails).
    Returns the plan, the holders asked, and the outcome.
    """
    serves = serves or {}
    plan = reconcile(members, digest_table(held), tables)
    asked, fetched = [], {}
    for owner, want in plan.refetch.items():
        for holder in want.holders:
            asked.append((owner, holder))
            got = serves.get(holder, {}).get(owner)
            if got is not None and want.accepts(got):
                fetched[owner] = got
                break
    return plan, asked, finalize(plan, fetched)


# ---- reconcile / finalize ----------------------------------------------------------------------
def test_honest_group_keeps_every_payload_and_fetches_nothing():
    plan, asked, out = gather(GROUP, P, {m: ALL for m in GROUP[1:]})
    assert plan.refetch == {} and asked == []
    assert out.keep == ALL and out.excluded == {}


def test_empty_group_decides_nothing():
    plan, asked, out = gather([], {}, {})
    assert plan.keep == plan.excluded == plan.refetch == {} and plan.order == ()
    assert out.keep == {} and out.excluded == {}


def test_group_of_one_keeps_its_own_payload():
    _, _, out = gather([A], {A: P[A]}, {})
    assert out.keep == {A: ALL[A]} and out.excluded == {}


def test_sender_that_died_mid_send_is_refetched_from_the_first_holder_that_serves_it():
    # D died while sending: B and D's own table are gone, C got D's payload, A (me) did not
    held = {k: P[k] for k in (A, B, C)}
    tables = {B: {k: ALL[k] for k in (A, B, C)}, C: ALL, D: None}
    plan, asked, out = gather(GROUP, held, tables, serves={C: {D: P[D]}})
    assert plan.refetch == {D: Refetch(ALL[D], (C,))}
    assert asked == [(D, C)]
    assert out.keep == ALL and out.excluded == {}


def test_refetch_tries_holders_in_group_order_and_rejects_bytes_of_the_wrong_digest():
    held = {k: P[k] for k in (A, B)}
    tables = {B: {k: ALL[k] for k in (A, B)}, C: ALL, D: ALL}
    _, asked, out = gather(GROUP, held, tables, serves={C: {D: b"forged", C: P[C]}, D: {D: P[D]}})
    assert asked == [(C, C), (D, C), (D, D)]
    assert out.keep == ALL and out.excluded == {}


def test_payload_no_holder_can_serve_is_lost():
    held = {k: P[k] for k in (A, B, C)}
    tables = {B: {k: ALL[k] for k in (A, B, C)}, C: ALL, D: None}
    _, asked, out = gather(GROUP, held, tables, serves={C: {D: b"not it"}})
    assert asked == [(D, C)]
    assert out.excluded == {D: LOST} and D not in out.keep


def test_fetched_bytes_are_checked_again_by_finalize():
    plan = reconcile([A, B], {A: ALL[A]}, {B: {A: ALL[A], B: ALL[B]}})
    assert finalize(plan, {B: b"forged"}).excluded == {B: LOST}
    assert finalize(plan, {B: P[B]}).keep == {A: ALL[A], B: ALL[B]}


def test_member_no_table_mentions_sent_nothing_in_time():
    held = {k: P[k] for k in (A, B, C)}
    tables = {B: {k: ALL[k] for k in (A, B, C)}, C: {k: ALL[k] for k in (A, B, C)}, D: None}
    plan, asked, out = gather(GROUP, held, tables)
    assert asked == [] and plan.excluded == {D: SILENT}
    assert out.excluded == {D: SILENT} and set(out.keep) == {A, B, C}


def test_failed_or_malformed_tables_only_count_as_no_claims():
    held = {k: P[k] for k in GROUP}
    _, _, out = gather(GROUP, held, {B: None, C: None, D: None})
    assert out.keep == ALL and out.excluded == {}


def test_equivocating_sender_is_excluded_and_its_payload_dropped():
    # D sent one payload to A and C, another to B
    held = dict(P)
    b_table = {**ALL, D: payload_digest(b"other bytes")}
    plan, asked, out = gather(GROUP, held, {B: b_table, C: ALL, D: ALL})
    assert asked == [] and plan.excluded == {D: EQUIVOCATED}
    assert D not in out.keep and out.excluded == {D: EQUIVOCATED}


def test_equivocation_between_two_other_members_excludes_a_sender_i_never_received():
    held = {k: P[k] for k in (A, B, C)}
    tables = {B: {**ALL, D: payload_digest(b"one")}, C: {**ALL, D: payload_digest(b"two")}, D: None}
    plan, asked, out = gather(GROUP, held, tables)
    assert asked == [] and plan.refetch == {}
    assert out.excluded == {D: EQUIVOCATED}


def test_table_lying_about_another_members_payload_excludes_that_honest_member_today():
    # B claims a different digest for C's payload: C is excluded as if C had equivocated
    _, _, out = gather(GROUP, P, {B: {**ALL, C: payload_digest(b"lie")}, C: ALL, D: ALL})
    assert out.excluded == {C: EQUIVOCATED}
    assert set(out.keep) == {A, B, D}


def test_table_lying_about_my_own_payload_excludes_me_today():
    _, _, out = gather(GROUP, P, {B: {**ALL, A: payload_digest(b"lie")}, C: ALL, D: ALL})
    assert out.excluded == {A: EQUIVOCATED}
    assert set(out.keep) == {B, C, D}


def test_table_inventing_an_owner_outside_the_group_gets_it_refetched_from_the_inventor_today():
    ghost = b"not-a-member"
    ghost_digest = payload_digest(b"ghost payload")
    tables = {B: {**ALL, ghost: ghost_digest}, C: ALL, D: ALL}
    plan, asked, out = gather(GROUP, P, tables)
    assert plan.refetch == {ghost: Refetch(ghost_digest, (B,))} and asked == [(ghost, B)]
    assert out.excluded == {ghost: LOST}  # the inventor could not serve it: excluded under the invented id
    assert out.keep == ALL


def test_table_inventing_an_owner_is_kept_when_the_inventor_serves_matching_bytes_today():
    ghost = b"not-a-member"
    tables = {B: {**ALL, ghost: payload_digest(b"ghost payload")}, C: ALL, D: ALL}
    _, _, out = gather(GROUP, P, tables, serves={B: {ghost: b"ghost payload"}})
    assert out.keep == {**ALL, ghost: payload_digest(b"ghost payload")}
    assert out.excluded == {}


def test_two_tables_inventing_the_same_owner_differently_exclude_it_as_equivocating_today():
    ghost = b"not-a-member"
    tables = {B: {**ALL, ghost: payload_digest(b"x")}, C: {**ALL, ghost: payload_digest(b"y")}, D: ALL}
    plan, asked, out = gather(GROUP, P, tables)
    assert asked == [] and out.excluded == {ghost: EQUIVOCATED} and out.keep == ALL


def test_exclusions_are_listed_in_decision_order_then_silent_members():
    E = b"peer-e"
    members = GROUP + [E]
    held = {k: P[k] for k in (A, B, D)}
    tables = {B: {**{k: ALL[k] for k in (A, B, D)}, C: ALL[C]}, C: None, D: {**{k: ALL[k] for k in (A, B)}, D: b"\0" * 32}, E: None}
    _, _, out = gather(members, held, tables)
    assert list(out.excluded.items()) == [(D, EQUIVOCATED), (C, LOST), (E, SILENT)]
    assert list(out.keep) == [A, B]


# ---- digest tables -----------------------------------------------------------------------------
def test_digest_table_round_trip():
    assert parse_digest_table(encode_digest_table(ALL), 16) == ALL
    assert parse_digest_table(encode_digest_table({}), 16) == {}


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xc1",  # a byte msgpack never uses
        msgpack.packb([b"a", b"b"]),  # not a map
        msgpack.packb(7),
        msgpack.packb({b"a": 1}, use_bin_type=True),  # value not bytes
        msgpack.packb({b"a": None}, use_bin_type=True),
        msgpack.packb({b"a": {b"b": b"c"}}, use_bin_type=True),
        msgpack.packb({b"a": b"\0" * 31}, use_bin_type=True),  # digest too short
        msgpack.packb({b"a": b"\0" * 33}, use_bin_type=True),  # too long
        msgpack.packb({1: b"\0" * 32}, use_bin_type=True, strict_types=False),  # key not bytes
        msgpack.packb({b"x" * 2000: b"\0" * 32}, use_bin_type=True),  # key longer than any peer id
        msgpack.packb({b"a": b"\0" * 32}, use_bin_type=True)[:-3],  # truncated
        msgpack.packb({b"a": b"\0" * 32}, use_bin_type=True) + b"\x00",  # trailing data
    ],
    ids=["empty", "reserved-byte", "list", "int", "int-value", "nil-value", "map-value", "short-digest",
         "long-digest", "int-key", "long-key", "truncated", "trailing"],
)
def test_malformed_digest_table_raises_group_error(raw):
    with pytest.raises(GroupError):
        parse_digest_table(raw, 16)


def test_digest_table_with_too_many_entries_raises():
    table = {bytes([i]): b"\0" * 32 for i in range(17)}
    assert len(parse_digest_table(encode_digest_table(table), 17)) == 17
    with pytest.raises(GroupError):
        parse_digest_table(encode_digest_table(table), 16)


def test_str_typed_entries_are_read_as_bytes_today():
    raw = msgpack.packb({"a": "0" * 32}, use_bin_type=True)
    assert parse_digest_table(raw, 16) == {b"a": b"0" * 32}


def test_group_error_is_a_protocol_error():
    assert issubclass(GroupError, ProtocolError) and issubclass(GroupError, ValueError)


@FUZZ
@given(st.binary(max_size=300))
def test_any_bytes_give_a_table_or_group_error(raw):
    try:
        table = parse_digest_table(raw, 16)
    except GroupError:
        return
    assert all(isinstance(k, bytes) and isinstance(v, bytes) and len(v) == 32 for k, v in table.items())


# ---- matchmaking announcements -----------------------------------------------------------------
def test_announcement_round_trip_cuts_the_hash_to_64_characters():
    assert parse_announcement(announcement(5, "ab" * 40)) == (5, "ab" * 32)
    assert parse_announcement((5, "h")) == (5, "h")


@pytest.mark.parametrize("value", [None, [], [1], [1, "h", 2], ["1", "h"], [1, b"h"], {"round": 1}, 1.5])
def test_malformed_announcement_raises_group_error(value):
    with pytest.raises(GroupError):
        parse_announcement(value)


def test_announcements_of_a_group_must_share_the_round():
    assert parse_announcements([[3, "x"], [3, "y"]], 3) == [(3, "x"), (3, "y")]
    assert parse_announcements([], 3) == []
    with pytest.raises(GroupError, match="mixes rounds"):
        parse_announcements([[3, "x"], [3 + (1 << 20), "y"]], 3)
