"""Which payloads a group agrees on, when any member may lie: every decision, none of the I/O.

What counts as evidence (docs/trust.md, "Identities and signatures"): a signature tells who wrote
a payload (protocol/wire/signed.py binds it to run, round, group and owner); what a member *says* about
another member's payload is no evidence at all. So:

- a payload counts only in an envelope signed by its owner, a member of the group, for this
  binding; a forged signature, or a valid one for another run, round or group, does not count;
- an owner is excluded as an equivocator only on proof: two different payloads, both signed by it
  for this binding; nobody's word can exclude an honest owner, whose payload is the only one that
  can ever verify for it;
- names outside the group are ignored and never fetched, whatever a member lists.

What remains is a dishonest owner that shows its payload, or a second one, to only some honest
members, and late, so that they decide differently (θ splits). The rule that closes it is the
authenticated broadcast of Dolev and Strong (SIAM J. Comput. 12(4), 1983), run for every owner at
once over ``R`` rounds:

round 1      every member fetches each owner's envelope from the owner (``take_envelope``);
round k > 1  every member asks every other member for the values (owner, digest) it accepted and
             the asker lacks (``request``/``answer``). A value comes with a chain: the owner's
             claim signature and relay signatures of distinct other members. It is accepted in
             round k only if the chain holds at least k signatures and the payload's bytes arrive
             (``offers``, then ``accept``); a member relays what it accepted, adding its signature.
             At most two values per owner are kept: two are proof.
decision     an owner with exactly one accepted value is kept; none: "sent nothing in time"; two:
             "equivocated", with both signed claims as proof (``outcome``).

Why honest members decide alike, given ``R = t + 1`` rounds and at most ``t`` dishonest members:
a value an honest member accepts in a round k < R, it relays in round k + 1, so every honest member
accepts it by then; a value accepted in round R carries R = t + 1 signatures, so one signer is
honest and relayed it to everyone in an earlier round. ``R = n - 1`` (``agreement_rounds``)
covers any number of dishonest members (two honest members are needed to disagree at all), up to
``MAX_ROUNDS``. An honest owner's payload reaches every honest member in round 1, so it is always
kept. In an honest group every member holds everything after round 1: later rounds exchange the
small ``have`` lists and empty answers, and sign nothing.

What this does not guarantee (peer/exchange/gatherer.py bounds each):
- timeliness: rounds end at deadlines; an honest member whose messages miss another honest
  member's deadline (a partition, an overloaded host) counts as faulty to it, and the two may
  decide differently. Their parameter hashes then differ, which the next round's start-hash check
  repairs with a state download;
- one view of the group: the binding holds the member list, so a matchmaking leader that tells
  members different lists makes envelopes fail to verify across views (each view decides alone);
- time: a member that answers each round just before its deadline makes the round take R deadlines.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Collection, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

import msgpack

from protocol.wire.bounded_unpack import bounded_unpack
from protocol.errors import ProtocolError
from protocol.wire.payload import Part, claimed_part
from protocol.wire.signed import (
    DIGEST_BYTES, MAX_ID_BYTES, MAX_PUBLIC_KEY_BYTES, MAX_SIGNATURE_BYTES, Binding, PublicKey, SignatureError, Signer,
    claim_message, open_envelope, payload_digest, relay_message, seal,
)

MAX_ROUNDS = 16  # agreement rounds at most: groups of up to 17 members tolerate any number of liars
MAX_HASH_CHARS = 64  # an announced start hash is cut to this length

EQUIVOCATED = "equivocated: signed two different payloads for this round (proof held)"
SILENT = "sent nothing in time: no payload signed by it reached the group"
MISANNOUNCED = "its payload claims another part than it announced to the group"

Key = Tuple[bytes, bytes]  # (owner, digest)


class GroupError(ProtocolError):
    """A groupmate's message or matchmaking announcement that does not follow the protocol."""


def agreement_rounds(group_size: int) -> int:
    """R: one round per possible liar beyond two honest members, at least one, at most MAX_ROUNDS."""
    return max(1, min(group_size - 1, MAX_ROUNDS))


def max_request_bytes(group_size: int) -> int:
    return 64 + 2 * group_size * (MAX_ID_BYTES + DIGEST_BYTES + 8)


def max_answer_bytes(group_size: int) -> int:
    relays = agreement_rounds(group_size) * (MAX_ID_BYTES + MAX_SIGNATURE_BYTES + 8)
    item = MAX_ID_BYTES + DIGEST_BYTES + MAX_SIGNATURE_BYTES + 16 + relays
    return 64 + group_size * (MAX_ID_BYTES + MAX_PUBLIC_KEY_BYTES + 8) + 2 * group_size * item


@dataclass(frozen=True)
class Value:
    """An owner's signed payload digest and the relay signatures that carried it here."""

    owner: bytes
    digest: bytes
    signature: bytes  # the owner's claim
    relays: Tuple[Tuple[bytes, bytes], ...] = ()  # (signer, relay signature): distinct members, not the owner

    @property
    def key(self) -> Key:
        return self.owner, self.digest


@dataclass(frozen=True)
class Outcome:
    """The group's agreed set, as this member decided it."""

    payloads: Dict[bytes, bytes]  # owner -> payload, in group order
    excluded: Dict[bytes, str]  # owner -> why none of its payloads counts, in group order
    proofs: Dict[bytes, Tuple[Value, Value]]  # equivocator -> two values it signed


class Agreement:
    """One member's state of one group's agreement (see the module docstring for the rules)."""

    def __init__(self, binding: Binding, signer: Signer, max_payload_bytes: int,
                 senders: Optional[Collection[bytes]] = None, parts: Optional[Dict[bytes, Part]] = None):
        """``senders``: the members that send a payload this round (protocol/round/eligibility.py), the
        others' values ignored and none of them excluded; None: every member. ``parts``: the part each
        member announced; a kept payload whose header claims another is excluded (``MISANNOUNCED``)."""
        self.parts = parts
        self.binding, self.context = binding, binding.context
        self.members = tuple(binding.members)
        self._member_set = set(self.members)
        self.senders = frozenset(self._member_set if senders is None else set(senders) & self._member_set)
        if signer.peer_id not in self._member_set or len(self._member_set) != len(self.members):
            raise GroupError("the member list must name this peer once and every member once")
        self.me, self._signer = signer.peer_id, signer
        self.rounds = agreement_rounds(len(self.members))
        self.max_payload_bytes = max_payload_bytes
        self._keys: Dict[bytes, PublicKey] = {self.me: signer.verifier()}
        self._accepted: Dict[bytes, Dict[bytes, Value]] = {}  # owner -> digest -> value
        self._payloads: Dict[bytes, bytes] = {}  # digest -> payload
        self._relayed: Dict[Key, bytes] = {}  # my relay signatures, made when first needed
        self._verified: Set[bytes] = set()  # hashes of (signer, message, signature) that verified
        self._own_envelope: Optional[bytes] = None

    # ---- round 1 ------------------------------------------------------------------------------
    def seal(self, payload: bytes) -> bytes:
        """Sign my payload for this group; it is accepted here at once."""
        if self.me not in self.senders:
            raise GroupError("this member sends no payload this round")
        if len(payload) > self.max_payload_bytes:
            raise ValueError(f"my payload of {len(payload)} bytes exceeds the limit of {self.max_payload_bytes}")
        self._own_envelope, signature = seal(self._signer, self.context, payload)
        self._add(Value(self.me, payload_digest(payload), signature), payload)
        return self._own_envelope

    def take_envelope(self, owner: bytes, raw: bytes) -> bool:
        """Round 1: ``owner``'s envelope, fetched from the owner. Raises SignatureError if it does
        not prove itself; False if this owner already has two values."""
        if owner not in self._member_set:
            raise GroupError("not a member of this group")
        if owner not in self.senders:
            raise GroupError("this member sends no payload this round")
        key, signature, payload = open_envelope(raw, self.context, owner, self.max_payload_bytes)
        self._keys.setdefault(owner, key)
        return self._add(Value(owner, payload_digest(payload), signature), payload)

    def own_envelope(self) -> Optional[bytes]:
        return self._own_envelope

    # ---- rounds 2..R: the asking side ---------------------------------------------------------
    def request(self, round_no: int) -> bytes:
        """What I ask every member in round ``round_no``: the values I already hold."""
        have = [[owner, digest] for owner, values in self._accepted.items() for digest in values]
        return msgpack.packb([round_no, have], use_bin_type=True)

    def offers(self, raw: bytes, round_no: int) -> List[Value]:
        """The new values of a member's answer whose chains hold at least ``round_no`` signatures.

        Anything else is ignored: owners outside the group, forged or misbound signatures, chains
        too short for this round, values already held, owners already proven to equivocate.
        Raises GroupError for an answer that is not well-formed (the caller stops asking its sender).
        """
        keys, items = parse_answer(raw, len(self.members))
        for peer, public_key in keys:
            if peer in self._member_set and peer not in self._keys:
                try:
                    self._keys[peer] = PublicKey(peer, public_key)
                except SignatureError:
                    pass
        out: List[Value] = []
        seen: Set[Key] = set()
        for owner, digest, signature, relays in items:
            if owner not in self.senders or owner == self.me or (owner, digest) in seen:
                continue
            held = self._accepted.get(owner, {})
            if digest in held or len(held) >= 2:
                continue
            seen.add((owner, digest))
            if not self._verify(owner, claim_message(self.context, owner, digest), signature):
                continue
            chain = self._chain(owner, digest, relays, need=round_no - 1)
            if chain is not None:
                out.append(Value(owner, digest, signature, chain))
        return out

    def complete(self) -> bool:
        """Whether I hold a value of every sender."""
        return all(self._accepted.get(owner) for owner in self.senders)

    def may_stop_asking(self) -> bool:
        """Whether I may stop asking a member that holds my request of a later round, before its deadline:
        I hold a value of every sender, and the group runs its full n - 1 rounds (not capped at
        ``MAX_ROUNDS``). The member can then keep from me only a second value of some owner (proof that
        it equivocated): what another member accepts from it in a round before the last, that member
        relays to me in the next, and a value accepted in the last round (n - 1 signatures of distinct
        members other than the acceptor) carries mine, so I hold it already. So only the member I stopped
        asking can decide apart from me, if it holds a proof nobody else does, or if it stopped asking me
        as well (peer/exchange/agreement_rounds.py;
        tests/protocol/test_reconcile.py::test_a_member_cut_in_a_later_round_once_complete_sets_no_other_member_apart)."""
        return self.rounds >= len(self.members) - 1 and self.complete()

    def needs_bytes(self, value: Value) -> bool:
        return value.digest not in self._payloads

    def holds(self, owner: bytes) -> int:
        """How many values of ``owner`` I accepted (2: proven equivocator, nothing more to take)."""
        return len(self._accepted.get(owner, {}))

    def accept(self, value: Value, envelope: Optional[bytes] = None) -> bool:
        """Accept an offered value once its bytes are here (held already, or ``envelope`` served by a
        member that offered it). Raises SignatureError if the envelope is not that payload."""
        payload = self._payloads.get(value.digest)
        if payload is None:
            if envelope is None:
                return False
            _, _, payload = open_envelope(envelope, self.context, value.owner, self.max_payload_bytes)
            if payload_digest(payload) != value.digest:
                raise SignatureError("the served payload is not the one offered")
        return self._add(value, payload)

    # ---- rounds 2..R: the answering side ------------------------------------------------------
    def answer(self, have: Set[Key]) -> bytes:
        """Every value I accepted that the asker lacks, with its chain and my relay signature."""
        items: List[list] = []
        keys: Dict[bytes, bytes] = {}
        for owner, values in self._accepted.items():
            if owner == self.me:  # my own payload went out in round 1; alone I cannot make a chain of 2
                continue
            for digest, value in values.items():
                if (owner, digest) in have:
                    continue
                relays = list(value.relays) + [(self.me, self._relay_signature(owner, digest))]
                items.append([owner, digest, value.signature, [list(r) for r in relays]])
                for peer in [owner] + [signer for signer, _ in relays]:
                    keys[peer] = self._keys[peer].raw
        return msgpack.packb([[list(k) for k in keys.items()], items], use_bin_type=True)

    def serve(self, owner: bytes, digest: bytes) -> Optional[bytes]:
        """The envelope of an accepted value, for a member that was offered it and lacks its bytes."""
        value = self._accepted.get(owner, {}).get(digest)
        if value is None:
            return None
        return msgpack.packb([owner, self._keys[owner].raw, value.signature, self._payloads[digest]], use_bin_type=True)

    # ---- the decision -------------------------------------------------------------------------
    def outcome(self) -> Outcome:
        payloads: Dict[bytes, bytes] = {}
        excluded: Dict[bytes, str] = {}
        proofs: Dict[bytes, Tuple[Value, Value]] = {}
        for member in (m for m in self.members if m in self.senders):
            values = list(self._accepted.get(member, {}).values())
            if len(values) == 1 and self.parts is not None and claimed_part(
                    self._payloads[values[0].digest]) != self.parts.get(member):
                excluded[member] = MISANNOUNCED
            elif len(values) == 1:
                payloads[member] = self._payloads[values[0].digest]
            elif not values:
                excluded[member] = SILENT
            else:
                excluded[member], proofs[member] = EQUIVOCATED, (values[0], values[1])
        return Outcome(payloads, excluded, proofs)

    # ---- internals ----------------------------------------------------------------------------
    def _add(self, value: Value, payload: bytes) -> bool:
        values = self._accepted.setdefault(value.owner, {})
        if value.digest in values or len(values) >= 2:
            return False
        values[value.digest] = value
        self._payloads[value.digest] = payload
        return True

    def _chain(self, owner: bytes, digest: bytes, relays: Sequence[Tuple[bytes, bytes]], need: int):
        """The first ``need`` valid relay signatures of distinct members other than the owner, or None."""
        chain: List[Tuple[bytes, bytes]] = []
        signers = {owner}
        for signer, signature in relays:
            if len(chain) >= need:
                break
            if signer in self._member_set and signer not in signers and self._verify(
                signer, relay_message(self.context, signer, owner, digest), signature
            ):
                signers.add(signer)
                chain.append((signer, signature))
        return tuple(chain) if len(chain) >= need else None

    def _verify(self, signer: bytes, message: bytes, signature: bytes) -> bool:
        key = self._keys.get(signer)
        if key is None:
            return False
        seen = hashlib.sha256(msgpack.packb([signer, message, signature], use_bin_type=True)).digest()
        if seen in self._verified:
            return True
        if not key.verify(message, signature):
            return False
        self._verified.add(seen)
        return True

    def _relay_signature(self, owner: bytes, digest: bytes) -> bytes:
        if (owner, digest) not in self._relayed:
            self._relayed[(owner, digest)] = self._signer.sign(relay_message(self.context, self.me, owner, digest))
        return self._relayed[(owner, digest)]


# ---- wire: requests and answers of rounds 2..R ------------------------------------------------
def parse_request(raw: bytes, group_size: int) -> Tuple[int, Set[Key]]:
    """A member's round-k request: (k, the values it holds)."""
    message = _unpack(raw, group_size, max_request_bytes(group_size), "relay request")
    if not (isinstance(message, list) and len(message) == 2 and type(message[0]) is int and isinstance(message[1], list)):
        raise GroupError("a relay request is [round, [[owner, digest], ...]]")
    round_no, have = message
    if not 2 <= round_no <= MAX_ROUNDS:
        raise GroupError(f"relay round {round_no} is out of range")
    return round_no, {tuple(pair) for pair in _pairs(have, 2 * group_size)}  # type: ignore[misc]


def parse_answer(raw: bytes, group_size: int) -> Tuple[List[Tuple[bytes, bytes]], List[Tuple[bytes, bytes, bytes, list]]]:
    """A member's answer: ([(peer, public key)], [(owner, digest, claim signature, [(signer, sig)])])."""
    message = _unpack(raw, group_size, max_answer_bytes(group_size), "relay answer")
    if not (isinstance(message, list) and len(message) == 2 and all(isinstance(m, list) for m in message)):
        raise GroupError("a relay answer is [keys, items]")
    keys = _pairs(message[0], group_size)
    items = []
    if len(message[1]) > 2 * group_size:
        raise GroupError(f"a relay answer holds at most {2 * group_size} values")
    for item in message[1]:
        if not (isinstance(item, list) and len(item) == 4 and all(isinstance(f, bytes) for f in item[:3])):
            raise GroupError("a relayed value is [owner, digest, signature, relays]")
        items.append((item[0], item[1], item[2], _pairs(item[3], agreement_rounds(group_size))))
    return keys, items


def _unpack(raw: Any, group_size: int, limit: int, what: str) -> Any:
    if not isinstance(raw, (bytes, bytearray)) or len(raw) > limit:
        raise GroupError(f"a {what} must be bytes of at most {limit}")
    return bounded_unpack(bytes(raw), GroupError, what, max_array_len=2 * group_size + 4, max_map_len=0)


def _pairs(value: Any, at_most: int) -> List[Tuple[bytes, bytes]]:
    if not isinstance(value, list) or len(value) > at_most:
        raise GroupError(f"expected a list of at most {at_most} pairs")
    if not all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, bytes) for x in p) for p in value):
        raise GroupError("expected [bytes, bytes] pairs")
    return [(p[0], p[1]) for p in value]


# ---- matchmaking ------------------------------------------------------------------------------
MAX_LAST_SETS = 64  # names of its last round's sets a member announces at most (groups of one round)
# a member's matchmaking data as hivemind relays it to the group ([bandwidth, mode, announcement]):
# an honest one, 64 names of 64 characters and its hashes, is under 5 KB; a leader refuses a join
# request past this bound before it relays the data to every member (peer/exchange/matchmaking.py)
MAX_GATHER_BYTES = 16 * 1024


class Announced(NamedTuple):
    """A member's matchmaking announcement, checked (``announcement``)."""

    round: int
    start_hash: str  # the hash of the parameters it starts the round from
    base: str = ""  # the hash of θ before its last round's outer step ("": it did not conclude round - 1)
    last_sets: Tuple[str, ...] = ()  # the names of the sets that round's θ was computed from
    part: Optional[Part] = None  # the part its payload carries (None: not announced)
    lineage: str = ""  # the start most of the round's peers it knows hold (protocol/round/start_vote.py)


def announcement(round_no: int, start_hash: str, base: str = "", last_sets: Sequence[str] = (),
                 part: Optional[Part] = None, lineage: str = "") -> List[Any]:
    """What each member announces in matchmaking: [round, start hash, base hash, [set names]] and, where
    given, the part its payload carries (protocol/round/eligibility.py; nil where only a lineage
    follows) and the lineage its view names (``start_vote.swarm_lineage``): the base and set names say
    which θ and which sets of round - 1 its start was computed from (protocol/round/group_sets.py,
    ``late_union``)."""
    out = [round_no, start_hash, base, sorted(last_sets)[:MAX_LAST_SETS]]
    if part is not None or lineage:
        out.append(list(part) if isinstance(part, tuple) else part)
    return out + [lineage] if lineage else out


def _announced_part(raw: Any) -> Optional[Part]:
    if type(raw) is int:
        return raw
    if isinstance(raw, (list, tuple)) and len(raw) == 2 and all(type(x) is int for x in raw):
        return (raw[0], raw[1])
    raise GroupError(f"an announced part is an int or a [start, end] pair, not {raw!r:.40}")


def parse_announcement(value: Any) -> Announced:
    """A groupmate's announcement, hashes cut to 64 characters; the short form [round, start hash]
    is read as one with no last round."""
    if not (isinstance(value, (list, tuple)) and len(value) in (2, 4, 5, 6) and isinstance(value[0], int)
            and isinstance(value[1], str)):
        raise GroupError(f"malformed matchmaking announcement {value!r:.80}")
    if len(value) == 2:
        return Announced(value[0], value[1][:MAX_HASH_CHARS])
    base, names = value[2], value[3]
    if not (isinstance(base, str) and isinstance(names, (list, tuple)) and len(names) <= MAX_LAST_SETS
            and all(isinstance(n, str) and 0 < len(n) <= MAX_HASH_CHARS for n in names)):
        raise GroupError(f"malformed last-round sets in an announcement {value!r:.80}")
    part = _announced_part(value[4]) if len(value) >= 5 and value[4] is not None else None
    lineage = value[5] if len(value) == 6 else ""
    if not isinstance(lineage, str):
        raise GroupError(f"an announced lineage is a hash, not {lineage!r:.40}")
    return Announced(value[0], value[1][:MAX_HASH_CHARS], base[:MAX_HASH_CHARS], tuple(sorted(set(names))), part,
                     lineage[:MAX_HASH_CHARS])


def members_of_round(values: Sequence[Any], round_no: int) -> Tuple[Dict[int, Announced], Dict[int, str]]:
    """Which members of a matchmade group gather for ``round_no``: (position -> announcement, for those
    that do; position -> why, for the others).

    ``values``: each member's announcement, in the group's order (None where it could not be read).
    The matchmaking key holds the round modulo 2**20, so an honest member of another round is a
    wrap-around or a matchmaking of ours that outlived its round; a member announcing garbage or
    another round is hostile or stale. Either way it is left out of the group, by every member
    alike (they all hold the leader's same list), and the others gather without it: one bad
    announcement no longer fails the whole group."""
    kept: Dict[int, Announced] = {}
    dropped: Dict[int, str] = {}
    for i, value in enumerate(values):
        try:
            announced = parse_announcement(value)
        except GroupError as e:
            dropped[i] = str(e)
            continue
        if announced[0] != round_no:
            dropped[i] = f"announced round {announced[0]}, not {round_no}"
        else:
            kept[i] = announced
    return kept, dropped