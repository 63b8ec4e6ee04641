"""swarm/dht/lean_store.py: a store that searches toward the key's shadow reaches the key's nearest nodes,
and every receiver still checks the record's signature; real hivemind nodes on loopback."""

from __future__ import annotations

import random
from functools import partial

import pytest
from hivemind.dht.routing import DHTID
from hivemind.utils import get_dht_time

from protocol.dht.keys import owned_subkey, peers_key
from protocol.dht.records import Progress, encode_body, seal
from protocol.spec import RunSpec
from swarm import records
from swarm.dht.node import start_dht
from swarm.access.identity import trust_of
from swarm.dht.lean_store import shadow_of, store_lean
from tests.support.dht_nodes import LOOPBACK, loopback_nodes

SPEC = RunSpec().replace(run_id="lean-store-test")


def test_the_shadow_has_the_same_nearest_nodes_as_the_key():
    rng = random.Random(0)
    for _ in range(200):
        key = DHTID.generate(source=f"key-{rng.random()}")
        nodes = [DHTID.generate() for _ in range(rng.randint(1, 64))]
        assert shadow_of(key) != key
        assert sorted(nodes, key=key.xor_distance) == sorted(nodes, key=shadow_of(key).xor_distance)


async def _look(key: str, _dht, node) -> dict:
    item = node.protocol.storage.get(DHTID.generate(source=key))
    return {} if item is None else {s: v.value for s, v in item.value.items()}


async def _drop(key: str, subkey, _dht, node) -> None:
    del node.protocol.storage.get(DHTID.generate(source=key)).value[subkey]


def held(dht, key: str) -> dict:
    """The subkeys of ``key`` in this node's own storage (not its cache)."""
    return dht.run_coroutine(partial(_look, key))


@pytest.fixture(scope="module")
def nodes():
    yield from loopback_nodes(SPEC, others=3)


def test_a_progress_write_lands_in_every_replicas_storage_and_reads_back(nodes):
    writer = nodes[1]
    me = writer.peer_id.to_base58()
    progress = Progress(3, 0, "training", SPEC.digest(), 1.0, 0.5, 0, 0.0, 0, 0, "hash", -1)
    assert records.publish_progress(writer, SPEC.run_id, me, progress, ttl=30).result(timeout=10)
    subkey = owned_subkey(trust_of(writer).identity.public_key)
    for node in nodes:  # 4 nodes, 5 replicas: every node is one
        assert subkey in held(node, peers_key(SPEC.run_id))
    for reader in nodes:
        seen = {v.peer_id: v.progress.round for v in records.read_progress(reader, SPEC.run_id)}
        assert seen[me] == 3


def test_receivers_refuse_a_record_under_another_nodes_subkey(nodes):
    victim, forger = nodes[1], nodes[2]
    key = peers_key(SPEC.run_id)
    subkey = owned_subkey(trust_of(victim).identity.public_key, "forged")
    value = seal(victim.peer_id.to_base58(), encode_body({"round": 99}), b"")
    # the forger's validator cannot sign for the victim's key: nobody keeps it, the forger included
    assert store_lean(forger, key, subkey, value, get_dht_time() + 30, wait=True) is False
    for node in nodes:
        assert subkey not in held(node, key)


def test_a_client_mode_node_stores_on_others_not_itself(nodes):
    client = start_dht(nodes[0].get_visible_maddrs(), LOOPBACK, client_mode=True, run_ids=[SPEC.run_id])
    try:
        key = peers_key(SPEC.run_id)
        me = client.peer_id.to_base58()
        progress = Progress(5, 0, "training", SPEC.digest(), 1.0, 0.5, 0, 0.0, 0, 0, "hash", -1)
        assert records.publish_progress(client, SPEC.run_id, me, progress, ttl=30).result(timeout=10)
        subkey = owned_subkey(trust_of(client).identity.public_key)
        assert subkey not in held(client, key)
        assert all(subkey in held(node, key) for node in nodes)
    finally:
        client.shutdown()


def test_a_node_alone_keeps_its_own_record():
    alone = start_dht((), LOOPBACK, run_ids=[SPEC.run_id])
    try:
        me = alone.peer_id.to_base58()
        progress = Progress(1, 0, "training", SPEC.digest(), 1.0, 0.5, 0, 0.0, 0, 0, "hash", -1)
        assert records.publish_progress(alone, SPEC.run_id, me, progress, ttl=30).result(timeout=10)
        assert [v.peer_id for v in records.read_progress(alone, SPEC.run_id)] == [me]
    finally:
        alone.shutdown()


class _Node:
    """Just enough of a DHTNode to count searches: two other nodes, one of which may refuse stores."""

    def __init__(self, refuse: bool = False):
        from hivemind.p2p import PeerID
        from hivemind.utils.serializer import MSGPackSerializer

        self.node_id, self.peer_id, self.num_replicas = DHTID.generate(), PeerID(b"self"), 5
        self.others = [PeerID(b"a"), PeerID(b"b")]
        self.searches, self.refuse = 0, refuse
        self.routing_table = type("RoutingTable", (), {"uid_to_peer_id": {}})()
        self.protocol = self  # the fields lean_store reads from node.protocol live here too
        self.client_mode, self.record_validator, self.serializer = True, None, MSGPackSerializer

    async def find_nearest_nodes(self, queries, k_nearest, exclude_self, **kw):
        self.searches += 1
        return {q: {DHTID.generate(): p for p in self.others} for q in queries}

    async def call_store(self, peer_id, keys, values, expiration_time, subkeys):
        return None if self.refuse and peer_id == self.others[0] else [True]


def test_a_busy_key_is_searched_once_a_while_and_again_after_a_refused_store():
    import asyncio

    from swarm.dht import lean_store as ls

    ls._nearest_cache.clear()
    node = _Node()
    for _ in range(5):
        assert asyncio.run(ls.lean_store("busy-key", None, b"v", get_dht_time() + 30, None, None, node))
    assert node.searches == 1
    refusing = _Node(refuse=True)
    for _ in range(3):
        assert asyncio.run(ls.lean_store("busy-key", None, b"v", get_dht_time() + 30, None, None, refusing))
    assert refusing.searches == 3  # each refused store drops what the node remembered


def test_a_node_joining_the_routing_table_drops_the_remembered_nearest_nodes():
    import asyncio

    from swarm.dht import lean_store as ls

    ls._nearest_cache.clear()
    node = _Node()
    asyncio.run(ls.lean_store("busy-key", None, b"v", get_dht_time() + 30, None, None, node))
    node.routing_table.uid_to_peer_id[DHTID.generate()] = "newcomer"
    asyncio.run(ls.lean_store("busy-key", None, b"v", get_dht_time() + 30, None, None, node))
    asyncio.run(ls.lean_store("busy-key", None, b"v", get_dht_time() + 30, None, None, node))
    assert node.searches == 2  # the newcomer may be nearer than the nodes remembered

