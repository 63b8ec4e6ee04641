"""This node's key, and what it trusts: one key is both its libp2p identity (hence its peer id)
and the key that signs its DHT records.

Because the two are one key, a record's owner (the public key in its subkey) determines the
peer id it may speak for (``peer_id_of``): nobody can sign a record for another peer's id.
Identity files are a libp2p ``PrivateKey`` protobuf, as p2pd reads them. voloco creates Ed25519
keys: every record carries its owner's key and signature, and an Ed25519 key and signature take
80 and 88 bytes in a record against an RSA-2048 key's 380 and 344 (bench/RESULTS.md, "Ed25519
identities"). RSA identity files (hivemind's ``P2P.generate_identity``, older voloco peers) still
load and sign. A node without ``--identity`` gets a fresh one in a private temporary file, removed
once its DHT node has started.
"""

from __future__ import annotations

import base64
import binascii
import functools
import os
import tempfile
import weakref
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple, Union

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import PrivateKey, PublicKey, RSAPrivateKey, RSAPublicKey

from protocol.wire import signed
from protocol.dht.keys import key_fingerprint, owner_marker
from protocol.spec import RunSpec
from swarm.console import UsageError


class Ed25519PublicKey(PublicKey):
    """hivemind's public-key interface over an Ed25519 key: OpenSSH bytes, base64 signatures."""

    def __init__(self, key: ed25519.Ed25519PublicKey):
        self._public_key = key

    def verify(self, data: bytes, signature: bytes) -> bool:
        try:
            raw = base64.b64decode(signature, validate=True)
            if len(raw) != 64:
                return False
            self._public_key.verify(raw, data)
            return True
        except (binascii.Error, ValueError, InvalidSignature):
            return False

    def to_bytes(self) -> bytes:
        return self._public_key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)

    @classmethod
    def from_bytes(cls, key: bytes) -> "Ed25519PublicKey":
        loaded = serialization.load_ssh_public_key(key)
        if not isinstance(loaded, ed25519.Ed25519PublicKey):
            raise ValueError("not an Ed25519 public key")
        signed.ed25519_key(loaded.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))
        return cls(loaded)


class Ed25519PrivateKey(PrivateKey):
    """hivemind's private-key interface over an Ed25519 key (what hivemind's validators and
    authorizers call: ``sign`` gives base64, as ``RSAPrivateKey.sign`` does)."""

    def __init__(self, key: Optional[ed25519.Ed25519PrivateKey] = None):
        self._private_key = key if key is not None else ed25519.Ed25519PrivateKey.generate()

    def sign(self, data: bytes) -> bytes:
        return base64.b64encode(self._private_key.sign(data))

    def get_public_key(self) -> Ed25519PublicKey:
        return Ed25519PublicKey(self._private_key.public_key())

    def libp2p_bytes(self) -> bytes:
        """The 64 bytes of a libp2p Ed25519 private key: the seed, then the public key."""
        seed = self._private_key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                               serialization.NoEncryption())
        public = self._private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return seed + public

    def __getstate__(self):
        return {"seed": self.libp2p_bytes()[:32]}

    def __setstate__(self, state):
        self._private_key = ed25519.Ed25519PrivateKey.from_private_bytes(state["seed"])


OWNER_KEYS_KEPT = 4096  # owner keys kept parsed (a node checks each peer's records every round) ...
KEPT_KEY_BYTES = 1024  # ... if at most this long (an RSA-4096 OpenSSH key is about 725 bytes)


def _small_keys_kept(parse):
    """``parse`` of an owner key, its results kept for the last ``OWNER_KEYS_KEPT`` keys of at most
    ``KEPT_KEY_BYTES`` (a refusal is not kept, so garbage costs what it did; a longer key, which no honest
    writer makes, is parsed each time: kept, 4,096 keys padded to a record's size pinned 0.5 GB)."""
    kept = functools.lru_cache(maxsize=OWNER_KEYS_KEPT)(parse)

    @functools.wraps(parse)
    def call(key):
        return kept(key) if isinstance(key, bytes) and len(key) <= KEPT_KEY_BYTES else parse(key)

    call.cache_info, call.cache_clear = kept.cache_info, kept.cache_clear
    return call


@_small_keys_kept
def public_key_from_bytes(key: bytes) -> Union[Ed25519PublicKey, RSAPublicKey]:
    """An owner's OpenSSH public key, Ed25519 or RSA of 2048 to 4096 bits; ValueError for anything else
    (an RSA key of 400,000 bits parses in a millisecond and would make every signature check a long
    one). Parsing was an eighth of checking a record's signature: kept (``_small_keys_kept``;
    tests/swarm/test_signed_records.py::test_owner_keys_are_parsed_once)."""
    try:
        if key.startswith(b"ssh-ed25519 "):
            return Ed25519PublicKey.from_bytes(key)
        parsed = RSAPublicKey.from_bytes(key)
    except (UnsupportedAlgorithm, TypeError, signed.SignatureError) as e:
        raise ValueError(f"not an Ed25519 or RSA public key: {e}") from None
    if not signed.MIN_RSA_BITS <= parsed._public_key.key_size <= signed.MAX_RSA_BITS:  # (p2pd's own rule)
        raise ValueError(f"RSA keys must have {signed.MIN_RSA_BITS} to {signed.MAX_RSA_BITS} bits")
    return parsed


@dataclass(frozen=True)
class Identity:
    private_key: Union[Ed25519PrivateKey, RSAPrivateKey]
    public_key: bytes  # OpenSSH encoding, as in owner markers
    peer_id: str  # base58
    libp2p_key: Tuple[int, bytes]  # the identity file's (key type, data): what the payload signer is made from

    @property
    def marker(self) -> bytes:
        return owner_marker(self.public_key)

    @property
    def fingerprint(self) -> str:
        return key_fingerprint(self.public_key)


def load_identity(path: str) -> Identity:
    """The identity in a libp2p private-key file; UsageError if it is not an Ed25519 or RSA key."""
    try:
        with open(path, "rb") as f:
            message = crypto_pb2.PrivateKey.FromString(f.read())
        if message.key_type == crypto_pb2.KeyType.Ed25519:
            signed.Signer.from_libp2p(message.key_type, message.data)  # the key, and that its two halves agree
            key = Ed25519PrivateKey(ed25519.Ed25519PrivateKey.from_private_bytes(message.data[:32]))
        elif message.key_type == crypto_pb2.KeyType.RSA:
            key = RSAPrivateKey.__new__(RSAPrivateKey)
            key.__setstate__({"_private_key": message.data})  # hivemind's own unpickling path
        else:
            raise ValueError(f"key type {crypto_pb2.KeyType.Name(message.key_type)}, not Ed25519 or RSA")
        public = key.get_public_key().to_bytes()
        peer_id = peer_id_of(public)
    except (OSError, ValueError, TypeError, signed.SignatureError) as e:
        raise UsageError(f"--identity {path!r} is not a usable identity file ({e}): move it away to create a new one") from None
    return Identity(key, public, peer_id, (message.key_type, bytes(message.data)))


def write_identity(path: str, seed: Optional[bytes] = None) -> None:
    """A new Ed25519 identity file at ``path``, readable by its owner only (as hivemind writes its RSA ones).
    ``seed`` (32 bytes): the key made from it, the same every time; for benchmarks whose runs are
    paired by peer (a peer's data stream follows its id), never for a real peer's identity."""
    if seed is not None and len(seed) != 32:
        raise ValueError(f"an Ed25519 seed is 32 bytes, not {len(seed)}")
    key = Ed25519PrivateKey(None if seed is None else ed25519.Ed25519PrivateKey.from_private_bytes(seed))
    message = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=key.libp2p_bytes())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    with os.fdopen(fd, "wb") as f:
        f.write(message.SerializeToString())


def prepare_identity(path: Optional[str]) -> Tuple[Identity, str, bool]:
    """(identity, its file, whether it was created now): the file at ``path`` (created if missing)
    or, without a path, a fresh one in a private temporary directory."""
    if path is None:
        path = os.path.join(tempfile.mkdtemp(prefix="voloco-id-"), "identity.key")
    created = not os.path.exists(path)
    if created:
        write_identity(path)
    return load_identity(path), path, created


@_small_keys_kept
def peer_id_of(public_key: bytes) -> str:
    """The libp2p peer id of an OpenSSH-encoded Ed25519 or RSA public key (as p2pd derives it:
    protocol/wire/signed.py); ValueError if it is neither, a small-order Ed25519 point, or an RSA key
    not of 2048 to 4096 bits."""
    key = public_key_from_bytes(public_key)._public_key  # (which refuses RSA keys of other sizes)
    return PeerID(signed.peer_id_of(signed.encode_public_key(key))).to_base58()


@dataclass
class NodeTrust:
    """What one DHT node of this process signs with, proves, and accepts."""

    identity: Identity
    token_key: Optional[bytes] = None  # the join token's HMAC key: a private run
    run_key: Optional[str] = None  # the fingerprint given with --run-key
    owners: Dict[str, bytes] = field(default_factory=dict)  # run id -> public key of the spec accepted
    specs: Dict[str, RunSpec] = field(default_factory=dict)  # run id -> the spec accepted


_TRUST: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def register(dht, trust: NodeTrust) -> None:
    _TRUST[dht] = trust


def trust_of(dht) -> NodeTrust:
    try:
        return _TRUST[dht]
    except KeyError:
        raise RuntimeError("this DHT node was not started with swarm.dht.node.start_dht: it has no identity to sign with") from None
