"""This node's key, and what it trusts: one RSA key is both its libp2p identity (hence its peer
id) and the key that signs its DHT records.

Because the two are one key, a record's owner (the public key in its subkey) determines the
peer id it may speak for (``peer_id_of``): nobody can sign a record for another peer's id.
hivemind writes identity files as an RSA key in a libp2p ``PrivateKey`` protobuf
(``P2P.generate_identity``); a node without ``--identity`` gets a fresh one in a private
temporary file, removed once its DHT node has started.
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
import weakref
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import multihash
from cryptography.hazmat.primitives import serialization
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from protocol.keys import key_fingerprint, owner_marker
from protocol.spec import RunSpec
from swarm.console import UsageError


@dataclass(frozen=True)
class Identity:
    private_key: RSAPrivateKey
    public_key: bytes  # OpenSSH encoding, as in owner markers
    peer_id: str  # base58

    @property
    def marker(self) -> bytes:
        return owner_marker(self.public_key)

    @property
    def fingerprint(self) -> str:
        return key_fingerprint(self.public_key)


def load_identity(path: str) -> Identity:
    """The identity in a libp2p private-key file; UsageError if it is not an RSA key."""
    try:
        with open(path, "rb") as f:
            message = crypto_pb2.PrivateKey.FromString(f.read())
        if message.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError(f"key type {crypto_pb2.KeyType.Name(message.key_type)}, not RSA")
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        key.__setstate__({"_private_key": message.data})  # hivemind's own unpickling path
    except (OSError, ValueError, TypeError) as e:
        raise UsageError(f"--identity {path!r} is not a usable RSA identity file ({e}): move it away to create a new one") from None
    public = key.get_public_key().to_bytes()
    return Identity(key, public, peer_id_of(public))


def prepare_identity(path: Optional[str]) -> Tuple[Identity, str, bool]:
    """(identity, its file, whether it was created now): the file at ``path`` (created if missing)
    or, without a path, a fresh one in a private temporary directory."""
    if path is None:
        path = os.path.join(tempfile.mkdtemp(prefix="voloco-id-"), "identity.key")
    created = not os.path.exists(path)
    if created:
        P2P.generate_identity(path)
    return load_identity(path), path, created


MIN_RSA_BITS, MAX_RSA_BITS = 2048, 4096  # weaker keys are refused; larger ones only cost verification time


@functools.lru_cache(maxsize=4096)
def peer_id_of(public_key: bytes) -> str:
    """The libp2p peer id of an OpenSSH-encoded RSA public key (as PeerID.from_identity derives
    it from the private key: the sha2-256 multihash of the key's libp2p protobuf); ValueError if
    it is not one, or not of 2048 to 4096 bits."""
    key = RSAPublicKey.from_bytes(public_key)._public_key
    if not MIN_RSA_BITS <= key.key_size <= MAX_RSA_BITS:
        raise ValueError(f"RSA keys must have {MIN_RSA_BITS} to {MAX_RSA_BITS} bits")
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))).to_base58()


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
        raise RuntimeError("this DHT node was not started with swarm.dht.start_dht: it has no identity to sign with") from None
