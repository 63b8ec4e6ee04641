"""A DHT node's record storage, bounded in bytes and shared fairly among the peers that store into it.

hivemind keeps every valid record another peer stores at a node (``rpc_store``) until its
expiration, with no bound on their number: a peer with the bandwidth could fill a node's memory with
records of honest size within their six hours (docs/trust.md, "A flood of DHT records"). A plain cap
would evict the records that expire soonest, the honest ones. ``QuotaStorage`` instead charges each
record to the peer that sent it (the libp2p peer of the ``rpc_store`` call; the node's own records to
nobody) and, past ``max_bytes``, drops the oldest records of the peer that holds the most bytes.
An honest writer keeps its few records unless the flood's identities each hold as many bytes as it
does: that takes ``max_bytes`` over an honest writer's share of them, thousands of connections.

``StoreRate`` bounds how fast each peer may store at a node (256 KiB a second), refusing the rest
before its records are decoded or checked (the request is still received and parsed): a flood within
the bound still cost every node its decoding and checks.

It also refuses, without side effects, a store (of a key or a subkey) that hivemind would reject for
an older expiration: hivemind's ``TimedStorage`` rejects it but keeps the older expiration as the
entry's, so anyone could make a key's whole dictionary vanish early by storing a plain value there,
or a peer's record by replaying its older copy; and it rebuilds hivemind's expiry heaps, which kept
a stale entry for every refresh until its expiration.

``install_store_quota`` applies all of it to every DHT node started in this process afterwards (a
node's process is forked from it). Guarded by tests/swarm/test_store_quota.py and measured by
bench/store_quota.py and ``bench/hostile.py --attacks record-flood``.
"""

from __future__ import annotations

import contextvars
import functools
import heapq
import itertools
import time
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import hivemind.dht.protocol as dht_protocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.proto import dht_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.timed_storage import TimedStorage

__all__ = ["QuotaStorage", "StoreRate", "install_store_quota", "MAX_STORE_BYTES", "LOCAL"]

MAX_STORE_BYTES = 64 << 20  # per storage (a node has two: records, and its cache); honest swarms use well under 1 %
# bytes charged for a record beyond its value and subkey: what a tiny record takes in hivemind's dicts,
# heap and DHTID and in this ledger (about 900 B measured)
RECORD_OVERHEAD = 1024
STORE_RATE = 256 << 10  # bytes a second one peer may store at a node (an honest peer: a few KB a round)
STORE_BURST = 1 << 20  # and at once (a run spec is at most 64 KB)
LOCAL = ""  # the writer of the node's own records: dropped only when nothing else is left to drop

_writer: contextvars.ContextVar[str] = contextvars.ContextVar("voloco_dht_writer", default=LOCAL)

Slot = Tuple[DHTID, Optional[bytes]]  # (key, subkey or None for a plain value)


class QuotaStorage(DHTLocalStorage):
    """hivemind's ``DHTLocalStorage``, holding at most ``max_bytes`` of records (value, subkey and
    ``RECORD_OVERHEAD`` each) charged to their writers; past that, the oldest records of the writer
    holding most go first (the node's own last)."""

    def __init__(self, maxsize: Optional[int] = None, max_bytes: Optional[int] = None):
        super().__init__(maxsize)
        self.max_bytes = MAX_STORE_BYTES if max_bytes is None else max_bytes
        self.total = 0
        self.evicted = 0
        self.records = 0  # records charged now
        self._slots: Dict[DHTID, Dict[Optional[bytes], Tuple[str, int, float]]] = {}  # key -> subkey -> (writer, bytes, expiry)
        self._by_writer: Dict[str, "OrderedDict[Slot, None]"] = {}
        self._usage: Dict[str, int] = {}
        self._largest: List[Tuple[int, str]] = []  # max-heap of (-usage, writer), stale entries skipped
        self._expiring: List[Tuple[float, int, DHTID, Optional[bytes]]] = []  # min-heap, stale entries skipped
        self._order = itertools.count()  # breaks ties in the expiry heap (keys do not compare)

    # ---- hivemind's interface ---------------------------------------------------------------------
    def store(self, key: DHTID, value, expiration_time: float, subkey=None) -> bool:
        if subkey is not None:
            return self.store_subkey(key, subkey, value, expiration_time)
        held = self.data.get(key)
        if held is not None and held.expiration_time >= expiration_time:
            return False  # (hivemind would reject it too, but keep its expiration as the key's)
        if not TimedStorage.store(self, key, value, expiration_time):
            return False
        _compact_timed(self)
        self._forget_key(key)  # a plain value replaces whatever the key held, a dictionary included
        self._charge(key, None, _value_bytes(value), expiration_time)
        return key in self.data

    def store_subkey(self, key: DHTID, subkey, value, expiration_time: float) -> bool:
        held = self.data.get(key)
        replaces_plain = held is not None and not isinstance(held.value, DictionaryDHTValue)
        if not replaces_plain and held is not None:
            entry = held.value.data.get(subkey)
            if entry is not None and entry.expiration_time >= expiration_time:
                return False  # (refused by hivemind too, after it made the older expiration the subkey's)
        if not super().store_subkey(key, subkey, value, expiration_time):
            return False
        stored = self.data.get(key)
        _compact_timed(self)
        if stored is not None and isinstance(stored.value, DictionaryDHTValue):
            _compact_timed(stored.value)
        if replaces_plain:
            self._forget_key(key)
        self._charge(key, subkey, len(value) + _subkey_bytes(subkey), expiration_time)
        stored = self.data.get(key)
        return stored is not None and isinstance(stored.value, DictionaryDHTValue) and subkey in stored.value.data

    # ---- accounting -------------------------------------------------------------------------------
    def usage(self, writer: str) -> int:
        """Bytes charged to ``writer`` now (expired records excluded)."""
        self._expire()
        return self._usage.get(writer, 0)

    def _charge(self, key: DHTID, subkey, size: int, expiration_time: float) -> None:
        self._expire()
        self._uncharge(key, subkey)
        writer, size = _writer.get(), size + RECORD_OVERHEAD
        self._slots.setdefault(key, {})[subkey] = (writer, size, expiration_time)
        self.records += 1
        self._by_writer.setdefault(writer, OrderedDict())[(key, subkey)] = None
        self._add_usage(writer, size)
        self._push(self._expiring, (expiration_time, next(self._order), key, subkey))
        while self.total > self.max_bytes and self._evict_one():
            pass

    def _uncharge(self, key: DHTID, subkey) -> None:
        held = self._slots.get(key, {}).pop(subkey, None)
        if held is None:
            return
        writer, size, _ = held
        self.records -= 1
        if not self._slots[key]:
            del self._slots[key]
        slots = self._by_writer[writer]
        slots.pop((key, subkey), None)
        if not slots:
            del self._by_writer[writer]
        self._add_usage(writer, -size)

    def _add_usage(self, writer: str, delta: int) -> None:
        self.total += delta
        usage = self._usage.get(writer, 0) + delta
        if usage > 0:
            self._usage[writer] = usage
            if writer != LOCAL:
                self._push(self._largest, (-usage, writer))
        else:
            self._usage.pop(writer, None)

    def _forget_key(self, key: DHTID) -> None:
        for subkey in list(self._slots.get(key, ())):
            self._uncharge(key, subkey)

    def _expire(self) -> None:
        now = get_dht_time()
        while self._expiring and self._expiring[0][0] < now:
            expiration_time, _, key, subkey = heapq.heappop(self._expiring)
            held = self._slots.get(key, {}).get(subkey)
            if held is not None and held[2] == expiration_time:
                self._uncharge(key, subkey)

    def _evict_one(self) -> bool:
        """Drop the oldest record of the writer holding most (the node's own only if none else holds any)."""
        writer = self._largest_writer()
        if writer is None:
            return False
        key, subkey = next(iter(self._by_writer[writer]))
        self._uncharge(key, subkey)
        held = self.data.get(key)
        if subkey is None or held is None or not isinstance(held.value, DictionaryDHTValue):
            self._forget_key(key)  # (a dictionary our own cache took whole may have gained subkeys since)
            if key in self.data:
                TimedStorage.__delitem__(self, key)
        else:
            held.value.__delitem__(subkey)
            if not held.value.data:
                TimedStorage.__delitem__(self, key)
        self.evicted += 1
        return True

    def _largest_writer(self) -> Optional[str]:
        while self._largest:
            negative, writer = self._largest[0]
            if self._usage.get(writer) == -negative:
                return writer
            heapq.heappop(self._largest)
        return LOCAL if self._usage.get(LOCAL) else None

    def _push(self, heap: list, entry) -> None:
        heapq.heappush(heap, entry)
        if len(heap) > 2 * (len(self._usage) + self.records) + 64:
            self._compact()

    def _compact(self) -> None:
        """Rebuild both heaps from what is live, so stale entries never outnumber the live ones."""
        self._largest = [(-u, w) for w, u in self._usage.items() if w != LOCAL]
        heapq.heapify(self._largest)
        self._expiring = [(e, next(self._order), k, s) for k, subs in self._slots.items() for s, (_, _, e) in subs.items()]
        heapq.heapify(self._expiring)


def _value_bytes(value) -> int:
    """A plain value's bytes; a whole dictionary (our own cache keeps what a find returned so) counted
    record by record."""
    if isinstance(value, DictionaryDHTValue):
        return sum(len(v.value) + _subkey_bytes(k) + RECORD_OVERHEAD for k, v in value.data.items())
    return len(value)


def _compact_timed(storage: TimedStorage) -> None:
    """Rebuild hivemind's expiry heap once stale entries outnumber live ones: each refresh of a record
    pushes a new entry and leaves the old one until its expiration (hours), so a peer refreshing one
    tiny record thousands of times a second grew it without bound."""
    if len(storage.expiration_heap) > 2 * len(storage.key_to_heap) + 64:
        storage.expiration_heap = list(storage.key_to_heap.values())
        heapq.heapify(storage.expiration_heap)


def _subkey_bytes(subkey) -> int:
    return len(subkey) if isinstance(subkey, (bytes, str)) else 16


class StoreRate:
    """Bytes each peer may store at this node: ``rate`` a second, ``burst`` at once (a token bucket
    each, for the ``MAX_TRACKED`` peers seen last; a full bucket lets one larger request through and
    is in debt after it). An honest peer stores a few KB a round; a flood beyond the rate is refused
    before anything decodes or validates it. Records are counted as ``QuotaStorage`` charges them."""

    MAX_TRACKED = 4096

    def __init__(self, rate: float = STORE_RATE, burst: float = STORE_BURST):
        self.rate, self.burst = rate, burst
        self._buckets: "OrderedDict[str, Tuple[float, float]]" = OrderedDict()  # peer -> (tokens, when)
        self.refused = 0

    def take(self, peer: str, size: int, now: float) -> bool:
        tokens, when = self._buckets.pop(peer, (self.burst, now))
        tokens = min(self.burst, tokens + (now - when) * self.rate)
        ok = size <= tokens or tokens >= self.burst  # a full bucket lends one larger request (a routing
        self._buckets[peer] = (tokens - size if ok else tokens, now)  # table's replication), repaid at the rate
        if len(self._buckets) > self.MAX_TRACKED:
            self._buckets.popitem(last=False)
        self.refused += not ok
        return ok


_original_rpc_store = dht_protocol.DHTProtocol.rpc_store


@functools.wraps(_original_rpc_store)  # (hivemind registers handlers by their annotations)
async def _attributed_rpc_store(self, request, context):
    """hivemind's ``rpc_store``, with every record it stores charged to the calling peer, and a
    request past the peer's ``StoreRate`` refused whole."""
    peer = context.remote_id.to_base58()
    rate = self.__dict__.setdefault("store_rate", StoreRate())
    size = sum(map(len, request.values)) + sum(map(len, request.subkeys)) + RECORD_OVERHEAD * len(request.keys)
    if not rate.take(peer, size, time.monotonic()):
        return dht_pb2.StoreResponse(store_ok=[False] * len(request.keys), peer=self.node_info)
    token = _writer.set(peer)
    try:
        return await _original_rpc_store(self, request, context)
    finally:
        _writer.reset(token)


def install_store_quota() -> None:
    """Every DHTProtocol made in this process from now on (and a DHT process forked from it) keeps
    its records and cache in ``QuotaStorage`` and charges what peers store to them."""
    dht_protocol.DHTLocalStorage = QuotaStorage
    dht_protocol.DHTProtocol.rpc_store = _attributed_rpc_store
