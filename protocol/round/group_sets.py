"""One round, several groups, one θ: the payload sets groups agreed, named, packed, checked and merged.

A swarm larger than ``swarm.max_group_size`` gathers in several groups in the same round. Each group
agrees on a set of signed payloads (protocol/round/reconcile.py); every member then computes the round's
θ from that set. Were that the end of it, every group would hold its own θ, and the swarm would be
as many models as it has groups. Instead, a member names its group's set (``set_digest``) in its
progress record, fetches the sets the other groups of its round named, checks every envelope in them
against the signatures of their owners (``open_set``) and computes θ from the union of all the sets
it holds (``union``), in the canonical order of the senders. Groups that hold the same sets compute
the same θ, bit for bit; what one group could not fetch in time costs that round a second θ, which
the next round's start-hash check repairs (peer/round/loop.py).

Nothing from another group is trusted: a set is a list of envelopes, each signed by its owner for
the binding (run, round, group, members) of the group it was sealed in, so a member serving a set
can leave payloads out but cannot forge or alter one. Leaving out is harmless to the union as long
as one honest member of that group serves the whole set. A sender with two different payloads in
the sets of one round (it sealed one in each of two groups) is excluded from the union, as an
equivocator is inside a group; the same payload sealed in two groups counts once.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Container, Dict, FrozenSet, Hashable, Iterable, Mapping, Optional, Sequence, Tuple

import msgpack

from protocol.wire.bounded_unpack import bounded_unpack
from protocol.errors import ProtocolError
from protocol.wire.payload import Part, claimed_part
from protocol.wire.signed import ENVELOPE_OVERHEAD, MAX_ID_BYTES, Binding, SignatureError, open_envelope, payload_digest

DIGEST_CHARS = 32  # a set's name in a progress record: 128 bits of sha256, hex
TWO_PAYLOADS = "equivocated: sealed two different payloads in two groups of this round"
_TAG = "voloco/set/2"  # 2: parts named too
_EMPTY_TAG = "voloco/empty-set/1"


class SetError(ProtocolError):
    """A served set that is not what it names, or not a set of this run and round at all."""


@dataclass(frozen=True)
class GroupSet:
    """A group's agreed payloads, checked: owner (peer id bytes) -> payload."""

    binding: Binding
    payloads: Dict[bytes, bytes]
    digest: str


def empty_set_name(run: bytes, round_no: int) -> str:
    """The name of every empty set of ``run``'s round ``round_no``: a group none of whose members sent a
    payload (in a round of at most K a part, most groups of a large swarm). It names no group, so a
    peer knows such a set holds nothing without fetching it: the lists a peer fetches in a round
    follow the groups that hold senders (about 5/4 K a part), not the swarm's size. Naming a set
    empty that is not is no more than leaving a set out: the set's other members name it as it is
    (tests/protocol/test_set_manifests.py, tests/round/test_draw.py)."""
    return hashlib.sha256(msgpack.packb([_EMPTY_TAG, bytes(run), int(round_no)], use_bin_type=True)).hexdigest()[:DIGEST_CHARS]


def set_name(binding: Binding, payloads: Mapping[bytes, bytes]) -> str:
    """What a group names the set ``payloads`` it agreed under ``binding``: ``set_digest``, or the
    round's ``empty_set_name`` if it holds no payload."""
    return set_digest(binding.context, payloads) if payloads else empty_set_name(binding.run, binding.round)


def set_digest(context: bytes, payloads: Mapping[bytes, bytes]) -> str:
    """The name of the set ``payloads`` (owner -> payload) agreed under the binding ``context``: it
    commits to each payload's digest and to the part its header claims, so that a set's list of its
    payloads (protocol/round/set_manifests.py) is checked by the name alone."""
    return entries_digest(context, {owner: (payload_digest(p), claimed_part(p)) for owner, p in payloads.items()})


def part_wire(part: Optional[Part]):
    """A part as a set's name and list write it: an int, a [start, end] pair, or nil."""
    return list(part) if isinstance(part, tuple) else part


def entries_digest(context: bytes, entries: Mapping[bytes, Tuple[bytes, Optional[Part]]]) -> str:
    """The name of a set from its entries (owner -> (payload digest, claimed part)): ``set_digest``."""
    items = sorted([owner, digest, part_wire(part)] for owner, (digest, part) in entries.items())
    return hashlib.sha256(msgpack.packb([_TAG, context, items], use_bin_type=True)).hexdigest()[:DIGEST_CHARS]


def max_set_bytes(max_members: int, max_payload_bytes: int) -> int:
    """The most a packed set of a group of ``max_members`` may weigh."""
    return max_members * (max_payload_bytes + ENVELOPE_OVERHEAD + MAX_ID_BYTES + 16) + 4 * MAX_ID_BYTES * max_members + 4096


def pack_set(binding: Binding, envelopes: Mapping[bytes, bytes]) -> bytes:
    """What a member serves: the binding and one envelope per owner whose payload the group agreed."""
    return msgpack.packb(
        [_TAG, binding.run, binding.round, binding.group_id, list(binding.members),
         [[owner, envelopes[owner]] for owner in sorted(envelopes)]],
        use_bin_type=True,
    )


def unpack_bound(raw: bytes, tag: str, what: str, items_are: str, run: bytes, round_no: int, max_members: int
                 ) -> Tuple[Binding, list]:
    """(binding, items) of ``raw``, [tag, run, round, group id, members, items] of this run and round
    with 2 to ``max_members`` distinct members: a served set or set list (set_manifests.py). Raises
    SetError otherwise."""
    fields = bounded_unpack(bytes(raw), SetError, f"group {what}", max_array_len=max(6, max_members), max_map_len=0)
    if not (isinstance(fields, list) and len(fields) == 6 and fields[0] == tag):
        raise SetError(f"a {what} is [tag, run, round, group id, members, {items_are}]")
    _, set_run, set_round, group_id, members, items = fields
    if set_run != run or set_round != round_no:
        raise SetError(f"the {what} belongs to another run or round")
    if not isinstance(group_id, bytes) or not 0 < len(group_id) <= 64:
        raise SetError(f"the {what}'s group id must be 1 to 64 bytes")
    if not (isinstance(members, list) and 2 <= len(members) <= max_members
            and all(isinstance(m, bytes) and 0 < len(m) <= MAX_ID_BYTES for m in members)
            and len(set(members)) == len(members)):
        raise SetError(f"a {what} names 2 to {max_members} distinct members")
    if not isinstance(items, list):
        raise SetError(f"a {what}'s {items_are} must be a list")
    return Binding(run, round_no, group_id, tuple(members)), items


def open_set(raw: bytes, run: bytes, round_no: int, digest: str, max_members: int, max_payload_bytes: int) -> GroupSet:
    """Check a served set: of this run and round, at most ``max_members`` members, every envelope
    signed by its owner for the set's binding, and named ``digest``. Raises SetError otherwise."""
    if not isinstance(raw, (bytes, bytearray)) or len(raw) > max_set_bytes(max_members, max_payload_bytes):
        raise SetError("a set must be bytes within its size limit")
    binding, items = unpack_bound(raw, _TAG, "set", "envelopes", run, round_no, max_members)
    if len(items) > len(binding.members):
        raise SetError("a set holds at most one envelope per member")
    context, payloads = binding.context, {}
    for item in items:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], bytes) and isinstance(item[1], bytes)):
            raise SetError("an entry of a set is [owner, envelope]")
        owner, envelope = item
        if owner not in binding.members or owner in payloads:
            raise SetError("an envelope of a set must be a member's, one per member")
        try:
            _, _, payloads[owner] = open_envelope(envelope, context, owner, max_payload_bytes)
        except SignatureError as e:
            raise SetError(f"an envelope of the set does not verify: {e}") from None
    named = set_name(binding, payloads)
    if named != digest:
        raise SetError("the set is not the one its name was asked for")
    return GroupSet(binding, payloads, named)


def union(sets: Iterable[Mapping[Hashable, Any]], key: Callable[[Any], Any] = lambda payload: payload
          ) -> Tuple[Dict[Hashable, Any], Dict[Hashable, str]]:
    """Every sender's payload across ``sets`` (the same payload in two sets counts once); a sender
    with two different payloads counts with neither: (sender -> payload, sender -> why excluded).
    ``key``: what makes two of its values the same payload (a set list's entry: its digest)."""
    merged: Dict[Hashable, Any] = {}
    excluded: Dict[Hashable, str] = {}
    for payloads in sets:
        for sender, payload in payloads.items():
            if sender in excluded:
                continue
            held = merged.get(sender)
            if held is None:
                merged[sender] = payload
            elif key(held) != key(payload):
                del merged[sender]
                excluded[sender] = TWO_PAYLOADS
    return merged, excluded


def vouched(members: Sequence[Hashable], owners: Iterable[Hashable], known: Container[Hashable]) -> bool:
    """Whether a checked set's binding may be taken for its group's members (a stranger listed there
    that named no set sent nothing in that group: no set of its own is coming). The binding is signed
    by the set's owners only: a set of new identities can list anyone, honest newcomers too, to keep
    them out of a merge's wait. So it counts where one of its ``owners`` is ``known`` (no stranger), or,
    while we know nobody else (``known`` is ourselves alone: our first round, when every peer is a
    stranger), where most ``members`` own an envelope in it (tests/protocol/test_group_sets.py)."""
    owners = list(owners)
    return any(o in known for o in owners) or (len(known) <= 1 and 2 * len(owners) > len(members))


MAX_NAMES = 256  # the most set names a member's list of what it merged may hold (groups in one round)
_HEX = frozenset("0123456789abcdef")


def pack_names(digests: Iterable[str]) -> bytes:
    """A member's list of the sets it merged for a round, as it answers a groupmate: the names, sorted, joined."""
    names = sorted(set(digests))
    if len(names) > MAX_NAMES or any(len(d) != DIGEST_CHARS or not set(d) <= _HEX for d in names):
        raise SetError("not a list of set names")
    return "".join(names).encode()


def parse_names(raw: bytes) -> Tuple[str, ...]:
    """A groupmate's answer (``pack_names``), checked: at most ``MAX_NAMES`` well-formed set names."""
    if len(raw) % DIGEST_CHARS or len(raw) > MAX_NAMES * DIGEST_CHARS:
        raise SetError(f"a list of set names of {len(raw)} bytes")
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise SetError("a list of set names that is not ascii") from None
    names = tuple(text[i : i + DIGEST_CHARS] for i in range(0, len(text), DIGEST_CHARS))
    if not set(text) <= _HEX or len(set(names)) != len(names):
        raise SetError("a list of set names with a malformed or repeated name")
    return names


# ---- the union of the last round, agreed by the next round's group ----------------------------
_UNION_TAG = "voloco/union/1"


def late_union(last: Mapping[str, Tuple[str, Sequence[str]]], counted: Iterable[str]) -> FrozenSet[str]:
    """The sets of the last round that a group takes into that round's union: every name that a
    member the group counted announced (``last``: member -> (base, names), from the matchmaking
    announcements every member holds alike; ``counted``: the members the gather did not exclude,
    the same on every member). Every member computes the same union
    (tests/protocol/test_group_sets.py)."""
    counted = set(counted)
    return frozenset(n for member, (_, names) in last.items() if member in counted for n in names)


def repaired_key(base: str, names: Iterable[str]) -> str:
    """The name, in the form of a start hash, of θ computed from the θ hashed ``base`` with the
    sets ``names``: what a member whose union grows votes as its start."""
    packed = msgpack.packb([_UNION_TAG, base, sorted(set(names))], use_bin_type=True)
    return hashlib.sha256(packed).hexdigest()[:16]


def start_keys(starts: Mapping[str, str], last: Mapping[str, Tuple[str, Sequence[str]]],
               union: FrozenSet[str]) -> Dict[str, str]:
    """What each member's start counts as in the group's start vote, once the group takes ``union``
    into the last round: its announced start where its sets already hold the union (or it has no
    base: a state installed, or a round without a group), else the key of θ from its base with its
    sets and the union (``repaired_key``); a key that names what another member already started
    from (the same base, exactly those sets) counts as that member's start. Every member computes
    the same keys, so the vote ends alike everywhere; a member whose union grew and who cannot
    fetch a set of it has not got its key's θ and takes the state of the vote's winner
    (peer/round/union.py)."""
    started: Dict[Tuple[str, FrozenSet[str]], str] = {}
    for member in sorted(starts):
        base, names = last.get(member, ("", ()))
        if base and union <= set(names):
            started.setdefault((base, frozenset(names)), starts[member])
    keys: Dict[str, str] = {}
    for member, start in starts.items():
        base, names = last.get(member, ("", ()))
        if not base or union <= set(names):
            keys[member] = start
        else:
            grown = frozenset(names) | union
            keys[member] = started.get((base, grown), repaired_key(base, grown))
    return keys
