"""The DHT key layout, and who owns each record under it.

One well-known key lists the runs; everything else lives under a run's id. Every record is a
subkey of one of these keys, and every subkey starts with its owner's marker: ``[owner:<OpenSSH
public key>]`` (``ssh-ed25519 ...``, or ``ssh-rsa ...`` for an RSA identity), the form hivemind's
``RSASignatureValidator`` looks for. A node with swarm/dht/validators.py's ``OwnerSignatureValidator``
stores and returns a record only if its owner signed it, so nobody can write under another's
subkey; what the owner may name after the marker (a run id, a chain id) is listed below.

The owner's key is the same key as its libp2p identity, so the peer id a record belongs to
is a function of its subkey (swarm/access/identity.py derives it); a record names that peer id too.
"""

import hashlib
import re
from typing import Optional, Tuple

RUNS_PREFIX = "voloco"
RUNS_KEY = f"{RUNS_PREFIX}_runs"  # subkey: owner marker + run id; value: the run spec, signed by the run's key

# the field names of a run's keys, as hivemind's SchemaValidator(prefix=run_id) joins them: f"{run_id}_{field}"
PEERS_FIELD, CANDIDATES_FIELD, CHAINS_FIELD = "peers", "chain_candidates", "chains"
HISTORY_FIELD = "history"  # the loss history the coordinator keeps for its dashboard (protocol/dht/history.py)

OWNER_PREFIX, OWNER_SUFFIX = b"[owner:", b"]"
_OWNER = re.compile(rb"\[owner:(ssh-ed25519 [A-Za-z0-9+/=]{68}|ssh-rsa [A-Za-z0-9+/=]{16,4096})\]")
_NAME = re.compile(r"[A-Za-z0-9_.-]{0,64}")

FINGERPRINT_HEX = 32  # 128 bits: short enough to paste, far beyond a second-preimage search


def peers_key(run_id: str) -> str:
    """Progress records, one subkey per peer (its owner marker; see protocol/dht/records.py)."""
    return f"{run_id}_{PEERS_FIELD}"


def averager_prefix(run_id: str) -> str:
    """hivemind's matchmaking and state-sharing prefix (no dots allowed there)."""
    return f"{run_id}_avg"


def owner_marker(public_key: bytes) -> bytes:
    """``[owner:<key>]`` for an OpenSSH-encoded Ed25519 or RSA public key (``PublicKey.to_bytes()``)."""
    return OWNER_PREFIX + public_key + OWNER_SUFFIX


def owned_subkey(public_key: bytes, name: str = "") -> bytes:
    """The subkey of a record its owner writes: its marker, then an optional name (run or chain id)."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"a subkey name must be 0-64 of [A-Za-z0-9_.-], got {name!r}")
    return owner_marker(public_key) + name.encode()


def split_subkey(subkey: object) -> Optional[Tuple[bytes, str]]:
    """(owner public key, name) of a subkey made by ``owned_subkey``; None for anything else."""
    if not isinstance(subkey, bytes) or len(subkey) > 8192:
        return None
    m = _OWNER.match(subkey)
    if m is None:
        return None
    try:
        name = subkey[m.end():].decode("ascii")
    except UnicodeDecodeError:
        return None
    if not _NAME.fullmatch(name):
        return None
    return m.group(1), name


def key_fingerprint(public_key: bytes) -> str:
    """What a person compares: a short sha256 of an OpenSSH-encoded public key (``--run-key``)."""
    return hashlib.sha256(public_key.strip()).hexdigest()[:FINGERPRINT_HEX]


def is_fingerprint(text: str) -> bool:
    return bool(re.fullmatch(f"[0-9a-f]{{{FINGERPRINT_HEX}}}", text))
