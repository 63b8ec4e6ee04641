"""The record validators every voloco DHT node runs: a record that fails them is neither stored
nor returned by an honest node, and readers (swarm/records.py) check the same again.

- ``OwnerSignatureValidator``, hivemind's ``RSASignatureValidator`` for Ed25519 owners as well as
  RSA ones: a record whose subkey carries ``[owner:<key>]`` must be signed by that key (over key,
  subkey, value and expiration);
- hivemind's ``SchemaValidator`` with the layouts below: under a voloco key, every subkey carries
  an owner and every value is an envelope (protocol/dht/records.py) of bounded size;
- ``OwnedRecordValidator``: the envelope names the peer id of the key that signed it, its
  expiration is not absurdly far ahead, and, in a private run, it proves the join token.

``RememberingValidator`` runs them as hivemind's ``CompositeValidator`` does and remembers the
records that passed: every node that answers a read or a store's search returns the whole
dictionary of a key (every peer's progress record), and each answer was checked record by record
again, signature and schema included, though the records had not changed since the last read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import struct
from collections import OrderedDict
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import pydantic.v1 as pydantic
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.validation import CompositeValidator, DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time

from protocol.dht.keys import (
    CANDIDATES_FIELD,
    CHAINS_FIELD,
    HISTORY_FIELD,
    OWNER_PREFIX,
    PEERS_FIELD,
    RUNS_KEY,
    RUNS_PREFIX,
    split_subkey,
)
from protocol.dht.records import (
    MAC_BYTES,
    MAX_BODY_BYTES,
    MAX_PEER_ID,
    MAX_RECORD_TTL,
    RecordError,
    expires_too_late,
    open_envelope,
    proof_ok,
    record_mac,
)
from protocol.wire.bounded_unpack import MAX_DEPTH, packed_nesting
from swarm.access.identity import Identity, peer_id_of, public_key_from_bytes

logger = logging.getLogger("voloco.swarm")


class Envelope(pydantic.BaseModel):
    peer: pydantic.constr(strict=True, min_length=1, max_length=MAX_PEER_ID)
    body: pydantic.conbytes(strict=True, max_length=MAX_BODY_BYTES)
    mac: pydantic.conbytes(strict=True, max_length=MAC_BYTES)

    class Config:
        extra = pydantic.Extra.forbid


OwnedEnvelopes = Dict[BytesWithPublicKey, Envelope]  # the type of every field of voloco's schemas


class OwnedSchemaValidator(SchemaValidator):
    """hivemind's ``SchemaValidator``, with a quick check of a record under a key whose field is
    ``OwnedEnvelopes`` in every schema that names it, plainly (``_plainly_owned``): its subkey is bytes
    with an owner marker and its value an envelope of exact types and bounded sizes. What the quick
    check passes, pydantic's passes; anything else (a refusal, a field of another type from a merged
    schema) goes to hivemind's check. pydantic's check took 24 of a new record's 129 µs, the quick one
    2 (``python bench/record_checks.py``; tests/swarm/test_owned_schema.py compares the two over valid
    and mutated records)."""

    def validate(self, record: DHTRecord) -> bool:
        field = self._key_id_to_field_name.get(record.key)
        if field is not None and field in self._quick_fields() and record.subkey not in DHTProtocol.RESERVED_SUBKEYS:
            try:
                if _is_owned_envelope(DHTProtocol.serializer.loads(record.subkey), DHTProtocol.serializer.loads(record.value)):
                    return True
            except Exception:
                pass  # hivemind's check says why
        return super().validate(record)

    def _quick_fields(self) -> frozenset:
        quick = self.__dict__.get("_quick")
        if quick is None:
            types: Dict[str, set] = {}
            for schema in self._schemas:
                for f in schema.__fields__.values():
                    types.setdefault(f.name, set()).add(_plainly_owned(schema, f))
            quick = self._quick = frozenset(name for name, kinds in types.items() if kinds == {True})
        return quick

    def merge_with(self, other: RecordValidatorBase) -> bool:
        self.__dict__.pop("_quick", None)
        return super().merge_with(other)


def _plainly_owned(schema: Any, f: Any) -> bool:
    """Whether pydantic checks field ``f`` of ``schema`` as the quick check does: typed ``OwnedEnvelopes``,
    under its own name, with no validator of its own or of the model and no string rule in the model's
    config (each would refuse what the quick check passes)."""
    config = schema.__config__
    return (f.outer_type_ == OwnedEnvelopes and f.alias == f.name and not f.class_validators
            and not schema.__pre_root_validators__ and not schema.__post_root_validators__
            and config.max_anystr_length is None and not config.min_anystr_length
            and not config.anystr_strip_whitespace and not getattr(config, "anystr_lower", False)
            and not getattr(config, "anystr_upper", False))


def _is_owned_envelope(subkey: Any, value: Any) -> bool:
    return (type(subkey) is bytes and _has_owner(subkey)
            and type(value) is dict and len(value) == 3 and value.keys() == {"peer", "body", "mac"}
            and type(value["peer"]) is str and 0 < len(value["peer"]) <= MAX_PEER_ID
            and type(value["body"]) is bytes and len(value["body"]) <= MAX_BODY_BYTES
            and type(value["mac"]) is bytes and len(value["mac"]) <= MAC_BYTES)


def _has_owner(subkey: bytes) -> bool:
    try:
        BytesWithPublicKey.match_regex(subkey)  # pydantic's own test of the subkey's owner marker
    except ValueError:
        return False
    return True


class RunsSchema(pydantic.BaseModel):
    """``voloco_runs``: one spec per (owner, run id)."""

    runs: Dict[BytesWithPublicKey, Envelope]


class RunSchema(pydantic.BaseModel):
    """A run's keys, ``{run_id}_{field}``."""

    peers: Dict[BytesWithPublicKey, Envelope]
    chain_candidates: Dict[BytesWithPublicKey, Envelope]
    chains: Dict[BytesWithPublicKey, Envelope]
    history: Dict[BytesWithPublicKey, Envelope]


assert RUNS_KEY == f"{RUNS_PREFIX}_runs"
assert list(RunSchema.__fields__) == [PEERS_FIELD, CANDIDATES_FIELD, CHAINS_FIELD, HISTORY_FIELD]


def key_id(key: str) -> bytes:
    """The DHT's id of a key, as validators see it (and record proofs bind to)."""
    return DHTID.generate(source=key).to_bytes()


def check_owned(kid: bytes, subkey: Any, value: Any, token_key: Optional[bytes]) -> Tuple[bytes, str, str, bytes]:
    """(owner public key, subkey name, peer id, body) of an owned record, once its envelope, the
    binding of its peer id to its owner and (in a private run) its proof of the token hold;
    RecordError otherwise. The owner's signature is the OwnerSignatureValidator's to check."""
    parts = split_subkey(subkey)
    if parts is None:
        raise RecordError("subkey carries no owner key")
    owner, name = parts
    peer, body, mac = open_envelope(value)
    try:
        owner_peer = peer_id_of(owner)
    except ValueError:
        raise RecordError("owner key is not an Ed25519 or RSA public key") from None
    if peer != owner_peer:
        raise RecordError(f"record names peer {peer[-8:]} but is signed by the key of {owner_peer[-8:]}")
    if token_key is not None and not proof_ok(record_mac(token_key, kid, subkey, peer, body), mac):
        raise RecordError(f"record of {peer[-8:]} does not prove the run's join token")
    return owner, name, peer, body


# the most bytes one record (key, subkey and value) may take: the largest body an honest writer stores
# (a run spec), its envelope, signature and key, with room to spare; hivemind's own records are far smaller
MAX_RECORD_BYTES = MAX_BODY_BYTES + 8192


def within_bounds(record: DHTRecord) -> bool:
    """Whether any node should keep ``record`` at all, whoever wrote it: at most ``MAX_RECORD_BYTES``, and
    an expiration no honest writer sets further ahead (``MAX_RECORD_TTL``). Records with no owner (any
    key outside the run's schema passes the schema) used to be kept at any size until an expiration of
    the writer's choosing, for ever (tests/swarm/test_remembering_validator.py)."""
    size = len(record.key) + len(record.subkey or b"") + len(record.value or b"")
    return size <= MAX_RECORD_BYTES and not expires_too_late(record.expiration_time, get_dht_time(), MAX_RECORD_TTL)


class OwnerSignatureValidator(RSASignatureValidator):
    """hivemind's signature check of owned records, for owners with an Ed25519 key (what voloco
    identities are) or an RSA key: the marker, signature format and signed bytes are hivemind's,
    so an RSA-owned record is checked exactly as ``RSASignatureValidator`` checks it."""

    def validate(self, record: DHTRecord) -> bool:
        owners = self._PUBLIC_KEY_RE.findall(record.key)
        if record.subkey is not None:
            owners += self._PUBLIC_KEY_RE.findall(record.subkey)
        if not owners:
            return True  # not protected by an owner
        if len(set(owners)) > 1:
            return False
        try:
            public_key = public_key_from_bytes(owners[0])
        except (ValueError, TypeError):
            return False  # (hivemind's raises here, and the whole answer carrying it is lost)
        signatures = self._SIGNATURE_RE.findall(record.value)
        if len(signatures) != 1:
            return False
        stripped = dataclasses.replace(record, value=self.strip_value(record))
        return public_key.verify(self._serialize_record(stripped), signatures[0])


class OwnedRecordValidator(RecordValidatorBase):
    """Applies ``check_owned`` to every record whose subkey carries an owner marker, and refuses
    an expiration further ahead than any honest writer sets."""

    def __init__(self, token_key: Optional[bytes] = None):
        self.token_key = token_key

    def validate(self, record: DHTRecord) -> bool:
        if OWNER_PREFIX not in record.subkey:
            return True  # not a voloco record (hivemind's averager keys); the schema covers voloco keys
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
            value = MSGPackSerializer.loads(record.value)
        except Exception:
            return False
        if expires_too_late(record.expiration_time, get_dht_time(), MAX_RECORD_TTL):
            logger.debug("refusing a record that expires too far ahead")
            return False
        try:
            check_owned(record.key, subkey, value, self.token_key)
        except RecordError as e:
            logger.debug(f"refusing a record: {e}")
            return False
        return True

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, OwnedRecordValidator) and other.token_key == self.token_key


VALID_RECORDS_KEPT = 8192  # records a node remembers as valid (a 16-byte digest each)


class RememberingValidator(RecordValidatorBase):
    """hivemind's ``CompositeValidator`` of ``validators`` that remembers, by digest, the last
    ``VALID_RECORDS_KEPT`` records it passed, and passes them again unchecked.

    Sound because a pass cannot turn into a refusal while the validators stay the same: the checks
    depend on the record's bytes alone, but for "expires too far ahead", which only a record's own
    age relaxes. A refusal is not remembered (it may pass later), so a hostile peer's records
    cost what they did. Validators added later (``merge_with``: hivemind's ``DHT.add_validators``)
    can refuse what passed before, so they clear what is remembered."""

    def __init__(self, validators: Iterable[RecordValidatorBase], capacity: int = VALID_RECORDS_KEPT):
        self.inner = CompositeValidator(validators)
        self.capacity = capacity
        self._passed: "OrderedDict[bytes, None]" = OrderedDict()
        self.hits = self.checks = 0

    @staticmethod
    def _digest(record: DHTRecord) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        for part in (record.key, record.subkey, record.value):
            h.update(struct.pack("<Q", len(part)))
            h.update(part)
        h.update(struct.pack("<d", record.expiration_time))
        return h.digest()

    def validate(self, record: DHTRecord) -> bool:
        digest = self._digest(record)
        if digest in self._passed:
            self._passed.move_to_end(digest)
            self.hits += 1
            return True
        self.checks += 1
        # before any validator decodes it: hivemind's decoder recurses through C for each tuple and
        # overflows the stack (a segmentation fault) about 200 deep; nothing honest nests past MAX_DEPTH
        if any(packed_nesting(b) > MAX_DEPTH for b in (record.subkey or b"", record.value or b"")):
            return False
        if not within_bounds(record):
            return False
        if not self.inner.validate(record):
            return False
        self._passed[digest] = None
        if len(self._passed) > self.capacity:
            self._passed.popitem(last=False)
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        return self.inner.sign_value(record)

    def strip_value(self, record: DHTRecord) -> bytes:
        return self.inner.strip_value(record)

    def merge_with(self, other: RecordValidatorBase) -> bool:
        self.inner.extend([other])
        self._passed.clear()
        return True


def node_validators(identity: Identity, token_key: Optional[bytes], run_ids: Sequence[str] = ()) -> List[RecordValidatorBase]:
    """What ``hivemind.DHT(record_validators=...)`` gets on every voloco node: one
    ``RememberingValidator`` of the validators above."""
    return [RememberingValidator([
        OwnerSignatureValidator(identity.private_key),
        OwnedSchemaValidator(RunsSchema, prefix=RUNS_PREFIX),
        OwnedRecordValidator(token_key),
        *(run_schema(r) for r in run_ids),
    ])]


def run_schema(run_id: str) -> SchemaValidator:
    return OwnedSchemaValidator(RunSchema, prefix=run_id)
