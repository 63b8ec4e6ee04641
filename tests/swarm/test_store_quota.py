"""A DHT node's storage is bounded in bytes, shared among the peers that store into it
(swarm/dht/store_quota.py): a flood of valid records of honest size, from one peer or from many
identities, neither grows a node's memory past the bound nor pushes out an honest writer's records."""

from __future__ import annotations

import functools
import time

import hivemind
import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage
from hivemind.proto import dht_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time

import swarm.dht.store_quota as store_quota
from swarm.dht.node import start_dht
from swarm.dht.store_quota import LOCAL, RECORD_OVERHEAD, QuotaStorage

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def _as(writer: str, store, *args, **kwargs):
    token = store_quota._writer.set(writer)
    try:
        return store(*args, **kwargs)
    finally:
        store_quota._writer.reset(token)


def _key(i) -> DHTID:
    return DHTID.generate(source=f"key-{i}")


def test_one_writer_flooding_loses_its_own_oldest_records_and_nobody_elses():
    storage = QuotaStorage(max_bytes=20_000)
    later = get_dht_time() + 600
    for i in range(3):
        assert _as("honest", storage.store, _key(f"h{i}"), b"h" * 500, later)
    assert storage.store(_key("mine"), b"m" * 500, later)  # the node's own
    for i in range(500):
        _as("flood", storage.store, _key(f"f{i}"), b"f" * 1000, later)
    assert storage.total <= storage.max_bytes
    assert all(_key(f"h{i}") in storage for i in range(3)) and _key("mine") in storage
    assert _key("f499") in storage and _key("f0") not in storage  # the flood's newest stay, its oldest went
    assert storage.usage("honest") == 3 * (500 + RECORD_OVERHEAD) and storage.usage(LOCAL) == 500 + RECORD_OVERHEAD
    assert storage.evicted > 450


def test_many_identities_cannot_push_out_a_writer_that_holds_less_than_each_of_them():
    storage = QuotaStorage(max_bytes=50_000)
    later = get_dht_time() + 600
    assert _as("honest", storage.store_subkey, _key("run_peers"), b"honest-peer", b"p" * 300, later)
    for i in range(2_000):  # a new identity a record, each twice the honest writer's bytes
        _as(f"sybil-{i}", storage.store_subkey, _key("run_peers"), f"sybil-{i}".encode(), b"s" * 600, later)
    assert storage.total <= storage.max_bytes
    assert b"honest-peer" in storage.get(_key("run_peers")).value.data
    assert storage.records == len(storage.get(_key("run_peers")).value.data)


def test_accounting_follows_replacements_and_expiry():
    storage = QuotaStorage(max_bytes=1 << 20)
    now = get_dht_time()
    key = _key("k")
    assert _as("a", storage.store_subkey, key, b"one", b"x" * 100, now + 60)
    assert _as("a", storage.store_subkey, key, b"one", b"x" * 200, now + 61)  # a newer copy of the same record
    assert not _as("a", storage.store_subkey, key, b"one", b"x" * 900, now + 30)  # an older one: refused
    assert storage.usage("a") == 200 + 3 + RECORD_OVERHEAD
    assert _as("b", storage.store, key, b"plain", now + 120)  # a plain value replaces the whole dictionary
    assert storage.usage("a") == 0 and storage.usage("b") == 5 + RECORD_OVERHEAD and storage.records == 1
    assert not _as("c", storage.store_subkey, key, b"two", b"y" * 10, now + 0.3)  # refused: the plain value is newer
    assert storage.usage("c") == 0
    assert _as("c", storage.store, _key("short"), b"z" * 50, get_dht_time() + 0.2)
    time.sleep(0.3)
    assert storage.usage("c") == 0 and storage.records == 1 and storage.total == 5 + RECORD_OVERHEAD


def test_a_plain_store_with_an_older_expiration_no_longer_shortens_the_keys_life():
    """hivemind's storage refuses the older value but keeps its expiration as the key's: the key's
    whole dictionary (every peer's records under it) then vanished at that time."""
    for storage, survives in ((DHTLocalStorage(), False), (QuotaStorage(), True)):
        key = _key("group")
        assert storage.store_subkey(key, b"peer", b"record", get_dht_time() + 60)
        assert not storage.store(key, b"junk", get_dht_time() + 0.2)
        time.sleep(0.3)
        assert (storage.get(key) is not None) is survives


def test_the_heaps_stay_within_a_multiple_of_whats_live():
    storage = QuotaStorage(max_bytes=10_000)
    later = get_dht_time() + 600
    for i in range(5_000):
        _as(f"w{i % 7}", storage.store, _key(i % 50), b"v" * (i % 300 + 1), later + i)
    assert len(storage._expiring) <= 2 * (len(storage._usage) + storage.records) + 65
    assert len(storage._largest) <= 2 * (len(storage._usage) + storage.records) + 65
    assert storage.total == sum(storage._usage.values()) <= storage.max_bytes


async def _store_many(victim, count, size, _dht, node):
    """From the attacker's DHT process: ``count`` valid plain records of ``size`` bytes, stored at ``victim``."""
    stub = node.protocol.get_stub(victim)
    ok = 0
    for start in range(0, count, 50):
        n = min(50, count - start)
        request = dht_pb2.StoreRequest(
            keys=[DHTID.generate().to_bytes() for _ in range(n)], subkeys=[DHTProtocol.IS_REGULAR_VALUE] * n,
            values=[MSGPackSerializer.dumps(b"f" * size)] * n, expiration_time=[get_dht_time() + 600] * n,
            in_cache=[False] * n, peer=node.protocol.node_info)
        ok += sum((await stub.rpc_store(request, timeout=10)).store_ok)
    return ok


async def _storage_view(honest_key, _dht, node):
    storage = node.protocol.storage
    return type(storage).__name__, storage.total, storage.max_bytes, dict(storage._usage), \
        storage.get(DHTID.generate(source=honest_key)) is not None


@pytest.mark.slow
def test_a_real_node_flooded_with_valid_records_keeps_within_its_bound_and_its_honest_records(monkeypatch):
    monkeypatch.setattr(store_quota, "MAX_STORE_BYTES", 200_000)  # (read by the DHT process forked below)
    victim = start_dht((), LOOPBACK)
    honest = start_dht(victim.get_visible_maddrs(), LOOPBACK)
    attacker = hivemind.DHT(initial_peers=[str(m) for m in victim.get_visible_maddrs()], start=True)
    try:
        assert honest.store("honest_progress", b"h" * 2000, get_dht_time() + 600)
        stored = attacker.run_coroutine(functools.partial(_store_many, victim.peer_id, 400, 4000))
        assert stored * 4000 > 200_000  # valid records: the node takes them, as it must, past its bound
        kind, total, bound, usage, honest_kept = victim.run_coroutine(functools.partial(_storage_view, "honest_progress"))
        assert kind == "QuotaStorage" and bound == 200_000
        assert total <= bound, f"the node holds {total} bytes of records, over its bound of {bound}"
        assert honest_kept and usage.get(honest.peer_id.to_base58(), 0) > 2000
        assert 0 < usage.get(attacker.peer_id.to_base58(), 0) <= bound  # charged to the peer that sent them
    finally:
        attacker.shutdown()
        honest.shutdown()
        victim.shutdown()


def test_a_peer_storing_past_its_rate_is_refused_and_others_are_not():
    from swarm.dht.store_quota import StoreRate

    rate = StoreRate(rate=1000, burst=4000)
    assert rate.take("flood", 3000, now=0.0) and not rate.take("flood", 3000, now=0.5)  # 1,000 + 500 left
    assert rate.take("honest", 3000, now=0.5)  # a bucket each
    assert rate.take("flood", 3000, now=2.0)  # refilled at 1,000 a second
    assert rate.take("flood", 5000, now=100.0)  # a full bucket lends one request past the burst
    assert not rate.take("flood", 100, now=100.5)  # and is in debt after it (4,000 - 5,000 + 500)
    assert rate.refused == 2


async def _store_fast(victim, count, size, _dht, node):
    """From the attacker's DHT process: ``count`` records of ``size`` bytes as fast as it can; (accepted, refused)."""
    stub, ok, refused = node.protocol.get_stub(victim), 0, 0
    for _ in range(count // 10):
        request = dht_pb2.StoreRequest(
            keys=[DHTID.generate().to_bytes() for _ in range(10)], subkeys=[DHTProtocol.IS_REGULAR_VALUE] * 10,
            values=[MSGPackSerializer.dumps(b"f" * size)] * 10, expiration_time=[get_dht_time() + 600] * 10,
            in_cache=[False] * 10, peer=node.protocol.node_info)
        answer = (await stub.rpc_store(request, timeout=10)).store_ok
        ok, refused = ok + sum(answer), refused + len(answer) - sum(answer)
    return ok, refused


@pytest.mark.slow
def test_a_real_node_refuses_a_peers_stores_past_its_rate():
    victim = start_dht((), LOOPBACK)
    attacker = hivemind.DHT(initial_peers=[str(m) for m in victim.get_visible_maddrs()], start=True)
    try:
        t = time.monotonic()
        ok, refused = attacker.run_coroutine(functools.partial(_store_fast, victim.peer_id, 400, 16_000))
        elapsed = time.monotonic() - t
        # 6.4 MB offered at once: the burst (1 MiB) and the rate over the time it took pass, the rest is refused
        allowed = (store_quota.STORE_BURST + store_quota.STORE_RATE * elapsed) / 16_000
        assert refused > 0 and ok <= allowed + 10, (ok, refused, elapsed)
        assert victim.store("mine", b"x", get_dht_time() + 60)  # the node's own stores are not rated
    finally:
        attacker.shutdown()
        victim.shutdown()


def test_a_refused_older_copy_of_a_subkey_leaves_its_life_and_charge_alone():
    """hivemind's dictionary refused the older copy but made its expiration the subkey's: a replay of
    a peer's older signed record made its current one vanish then (a review found it)."""
    storage = QuotaStorage()
    key = _key("peers")
    assert _as("w", storage.store_subkey, key, b"peer", b"new", get_dht_time() + 60)
    assert not _as("w", storage.store_subkey, key, b"peer", b"old", get_dht_time() + 0.2)
    time.sleep(0.3)
    assert storage.get(key).value.get(b"peer").value == b"new" and storage.records == 1


def test_refreshing_one_record_many_times_keeps_hiveminds_heaps_small():
    storage = QuotaStorage()
    now = get_dht_time()
    for i in range(5_000):
        _as("w", storage.store, _key("plain"), b"x", now + 600 + i * 1e-3)
        _as("w", storage.store_subkey, _key("dict"), b"sub", b"y", now + 600 + i * 1e-3)
    assert len(storage.expiration_heap) <= 2 * len(storage.key_to_heap) + 64
    inner = storage.get(_key("dict")).value
    assert len(inner.expiration_heap) <= 2 * len(inner.key_to_heap) + 64
    assert storage.records == 2


def test_a_whole_dictionary_our_cache_keeps_is_charged_by_its_records_and_evicted_whole():
    from hivemind.dht.storage import DictionaryDHTValue

    found = DictionaryDHTValue()
    for i in range(100):
        found.store(f"s{i}".encode(), b"v" * 1000, get_dht_time() + 600)
    cache = QuotaStorage(max_bytes=10 ** 6)
    assert cache.store(_key("found"), found, get_dht_time() + 600)  # hivemind's node caches a find so
    assert cache.usage(LOCAL) >= 100 * (1000 + RECORD_OVERHEAD)
    assert cache.store_subkey(_key("found"), b"extra", b"e", get_dht_time() + 600)
    for i in range(300):  # a peer's flood pushes the node's own cache out only once nothing else is left
        _as("flood", cache.store, _key(f"f{i}"), b"f" * 4000, get_dht_time() + 600)
    assert cache.total <= cache.max_bytes and cache.usage(LOCAL) > 0
