"""Signed payloads: a signature proves which peer id wrote a payload, for which run, round and group.

A libp2p peer id is not a name a peer picks: it is the multihash of the peer's public key
(https://github.com/libp2p/specs/blob/master/peer-ids/peer-ids.md), serialized as the protobuf
``crypto.pb.PublicKey {key_type, data}``. For an Ed25519 key (what voloco creates) the data is the
32-byte key, and the id is the protobuf itself as an identity multihash (0x00 0x24 + protobuf):
the id *is* the key. For an RSA key (what hivemind's identity files hold) the data is the DER
SubjectPublicKeyInfo and the id is its sha2-256 multihash (0x12 0x20 + sha256). A receiver that is handed (public key, signature) checks that the key
hashes to the claimed peer id and that the signature verifies: then the holder of that peer id's
private key, and nobody else, signed the message. The libp2p stream that delivered the bytes is
no evidence of authorship: a member relays other members' payloads.

Every signature covers a *binding*: the run (spec digest), the round, the group id and the
group's member list, so a signature for another run, round or group (or another view of the same
group, from a lying matchmaking leader) never counts here. Two messages are signed:

- a claim ``["voloco/payload/1", binding, owner, sha256(payload)]``: the owner wrote this payload;
- a relay ``["voloco/relay/1", binding, signer, owner, digest]``: the signer accepted the owner's
  payload of that digest (protocol/round/reconcile.py counts these to reach agreement).

An envelope is what travels: ``[owner, public key, claim signature, payload]`` (msgpack).
Pure: the ``cryptography`` package computes, nothing here reads a file or a socket.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Tuple

import msgpack
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, padding, rsa

from protocol.wire.bounded_unpack import bounded_unpack
from protocol.errors import ProtocolError

__all__ = [
    "Binding", "SignatureError", "Signer", "PublicKey", "peer_id_of", "seal", "open_envelope",
    "claim_message", "relay_message", "payload_digest", "ENVELOPE_OVERHEAD",
]

_RSA_KEY_TYPE, _ED25519_KEY_TYPE = 0, 1  # crypto.pb.KeyType
_SHA2_256 = b"\x12\x20"  # multihash prefix: sha2-256, 32 bytes
_ED25519_PREFIX = b"\x08\x01\x12\x20"  # the protobuf of an Ed25519 public key, before its 32 bytes
_MAX_INLINE_KEY = 42  # libp2p inlines a serialized key of at most this many bytes in the peer id
MIN_RSA_BITS, MAX_RSA_BITS = 2048, 4096  # weaker keys are refused; larger ones only cost verification time
MAX_PUBLIC_KEY_BYTES = 1024  # a 4096-bit key's protobuf is about 550 bytes
MAX_SIGNATURE_BYTES = MAX_RSA_BITS // 8
MAX_ID_BYTES = 64  # a sha2-256 multihash peer id is 34 bytes
ENVELOPE_OVERHEAD = 2048  # what an envelope adds to its payload, at most (id, key, signature, framing)
DIGEST_BYTES = 32
_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=32)


class SignatureError(ProtocolError):
    """A key, signature or envelope that does not prove what it claims."""


def payload_digest(payload: bytes) -> bytes:
    """How members name a payload to each other: its sha256 (what the owner's claim signs)."""
    return hashlib.sha256(payload).digest()


@dataclass(frozen=True)
class Binding:
    """What every signature of one group's exchange is bound to."""

    run: bytes  # the run's spec digest
    round: int
    group_id: bytes
    members: Tuple[bytes, ...]  # peer ids, in group order

    @property
    def context(self) -> bytes:
        return hashlib.sha256(
            msgpack.packb(["voloco/group/1", self.run, self.round, self.group_id, list(self.members)], use_bin_type=True)
        ).digest()


def claim_message(context: bytes, owner: bytes, digest: bytes) -> bytes:
    return msgpack.packb(["voloco/payload/1", context, owner, digest], use_bin_type=True)


def relay_message(context: bytes, signer: bytes, owner: bytes, digest: bytes) -> bytes:
    return msgpack.packb(["voloco/relay/1", context, signer, owner, digest], use_bin_type=True)


# ---- keys and peer ids ------------------------------------------------------------------------
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def encode_public_key(key) -> bytes:
    """The libp2p protobuf of an Ed25519 or RSA public key (deterministic: field 1, then field 2)."""
    if isinstance(key, ed25519.Ed25519PublicKey):
        return _ED25519_PREFIX + key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return b"\x08" + bytes([_RSA_KEY_TYPE]) + b"\x12" + _varint(len(der)) + der


def peer_id_of(public_key: bytes) -> bytes:
    """The libp2p peer id of a serialized public key: the key itself as an identity multihash when it
    is at most 42 bytes (an Ed25519 key's 36), else its sha2-256 multihash (an RSA key)."""
    if len(public_key) <= _MAX_INLINE_KEY:
        return b"\x00" + _varint(len(public_key)) + public_key
    return _SHA2_256 + hashlib.sha256(public_key).digest()


def key_of_peer_id(peer_id: bytes) -> bytes:
    """The serialized public key inlined in a peer id (an Ed25519 one), or b"" if it only hashes it."""
    if len(peer_id) >= 2 and peer_id[0] == 0 and peer_id[1] == len(peer_id) - 2 <= _MAX_INLINE_KEY:
        return peer_id[2:]
    return b""


class PublicKey:
    """A peer's Ed25519 or RSA public key, checked to be the key of ``peer_id``."""

    def __init__(self, peer_id: bytes, public_key: bytes):
        if not (isinstance(public_key, bytes) and len(public_key) <= MAX_PUBLIC_KEY_BYTES):
            raise SignatureError("a public key must be at most 1024 bytes")
        if peer_id_of(public_key) != peer_id:
            raise SignatureError("the public key is not the key of that peer id")
        self.peer_id, self.raw = peer_id, public_key
        self._key = _parse_key(public_key)

    def verify(self, message: bytes, signature: bytes) -> bool:
        if not (isinstance(signature, bytes) and len(signature) <= MAX_SIGNATURE_BYTES):
            return False
        try:
            if isinstance(self._key, ed25519.Ed25519PublicKey):
                self._key.verify(signature, message)
            else:
                self._key.verify(signature, message, _PSS, hashes.SHA256())
            return True
        except (InvalidSignature, ValueError):
            return False


# Ed25519 points of small order, sign bit cleared (libsodium's list): a key among them would
# accept signatures nobody made, so none is a peer's key.
_SMALL_ORDER = {bytes.fromhex(h) for h in (
    "0000000000000000000000000000000000000000000000000000000000000000",
    "0100000000000000000000000000000000000000000000000000000000000000",
    "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05",
    "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a",
    "ecffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
    "edffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
    "eeffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
)}


def ed25519_key(raw: bytes) -> ed25519.Ed25519PublicKey:
    """An Ed25519 public key from its 32 bytes; SignatureError for anything else or a small-order point."""
    if not isinstance(raw, bytes) or len(raw) != 32 or raw[:31] + bytes([raw[31] & 0x7F]) in _SMALL_ORDER:
        raise SignatureError("not a usable Ed25519 public key")
    try:
        return ed25519.Ed25519PublicKey.from_public_bytes(raw)
    except ValueError as e:
        raise SignatureError(f"malformed Ed25519 public key: {e}") from None


def _parse_key(public_key: bytes):
    """The strict inverse of ``encode_public_key``."""
    if public_key[:4] == _ED25519_PREFIX and len(public_key) == len(_ED25519_PREFIX) + 32:
        return ed25519_key(public_key[4:])
    if public_key[:3] != b"\x08\x00\x12":
        raise SignatureError("not an Ed25519 or RSA public key (the identities libp2p peers of voloco have)")
    length, shift, i = 0, 0, 3
    while i < len(public_key) and i < 7:
        byte = public_key[i]
        length |= (byte & 0x7F) << shift
        shift, i = shift + 7, i + 1
        if not byte & 0x80:
            break
    if length != len(public_key) - i:
        raise SignatureError("malformed public key protobuf")
    try:
        key = serialization.load_der_public_key(public_key[i:])
    except (ValueError, TypeError, UnsupportedAlgorithm) as e:  # an algorithm or curve the library lacks is refused too
        raise SignatureError(f"malformed RSA public key: {e}") from None
    if not isinstance(key, rsa.RSAPublicKey) or not MIN_RSA_BITS <= key.key_size <= MAX_RSA_BITS:
        raise SignatureError(f"RSA keys must have {MIN_RSA_BITS} to {MAX_RSA_BITS} bits")
    return key


class Signer:
    """This peer's identity: the private key whose public key is (Ed25519) or hashes to (RSA) its
    libp2p peer id."""

    def __init__(self, private_key):
        rsa_ok = isinstance(private_key, rsa.RSAPrivateKey) and MIN_RSA_BITS <= private_key.key_size <= MAX_RSA_BITS
        if not (rsa_ok or isinstance(private_key, ed25519.Ed25519PrivateKey)):
            raise SignatureError(f"an identity must be an Ed25519 key or an RSA key of {MIN_RSA_BITS} to {MAX_RSA_BITS} bits")
        self._private_key = private_key
        self.public_key = encode_public_key(private_key.public_key())
        self.peer_id = peer_id_of(self.public_key)

    @classmethod
    def generate(cls, kind: str = "ed25519") -> "Signer":
        if kind == "rsa":
            return cls(rsa.generate_private_key(public_exponent=65537, key_size=MIN_RSA_BITS))
        return cls(ed25519.Ed25519PrivateKey.generate())

    @classmethod
    def from_der(cls, der: bytes) -> "Signer":
        """From a DER private key (what a hivemind identity file's protobuf carries for RSA)."""
        try:
            return cls(serialization.load_der_private_key(der, password=None))
        except (ValueError, TypeError) as e:
            raise SignatureError(f"malformed private key: {e}") from None

    @classmethod
    def from_libp2p(cls, key_type: int, data: bytes) -> "Signer":
        """From the fields of a libp2p ``crypto.pb.PrivateKey`` (an identity file): an Ed25519 key's
        64 bytes (seed, then public key, which must match) or an RSA key's DER."""
        if key_type == _RSA_KEY_TYPE:
            return cls.from_der(data)
        if key_type != _ED25519_KEY_TYPE or len(data) != 64:
            raise SignatureError("an identity must be an Ed25519 key (64 bytes) or an RSA key")
        signer = cls(ed25519.Ed25519PrivateKey.from_private_bytes(data[:32]))
        if signer.public_key[4:] != data[32:]:
            raise SignatureError("the Ed25519 identity's public half is not its private key's")
        return signer

    def sign(self, message: bytes) -> bytes:
        if isinstance(self._private_key, ed25519.Ed25519PrivateKey):
            return self._private_key.sign(message)
        return self._private_key.sign(message, _PSS, hashes.SHA256())

    def verifier(self) -> PublicKey:
        return PublicKey(self.peer_id, self.public_key)

    def __getstate__(self):  # picklable, for a process started by spawn
        return self._private_key.private_bytes(
            serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    def __setstate__(self, der: bytes) -> None:
        self.__init__(serialization.load_der_private_key(der, password=None))


# ---- envelopes --------------------------------------------------------------------------------
def seal(signer: Signer, context: bytes, payload: bytes) -> Tuple[bytes, bytes]:
    """(the envelope of ``payload``, the claim signature) for one binding's context."""
    signature = signer.sign(claim_message(context, signer.peer_id, payload_digest(payload)))
    return msgpack.packb([signer.peer_id, signer.public_key, signature, payload], use_bin_type=True), signature


def open_envelope(raw: bytes, context: bytes, owner: bytes, max_payload_bytes: int) -> Tuple[PublicKey, bytes, bytes]:
    """Check that ``raw`` is ``owner``'s signed payload for this binding: (owner's key, signature,
    payload). Raises SignatureError for anything else, whatever the bytes."""
    if not isinstance(raw, (bytes, bytearray)) or len(raw) > max_payload_bytes + ENVELOPE_OVERHEAD:
        raise SignatureError("an envelope must be bytes within the payload limit")
    fields = bounded_unpack(bytes(raw), SignatureError, "envelope", max_array_len=4, max_map_len=0)
    if not (isinstance(fields, list) and len(fields) == 4 and all(isinstance(f, bytes) for f in fields)):
        raise SignatureError("an envelope is [owner, public key, signature, payload], all bytes")
    sender, public_key, signature, payload = fields
    if sender != owner:
        raise SignatureError("the envelope names another owner")
    if len(payload) > max_payload_bytes:
        raise SignatureError(f"payload of {len(payload)} bytes exceeds the limit of {max_payload_bytes}")
    key = PublicKey(owner, public_key)
    if not key.verify(claim_message(context, owner, payload_digest(payload)), signature):
        raise SignatureError("the owner's signature does not verify for this run, round and group")
    return key, signature, payload
