"""swarm/dht/group_keys.py: hivemind's matchmaking keys declared by lean stores and polled by replica
reads; real hivemind DHT nodes on loopback."""

from __future__ import annotations

import asyncio
import time

import pytest
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.utils import get_dht_time

from swarm.dht import group_keys
from swarm.dht import replica_reads
from tests.support.dht_nodes import loopback_nodes

KEY = "gk-test_avg.0b0101"


@pytest.fixture(scope="module")
def nodes():
    yield from loopback_nodes(None, others=2)


def run(coro):
    return asyncio.run(coro)


def test_a_declaration_is_seen_by_every_peer_and_leaving_hides_it_from_active_polls(nodes):
    a, b, c = nodes
    lean = [group_keys.LeanGroupKeyManager(n, "gk-test_avg", "0101", 4) for n in nodes]
    expires = get_dht_time() + 30
    assert run(lean[0].declare_averager(KEY, a.peer_id, expires))
    for m in lean:
        assert (a.peer_id, expires) in run(m.get_averagers(KEY, only_active=True))
    # hivemind's own manager reads what the lean one declared, over the network
    assert a.peer_id in [p for p, _ in run(GroupKeyManager(c, "gk-test_avg", "0101", 4).get_averagers(KEY, True))]
    assert run(lean[0].declare_averager(KEY, a.peer_id, expires, looking_for_group=False))
    for m in lean:
        assert a.peer_id not in [p for p, _ in run(m.get_averagers(KEY, only_active=True))]
        assert a.peer_id in [p for p, _ in run(m.get_averagers(KEY, only_active=False))]


def test_polls_between_network_reads_come_from_storage_and_are_spaced(nodes, monkeypatch):
    _, b, c = nodes
    key = "gk-test_avg.0b0110"
    manager = group_keys.LeanGroupKeyManager(b, "gk-test_avg", "0110", 4)
    memo = (b.peer_id.to_base58(), key)
    assert run(group_keys.LeanGroupKeyManager(c, "gk-test_avg", "0110", 4).declare_averager(
        key, c.peer_id, get_dht_time() + 30))
    replica_reads._confirmed.pop(memo, None)
    began = time.monotonic()
    assert [p for p, _ in run(manager.get_averagers(key, True))] == [c.peer_id]  # over the network: b is a replica
    networked_at = replica_reads._confirmed[memo][0]
    assert networked_at >= began
    for _ in range(3):
        assert [p for p, _ in run(manager.get_averagers(key, True))] == [c.peer_id]
    assert replica_reads._confirmed[memo][0] == networked_at  # from b's storage
    assert time.monotonic() - began >= 3 * group_keys.MIN_POLL_S  # and never closer than MIN_POLL_S apart


def test_a_subkey_no_peer_id_can_be_made_of_is_skipped(nodes):
    a, _, _ = nodes
    key = "gk-test_avg.0b0111"
    assert a.store(key, True, get_dht_time() + 30, subkey=12345)  # any node may write anything here
    assert a.store(key, True, get_dht_time() + 30, subkey=a.peer_id.to_bytes())
    got = run(group_keys.LeanGroupKeyManager(a, "gk-test_avg", "0111", 4).get_averagers(key, True))
    assert [p for p, _ in got] == [a.peer_id]


def test_leaving_after_the_declaration_expired_stores_nothing(nodes, monkeypatch):
    # every node refuses an expired record: hivemind re-declares a search that ended at its deadline anyway
    a = nodes[0]
    lean = group_keys.LeanGroupKeyManager(a, "gk-test_avg", "0101", 4)
    calls = []
    monkeypatch.setattr(group_keys, "lean_store", lambda *args: calls.append(args))
    assert not run(lean.declare_averager(KEY + "1", a.peer_id, get_dht_time() - 1.0, looking_for_group=False))
    assert calls == []


def test_in_a_swarm_larger_than_the_beam_every_poll_finds_every_declaration():
    # polls and declarations search NEAREST_BEAM nodes (swarm/dht/replica_reads.py), not hivemind's bucket of 20: with more nodes
    # than that, the key's nearest nodes (where every declaration goes) must still be the ones read
    key = "gk-wide_avg.0b1"
    gen = loopback_nodes(None, others=2 * replica_reads.NEAREST_BEAM)
    nodes = next(gen)
    try:
        lean = [group_keys.LeanGroupKeyManager(n, "gk-wide_avg", "1", 4) for n in nodes]
        expires = get_dht_time() + 60
        for m, n in zip(lean, nodes):
            assert run(m.declare_averager(key, n.peer_id, expires))
        everyone = {n.peer_id for n in nodes}
        for m, n in zip(lean, nodes):
            replica_reads._confirmed.pop((n.peer_id.to_base58(), key), None)  # a network read, not storage
            assert {p for p, _ in run(m.get_averagers(key, only_active=True))} == everyone
    finally:
        gen.close()
