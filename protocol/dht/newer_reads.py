"""A read of a dictionary key that asks a replica only for the records newer than those the reader holds (sans-I/O).

A progress read over the network used to ask each of the key's 5 nearest nodes for the whole
dictionary: 5 copies of every peer's record, each parsed and checked, though the replicas mostly
hold the same records. swarm/dht/lean_read.py asks one replica for what is newer than the reader's
last view, then the others for what is newer than that: each record comes about once.

The request names the key and what the reader holds, one 16-byte entry a record::

    digest      8 bytes: blake2b of the record's subkey as the DHT serializes it (``subkey_digest``)
    expiration  8 bytes: big-endian float64, the expiration of the reader's copy

and the replica answers with the records whose subkey the reader does not hold, or holds with an
earlier expiration (``newer``). The answer's records are checked by the reader's validators as any
other read's: this module decides nothing about trust, it only says what to leave out.

Which replica a reader asks first (``ask_order``) is its own, by a hash of its node id: every replica
holds every record (a store reaches all of them), and the first one asked sends the reader everything
new, the others only what it missed. Readers that all asked the key's nearest replica first made it
serve every reader's new records: at 32 peers one node sent 1,153 KiB a round where the median peer
sent 137 (bench/RESULTS.md, "Ninety-seventh session").

``parse_held`` is the trust boundary on the serving side: a request it does not raise
``HeldListError`` for holds at most ``MAX_HELD`` entries of finite expirations. Pure: no sockets,
no clocks (tests/protocol/test_newer_reads.py).
"""

from __future__ import annotations

import hashlib
import math
import struct
from typing import Dict, Iterable, Iterator, List, Mapping, Sequence, Tuple, TypeVar

T = TypeVar("T")
ENTRY = struct.Struct(">8sd")
ENTRY_BYTES = ENTRY.size
# the most records a reader may say it holds: a swarm of thousands of peers (128 KiB a request)
MAX_HELD = 8192

__all__ = ["ENTRY_BYTES", "MAX_HELD", "HeldListError", "ask_order", "newer", "pack_held", "parse_held", "subkey_digest"]


class HeldListError(ValueError):
    """Bytes that are not a list of held records: the request is refused."""


def ask_order(candidates: Sequence[T], replicas: int, reader: bytes) -> List[T]:
    """``candidates`` (a key's nearest nodes, nearest first, the reader left out) in the order a reader
    asks them: the first ``replicas`` turned so that the one asked first is picked by ``reader`` (its node
    id), the spares after them as they were. The same nodes are asked; only who answers first, and so
    sends the records, changes (tests/protocol/test_newer_reads.py::test_readers_spread_their_first_asks_over_the_replicas)."""
    head, tail = list(candidates[:replicas]), list(candidates[replicas:])
    if not head:
        return tail
    turn = int.from_bytes(hashlib.blake2b(reader, digest_size=4).digest(), "big") % len(head)
    return head[turn:] + head[:turn] + tail


def subkey_digest(subkey_bytes: bytes) -> bytes:
    """The 8 bytes that name a subkey in a request (a collision only sends a record twice or once too
    few, and a writer's subkey is its own key: one it cannot choose to collide with another's)."""
    return hashlib.blake2b(subkey_bytes, digest_size=8).digest()


def pack_held(held: Iterable[Tuple[bytes, float]]) -> bytes:
    """The request's list of (subkey as serialized, expiration) the reader holds, at most ``MAX_HELD``
    of them (the rest are left out: the replica then sends those records again)."""
    out = bytearray()
    for count, (subkey_bytes, expiration) in enumerate(held):
        if count >= MAX_HELD:
            break
        out += ENTRY.pack(subkey_digest(subkey_bytes), float(expiration))
    return bytes(out)


def parse_held(data: bytes) -> Dict[bytes, float]:
    """digest -> expiration, from a request's list; HeldListError on anything else."""
    if len(data) % ENTRY_BYTES:
        raise HeldListError(f"a held list is whole {ENTRY_BYTES}-byte entries, got {len(data)} bytes")
    if len(data) > MAX_HELD * ENTRY_BYTES:
        raise HeldListError(f"a held list names at most {MAX_HELD} records, got {len(data) // ENTRY_BYTES}")
    held: Dict[bytes, float] = {}
    for digest, expiration in ENTRY.iter_unpack(data):
        if not math.isfinite(expiration):
            raise HeldListError("a held record's expiration is not a finite number")
        held[digest] = max(expiration, held.get(digest, -math.inf))
    return held


def newer(items: Iterable[Tuple[bytes, float]], held: Mapping[bytes, float]) -> Iterator[int]:
    """The positions of ``items`` ((subkey as serialized, expiration) of what the replica holds) that
    the reader lacks: a subkey it does not hold, or holds with an earlier expiration."""
    for i, (subkey_bytes, expiration) in enumerate(items):
        if expiration > held.get(subkey_digest(subkey_bytes), -math.inf):
            yield i
