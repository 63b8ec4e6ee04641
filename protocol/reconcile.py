"""Which payloads a group agrees on after an all-gather: every decision, none of the I/O.

The exchange (peer/exchange.py) moves bytes: it pulls each member's payload, then each member's
digest table (the sha256 of every payload that member holds for the group). This module decides
from what arrived:

1. ``reconcile(members, mine, tables)``: an owner with two different digests among my table and
   the others' is excluded ("sent different payloads to different members"); an owner I lack
   whose digest every table agrees on is to be re-fetched, from the members whose table lists it
   with that digest, in group order; a member that no table mentions "sent nothing in time".
2. ``finalize(plan, fetched)``: a re-fetched payload is kept if its digest is the agreed one,
   otherwise its owner is excluded ("payload lost: no live member could serve it").

Owners and members are peer ids as bytes; digests are ``payload_digest`` (sha256, 32 bytes).

These are today's rules, kept as they were when the decision lived inside the exchange, and they
trust the tables: a table claiming another digest for someone's payload gets that owner excluded
(even this member itself), and a table may name owners outside the group, which are then planned
for re-fetch from the member that named them. tests/test_reconcile.py pins each of these.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import msgpack

from protocol.errors import ProtocolError

DIGEST_BYTES = 32
MAX_ID_BYTES = 1024  # a table's keys (peer ids) and values (digests) are bin entries no longer than this
MAX_HASH_CHARS = 64  # an announced start hash is cut to this length

EQUIVOCATED = "sent different payloads to different members"
LOST = "payload lost: no live member could serve it"
SILENT = "sent nothing in time"

Owner = bytes  # the peer id, as bytes, of the member a payload comes from
Member = bytes  # the peer id, as bytes, of a group member
Digest = bytes
DigestTable = Dict[Owner, Digest]


class GroupError(ProtocolError):
    """A groupmate's digest table or matchmaking announcement that does not follow the protocol."""


def payload_digest(payload: bytes) -> Digest:
    """How members name a payload to each other: its sha256."""
    return hashlib.sha256(payload).digest()


def digest_table(payloads: Mapping[Owner, bytes]) -> DigestTable:
    """The table of the payloads one member holds: owner -> digest."""
    return {owner: payload_digest(p) for owner, p in payloads.items()}


def encode_digest_table(table: Mapping[Owner, Digest]) -> bytes:
    return msgpack.packb(dict(table), use_bin_type=True)


def parse_digest_table(raw: bytes, max_entries: int) -> DigestTable:
    """A groupmate's table: a msgpack map of at most ``max_entries`` bytes -> 32-byte digest."""
    try:
        table = msgpack.unpackb(raw, raw=True, max_map_len=max_entries, max_bin_len=MAX_ID_BYTES)
    except Exception as e:  # msgpack raises several types for truncated, oversized or extra data
        raise GroupError(f"malformed digest table: {e}") from e
    if not isinstance(table, dict):
        raise GroupError(f"malformed digest table: a {type(table).__name__}, not a map")
    if len(table) > max_entries:
        raise GroupError(f"malformed digest table: {len(table)} entries, at most {max_entries}")
    for owner, digest in table.items():
        if not (isinstance(owner, bytes) and isinstance(digest, bytes)):
            raise GroupError("malformed digest table: an entry is not bytes -> bytes")
        if len(digest) != DIGEST_BYTES:
            raise GroupError(f"malformed digest table: a digest of {len(digest)} bytes, not {DIGEST_BYTES}")
    return table


@dataclass(frozen=True)
class Refetch:
    """A payload this member lacks and the group agrees on: where to fetch it, what it must hash to."""

    digest: Digest
    holders: Tuple[Member, ...]  # members whose table lists it with ``digest``, in group order: try each in turn

    def accepts(self, payload: bytes) -> bool:
        return payload_digest(payload) == self.digest


@dataclass(frozen=True)
class Plan:
    """What ``reconcile`` decided before any re-fetch."""

    keep: Dict[Owner, Digest]  # payloads this member holds and no table disputes
    excluded: Dict[Owner, str]  # decided already: equivocating owners, silent members
    refetch: Dict[Owner, Refetch]  # payloads this member lacks, in the order to fetch them
    order: Tuple[Owner, ...]  # every owner decided on, in decision order (the exclusions' order)


@dataclass(frozen=True)
class Outcome:
    """The round's agreed set after re-fetches."""

    keep: Dict[Owner, Digest]  # the payloads every surviving member aggregates: held + re-fetched
    excluded: Dict[Owner, str]  # owner -> why its payload is not used


def reconcile(
    members: Sequence[Member], mine: Mapping[Owner, Digest], tables: Mapping[Member, Optional[Mapping[Owner, Digest]]]
) -> Plan:
    """Decide from my table and the other members' which payloads to keep, exclude and re-fetch.

    ``members``: the whole group, in group order. ``mine``: the digest of each payload I hold
    (mine included). ``tables``: each other member's table, None where it failed or was malformed.
    """
    views: List[Mapping[Owner, Digest]] = [mine] + [t for t in tables.values() if t is not None]
    claimed: Dict[Owner, set] = {}
    for view in views:
        for owner, digest in view.items():
            claimed.setdefault(owner, set()).add(digest)
    keep: Dict[Owner, Digest] = {}
    excluded: Dict[Owner, str] = {}
    refetch: Dict[Owner, Refetch] = {}
    for owner, digests in claimed.items():
        if len(digests) > 1:
            excluded[owner] = EQUIVOCATED
        elif owner in mine:
            keep[owner] = mine[owner]
        else:
            (digest,) = digests
            holders = tuple(m for m in members if tables.get(m) is not None and tables[m].get(owner) == digest)
            refetch[owner] = Refetch(digest, holders)
    silent = [m for m in members if m not in claimed]
    for member in silent:
        excluded[member] = SILENT
    keep = {owner: d for owner, d in mine.items() if owner in keep}  # in the order I hold them
    return Plan(keep=keep, excluded=excluded, refetch=refetch, order=tuple(claimed) + tuple(silent))


def finalize(plan: Plan, fetched: Mapping[Owner, bytes]) -> Outcome:
    """Keep each re-fetched payload whose digest is the agreed one; the other planned ones are lost."""
    keep = dict(plan.keep)
    lost: Dict[Owner, str] = {}
    for owner, want in plan.refetch.items():
        payload = fetched.get(owner)
        if payload is not None and want.accepts(payload):
            keep[owner] = want.digest
        else:
            lost[owner] = LOST
    reasons = {**plan.excluded, **lost}
    return Outcome(keep=keep, excluded={owner: reasons[owner] for owner in plan.order if owner in reasons})


# ---- matchmaking ------------------------------------------------------------------------------
def announcement(round_no: int, start_hash: str) -> List[Any]:
    """What each member announces in matchmaking: [round, hash of its starting parameters]."""
    return [round_no, start_hash]


def parse_announcement(value: Any) -> Tuple[int, str]:
    """A groupmate's announcement as (round, start hash cut to 64 characters)."""
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[0], int) and isinstance(value[1], str)):
        raise GroupError(f"malformed matchmaking announcement {value!r:.80}")
    return value[0], value[1][:MAX_HASH_CHARS]


def parse_announcements(values: Sequence[Any], round_no: int) -> List[Tuple[int, str]]:
    """Every member's announcement; a group whose members are in different rounds is refused.

    The matchmaking key holds the round modulo 2**20, so only a wrap-around can mix rounds.
    """
    announced = [parse_announcement(v) for v in values]
    if any(a[0] != round_no for a in announced):
        raise GroupError(f"group mixes rounds {sorted(set(str(a[0]) for a in announced))}")
    return announced
