"""Schemas of the records peers put in the DHT, validated on read, and the envelope around each.

A record from the DHT is untrusted: any node can write under a run's keys. Every record is stored
in an envelope ``{"peer": peer id, "body": msgpack bytes, "mac": bytes}``:

- its subkey carries the owner's public key (protocol/dht/keys.py) and hivemind's
  ``RSASignatureValidator`` checks the owner's signature over (key, subkey, envelope, expiration);
- ``peer`` is the libp2p peer id the record speaks for, which must be the one derived from that
  same key, so one key can never speak for another peer;
- ``mac``, in a private run, is an HMAC-SHA256 keyed by the run's join token over (key id, subkey,
  peer, body): only a holder of the token can write a record that readers accept.

Readers call ``open_envelope`` and the ``parse_*`` functions and skip what fails, so one malformed
record never breaks a peer or the coordinator's view of the swarm; they also skip a record whose
expiration lies further ahead than its writer's TTL allows (``expires_too_late``), so a forged
record cannot be made to outlive its author.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, Tuple

import msgpack

from protocol.wire.bounded_unpack import bounded_unpack
from protocol.errors import ProtocolError
from protocol.round.peer_states import STATES  # noqa: F401  (re-exported: readers of records name it here)

CHOOSING = -2  # `part` of a peer that has not chosen its slice yet (-1: a full replica)
REACH = ("unknown", "public", "client")  # can other nodes dial this peer (swarm/access/reachability.py)?


@dataclass(frozen=True)
class Progress:
    """A peer's heartbeat: where it is in the run and what it has done so far."""

    round: int  # the round this peer is training for (its parameters are those after round-1)
    step: int  # inner steps done in this round
    state: str  # one of STATES
    spec: str  # the run-spec digest the peer trains with
    loss: float  # last training loss (nats per byte)
    val_loss: float  # last validation loss, NaN before the first evaluation
    tokens: int  # tokens this peer trained on since it started
    tokens_per_s: float
    bytes_sent: int  # exchange + state-download bytes, counted at the stream level
    bytes_received: int
    params_hash: str  # sha256 prefix of the parameters at the start of `round`
    part: int = CHOOSING  # -1: full replica; s >= 0: the slice it owns (partial updates)
    device: str = ""  # what it trains on, e.g. "cpu" or "cuda:0 H100" (printable, at most 64 characters)
    util: float = 0.0  # compute utilization: time in inner steps / wall time over its last round, in [0, 1]
    reach: str = "unknown"  # one of REACH
    gathered_round: int = 0  # the round of the last payload set this peer's group agreed ...
    gathered: str = ""  # ... and that set's name (protocol/round/group_sets.py), "" before any: other groups fetch it
    # the set its group agreed in round gathered_round - 1, "" if none: a group that gathers late in a
    # round still finds the set of a peer that has already named the next round's
    gathered_before: str = ""
    # the digest of the shared state and standing table that go with params_hash (a served state is
    # checked against both: peer/checkpoints/files.py state_digest), "" while training
    state_digest: str = ""
    # the part its payloads carry where that is not ``part`` (a chain stage shows a full replica's part
    # there and sends its blocks: "0:4", protocol/round/eligibility.py ``part_key``), "" otherwise: a
    # round that takes at most K contributions waits only for peers that may send (``may_send``)
    sends: str = ""
    # the θ (params_hash) its group's set of gathered_round was applied to, "" if unknown: a peer that
    # missed the round's gather takes a set whose owners mostly started from its own θ
    # (peer/round/adopt.py ``adopt_round_set``)
    gathered_from: str = ""

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def to_wire(self) -> list:
        """The record as it goes in the DHT: its fields in order, hex digests as bytes. Written every
        few seconds by every peer and carried by every read, so every byte counts: about 150 bytes
        against about 380 for a map (msgpack) for a ready peer's record with every digest set."""
        wire = [getattr(self, name) for name in _FIELDS]
        for i in _HEX_INDICES:
            if _HEX.fullmatch(wire[i]):
                wire[i] = bytes.fromhex(wire[i])
        return wire

    def set_of(self, round_no: int) -> str:
        """The name of the set this peer's group agreed in ``round_no`` as far as the record says, "" if unknown."""
        if self.gathered_round == round_no:
            return self.gathered
        return self.gathered_before if self.gathered_round == round_no + 1 else ""


_TYPES = {f.name: f.type for f in fields(Progress)}
_FIELDS = tuple(_TYPES)
_SET_NAME = re.compile(r"[0-9a-f]{32}")
_HEX = re.compile(r"(?:[0-9a-f]{2})+")  # a digest: written as its bytes
_HEX_FIELDS = ("spec", "params_hash", "gathered", "gathered_before", "state_digest", "gathered_from")
_HEX_INDICES = tuple(_FIELDS.index(name) for name in _HEX_FIELDS)
_LATER = {"sends": "", "gathered_from": ""}  # fields added since the first list format, absent from an older writer's record
# fields a newer writer may have appended, ignored here: a run's peers need not all upgrade at once
MAX_NEWER_FIELDS = 8
_SENDS = re.compile(r"[0-9]{1,5}:[0-9]{1,5}")


def parse_progress(value: Any) -> Progress:
    """Validate a progress record (an envelope's msgpack body, ``Progress.to_wire``'s list or, as
    earlier versions wrote it, a map); ProtocolError on anything unexpected."""
    if isinstance(value, (bytes, bytearray)):
        value = decode_body(bytes(value), "progress record")
    if isinstance(value, list):
        fewest, most = len(_FIELDS) - len(_LATER), len(_FIELDS) + MAX_NEWER_FIELDS
        if not fewest <= len(value) <= most:
            raise ProtocolError(f"progress record has {len(value)} fields, not {fewest} to {most}")
        value = {**_LATER, **dict(zip(_FIELDS, value))}  # zip drops a newer writer's fields
        for name in _HEX_FIELDS:
            if isinstance(value[name], bytes) and 0 < len(value[name]) <= 32:
                value[name] = value[name].hex()
    if isinstance(value, dict):
        value = {**{k: v for k, v in _LATER.items() if k not in value}, **value}
    if not isinstance(value, dict) or set(value) != set(_TYPES):
        raise ProtocolError("progress record has missing or unknown fields")
    for name, kind in _TYPES.items():
        v = value[name]
        if kind == "int" and (isinstance(v, bool) or not isinstance(v, int) or (v < 0 and name != "part")):
            raise ProtocolError(f"progress.{name} must be a non-negative integer")
        if kind == "float" and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ProtocolError(f"progress.{name} must be a number")
        if kind == "str" and (not isinstance(v, str) or len(v) > 64):
            raise ProtocolError(f"progress.{name} must be a short string")
    if not CHOOSING <= value["part"] < 1 << 16:
        raise ProtocolError("progress.part is out of range")
    if value["state"] not in STATES:
        raise ProtocolError(f"progress.state must be one of {STATES}")
    for name in ("loss", "val_loss"):  # NaN: none measured yet
        if not math.isfinite(value[name]) and not math.isnan(value[name]):
            raise ProtocolError(f"progress.{name} must be finite or NaN")
    if not 0.0 <= value["tokens_per_s"] < math.inf:  # NaN fails too
        raise ProtocolError("progress.tokens_per_s must be a finite non-negative number")
    if not value["device"].isprintable():
        raise ProtocolError("progress.device must be printable")
    if not 0.0 <= value["util"] <= 1.0:  # NaN fails too
        raise ProtocolError("progress.util must lie in [0, 1]")
    if value["reach"] not in REACH:
        raise ProtocolError(f"progress.reach must be one of {REACH}")
    for name in ("gathered", "gathered_before"):
        if value[name] and not _SET_NAME.fullmatch(value[name]):
            raise ProtocolError(f"progress.{name} must be empty or a set's name (32 hex digits)")
    if value["gathered_from"] and not _HEX.fullmatch(value["gathered_from"]):
        raise ProtocolError("progress.gathered_from must be empty or a parameter hash (hex digits)")
    if value["sends"] and not _SENDS.fullmatch(value["sends"]):
        raise ProtocolError("progress.sends must be empty or a chain stage's blocks (\"start:end\")")
    return Progress(**{k: (float(v) if _TYPES[k] == "float" else v) for k, v in value.items()})


# ---- the envelope ------------------------------------------------------------------------------
MAX_PEER_ID = 128  # characters of a base58 peer id
MAX_BODY_BYTES = 1 << 16  # the largest record body (a run spec is the largest)
MAC_BYTES = 32
CLOCK_SLACK = 60.0  # seconds two honest clocks may disagree
MAX_RECORD_TTL = 3 * 3600.0  # the longest TTL an honest writer uses (3 heartbeats of the longest period)
SPEC_TTL = 120.0  # the run spec record lives this long; the coordinator refreshes it at a third of that


class RecordError(ProtocolError):
    """A DHT record whose envelope, owner or proof does not hold."""


def seal(peer_id: str, body: bytes, mac: bytes = b"") -> Dict[str, Any]:
    """The envelope of a record; the DHT node signs it when it is stored."""
    return {"peer": peer_id, "body": body, "mac": mac}


def open_envelope(value: Any) -> Tuple[str, bytes, bytes]:
    """(peer id, body, mac) of an envelope read from the DHT; RecordError on anything else."""
    if not isinstance(value, dict) or set(value) != {"peer", "body", "mac"}:
        raise RecordError("record is not an envelope {peer, body, mac}")
    peer, body, mac = value["peer"], value["body"], value["mac"]
    if not isinstance(peer, str) or not 0 < len(peer) <= MAX_PEER_ID:
        raise RecordError("envelope peer must be a peer id string")
    if not isinstance(body, bytes) or len(body) > MAX_BODY_BYTES:
        raise RecordError(f"envelope body must be at most {MAX_BODY_BYTES} bytes")
    if not isinstance(mac, bytes) or len(mac) not in (0, MAC_BYTES):
        raise RecordError(f"envelope mac must be empty or {MAC_BYTES} bytes")
    return peer, body, mac


def decode_body(body: bytes, what: str) -> Any:
    """The msgpack value of an envelope's body, decoded with every length bounded."""
    n = len(body)
    return bounded_unpack(body, RecordError, what, max_array_len=n, max_map_len=n)


def encode_body(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


# ---- proofs of the join token (private runs) ---------------------------------------------------
def token_key(token: str) -> bytes:
    """The HMAC key every proof of a join token uses (the token itself never leaves the process)."""
    return hashlib.sha256(b"voloco join token\x00" + token.encode()).digest()


def record_mac(key: bytes, key_id: bytes, subkey: bytes, peer: str, body: bytes) -> bytes:
    """A record's proof of the token: HMAC over what it says, where, and for whom."""
    return hmac.new(key, msgpack.packb([b"voloco-record", key_id, subkey, peer, body]), hashlib.sha256).digest()


def admission_proof(key: bytes, peer: str, public_key: bytes, expires: str) -> bytes:
    """A node's proof of the token for the DHT's authorizer: HMAC over its peer id and RSA key."""
    return hmac.new(key, msgpack.packb([b"voloco-admission", peer, public_key, expires]), hashlib.sha256).digest()


def proof_ok(expected: bytes, got: bytes) -> bool:
    return hmac.compare_digest(expected, got)


# ---- expiration --------------------------------------------------------------------------------
def peer_record_ttl(heartbeat_period: float) -> float:
    """The TTL of a peer's progress and chain-candidate records: three heartbeats, at least 10 s."""
    return max(3 * heartbeat_period, 10.0)


def expires_too_late(expiration: float, now: float, ttl: float) -> bool:
    """Whether a record expires further ahead than a writer with this TTL would ever set (with
    a margin for late refreshes and clock skew): a forged long expiration is ignored, not kept."""
    return expiration > now + 2 * ttl + CLOCK_SLACK
