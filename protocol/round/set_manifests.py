"""A set's list of its payloads: what a peer reads to choose a round's contributions before it fetches one.

With ``outer.max_contributions`` = K, at most K contributions of each part enter θ in a round
(protocol/round/choice.py). The draw needs only each sender's name and the part its payload
carries, so a peer need not download every payload of the round's other groups to make it: it
reads each set's **manifest**, the set's binding and one entry per owner (the digest of its
payload, the part that payload's header claims), draws, and then fetches only the chosen payloads,
one envelope each (docs/scale.md).

Nothing in a manifest is trusted beyond what it proves. Any peer can name a set, so a list is
checked as a whole set is, without the payloads:

- every entry carries its owner's public key and claim signature, which signs the payload's digest
  for the set's binding (protocol/wire/signed.py ``claim_message``; it verifies without the payload),
  so a list can name only payloads their owners sealed for that group (``open_manifest``): nobody
  can put a second payload in an honest owner's name, or an owner in a group it was not in;
- the set's name commits to every entry, part included (``group_sets.set_digest``): a list that does
  not hash to the name it was asked for is refused;
- an envelope fetched for an entry must be its owner's, signed for the set's binding, with the
  entry's digest (``open_member``);
- the part an entry names is only what the list's author says the payload claims: the owner's
  signature does not cover it. Where two lists of the union disagree on one payload's part, the
  payload is fetched and read (``conflicts``; peer/round/draw.py bounds how many); a drawn payload
  whose header claims another part than its entry is refused for the round (``part_mismatch``), the
  same on every member that holds that union.

Pure: no sockets, no clocks (tests/protocol/test_set_manifests.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Hashable, Iterable, Mapping, Optional, Set, Tuple

import msgpack

from protocol.round.group_sets import SetError, empty_set_name, entries_digest, part_wire, union, unpack_bound
from protocol.wire.payload import Part, claimed_part
from protocol.wire.signed import (DIGEST_BYTES, MAX_ID_BYTES, MAX_PUBLIC_KEY_BYTES, MAX_SIGNATURE_BYTES, Binding, PublicKey,
                                  SignatureError, claim_message, open_envelope, payload_digest)

__all__ = ["Entry", "SetManifest", "PART_MISMATCH", "conflicts", "entries_of", "manifest_union", "max_manifest_bytes",
           "open_manifest", "open_member", "pack_manifest", "part_mismatch"]

_TAG = "voloco/manifest/1"
PART_MISMATCH = "its payload claims another part than its set's list named"


@dataclass(frozen=True)
class Entry:
    """One payload of a set: its digest and the part its header claims (None: no readable part); in a
    list from the wire, its owner's public key and claim signature too."""

    digest: bytes
    part: Optional[Part]
    key: bytes = b""
    signature: bytes = b""


@dataclass(frozen=True)
class SetManifest:
    """A set's binding and its entries, checked against the set's name: owner (peer id bytes) -> entry."""

    binding: Binding
    entries: Dict[bytes, Entry]
    digest: str


def entries_of(payloads: Mapping[Hashable, bytes]) -> Dict[Hashable, Entry]:
    """The entries of a set of ``payloads`` (owner, by id or by name -> payload)."""
    return {owner: Entry(payload_digest(p), claimed_part(p)) for owner, p in payloads.items()}


def max_manifest_bytes(max_members: int) -> int:
    """The most a packed manifest of a group of ``max_members`` may weigh."""
    return max_members * (2 * MAX_ID_BYTES + DIGEST_BYTES + MAX_PUBLIC_KEY_BYTES + MAX_SIGNATURE_BYTES + 64) + 4096


def pack_manifest(binding: Binding, envelopes: Mapping[bytes, bytes]) -> bytes:
    """What a member serves for a set it holds whole (``envelopes``: owner -> its envelope, checked
    when the set was agreed or fetched): the binding and one signed entry per owner."""
    items = []
    for owner in sorted(envelopes):
        _, key, signature, payload = msgpack.unpackb(envelopes[owner], raw=False)
        items.append([owner, payload_digest(payload), part_wire(claimed_part(payload)), key, signature])
    return msgpack.packb([_TAG, binding.run, binding.round, binding.group_id, list(binding.members), items],
                         use_bin_type=True)


def _part(raw) -> Optional[Part]:
    if raw is None or type(raw) is int:
        return raw
    if type(raw) is list and len(raw) == 2 and all(type(p) is int for p in raw):
        return (raw[0], raw[1])
    raise SetError("a manifest entry's part is an int, a [start, end] pair or nil")


def open_manifest(raw: bytes, run: bytes, round_no: int, digest: str, max_members: int) -> SetManifest:
    """Check a served manifest: of this run and round, 2 to ``max_members`` distinct members, at most
    one entry per member, each signed by its owner for the set's binding, and named ``digest``.
    Raises SetError otherwise."""
    if not isinstance(raw, (bytes, bytearray)) or len(raw) > max_manifest_bytes(max_members):
        raise SetError("a manifest must be bytes within its size limit")
    binding, items = unpack_bound(raw, _TAG, "manifest", "entries", run, round_no, max_members)
    if len(items) > len(binding.members):  # none: a group whose members all sat the round out (eligibility.py)
        raise SetError("a manifest holds at most one entry per member")
    entries: Dict[bytes, Entry] = {}
    context = binding.context
    for item in items:
        if not (isinstance(item, list) and len(item) == 5 and isinstance(item[0], bytes)
                and isinstance(item[1], bytes) and len(item[1]) == DIGEST_BYTES
                and isinstance(item[3], bytes) and isinstance(item[4], bytes)):
            raise SetError("a manifest entry is [owner, payload digest, part, public key, signature]")
        owner, payload_of, part, key, signature = item
        if owner not in binding.members or owner in entries:
            raise SetError("a manifest entry must be a member's, one per member")
        try:
            signed = PublicKey(owner, key).verify(claim_message(context, owner, payload_of), signature)
        except SignatureError as e:
            raise SetError(f"a manifest entry's key is refused: {e}") from None
        if not signed:
            raise SetError("a manifest entry is not signed by its owner for this group")
        entries[owner] = Entry(payload_of, _part(part), key, signature)
    named = entries_digest(context, {o: (e.digest, e.part) for o, e in entries.items()}) if entries else \
        empty_set_name(binding.run, binding.round)
    if named != digest:
        raise SetError("the manifest is not the one its name was asked for")
    return SetManifest(binding, entries, digest)


def open_member(manifest: SetManifest, owner: bytes, envelope: bytes, max_payload_bytes: int) -> bytes:
    """The payload of ``owner``'s entry in ``manifest`` from its served ``envelope``: signed by the
    owner for the set's binding, with the entry's digest. Raises SetError otherwise."""
    entry = manifest.entries.get(owner)
    if entry is None:
        raise SetError("the set has no entry of that owner")
    try:
        _, _, payload = open_envelope(envelope, manifest.binding.context, owner, max_payload_bytes)
    except SignatureError as e:
        raise SetError(f"the envelope does not verify: {e}") from None
    if payload_digest(payload) != entry.digest:
        raise SetError("the envelope holds another payload than the set's entry")
    return payload


def part_mismatch(entry: Entry, payload: bytes) -> bool:
    """Whether ``payload`` (of ``entry``'s digest) claims another part than ``entry`` names."""
    return claimed_part(payload) != entry.part


def manifest_union(sets: Iterable[Mapping[Hashable, Entry]]) -> Tuple[Dict[Hashable, Entry], Dict[Hashable, str]]:
    """Every sender's entry across ``sets``, as ``group_sets.union`` takes payloads: the same payload
    in two sets counts once; a sender with two different payloads counts with neither. Where two
    sets name one payload with different parts, the first one's entry stands here, and ``conflicts``
    names the sender: (sender -> entry, sender -> why excluded)."""
    return union(sets, key=lambda entry: entry.digest)


def conflicts(sets: Iterable[Mapping[Hashable, Entry]]) -> Set[Hashable]:
    """The senders whose one payload two of ``sets`` list with different parts: one of those sets
    was named by a member that misstated it, and the payload itself says which (fetch and read it)."""
    parts: Dict[Tuple[Hashable, bytes], Set[object]] = {}
    for entries in sets:
        for sender, entry in entries.items():
            parts.setdefault((sender, entry.digest), set()).add(part_wire_key(entry.part))
    return {sender for (sender, _), seen in parts.items() if len(seen) > 1}


def part_wire_key(part: Optional[Part]) -> object:
    """A hashable, comparable form of a part (None, an int, or a pair)."""
    return ("none",) if part is None else (("slice", part) if isinstance(part, int) else ("stage",) + tuple(part))
