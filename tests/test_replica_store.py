"""swarm/replica_store.py: a progress record goes straight to the key's remembered nearest nodes,
searched for once, not at every write; real hivemind nodes on loopback."""

from __future__ import annotations

from functools import partial

import pytest
from hivemind.dht.routing import DHTID

from protocol.keys import peers_key
from protocol.records import Progress
from protocol.spec import RunSpec
from swarm import records, replica_store
from tests.loopback_dht import join, loopback_swarm, progress as loopback_progress

SPEC = RunSpec().replace(run_id="replica-store-test")
KEY = peers_key(SPEC.run_id)


def progress(rnd: int) -> Progress:
    return loopback_progress(SPEC, rnd)


async def _held(_dht, node) -> dict:
    """In a DHT's process: subkey -> expiration of what its own storage holds under the progress key."""
    stored = node.protocol.storage.get(DHTID.generate(source=KEY))
    return {} if stored is None else {sk: item.expiration_time for sk, item in stored.value.items()}


async def _searched_at(_dht, node):
    """In a DHT's process: when its last search for the key's nearest nodes ran (None: none remembered),
    and how many nodes it found."""
    found = replica_store._replicas.get((node.node_id.to_bytes(), DHTID.generate(source=KEY).to_bytes()))
    return None if found is None else (found[0], len(found[1]))


def held(dht) -> dict:
    return dht.run_coroutine(_held)


def searched(dht):
    return dht.run_coroutine(_searched_at)


def publish(dht, rnd: int) -> bool:
    return records.publish_progress(dht, SPEC.run_id, dht.peer_id.to_base58(), progress(rnd), ttl=30).result(timeout=10)


@pytest.fixture(scope="module")
def nodes():
    with loopback_swarm(SPEC) as started:
        yield started


def test_every_write_reaches_every_replica_and_only_the_first_searches(nodes):
    coord, a, b = nodes
    assert publish(a, 1)
    first = searched(a)
    assert first is not None and first[1] == 3  # 3 nodes, 5 replicas: all of them, a itself included
    latest = 0.0
    for rnd in (2, 3, 4):
        assert publish(a, rnd)
        stores = [held(n) for n in nodes]
        assert len({tuple(sorted(s.items())) for s in stores}) == 1  # every node holds the same records, same versions
        assert max(stores[0].values()) > latest  # ... this write's among them
        latest = max(stores[0].values())
        assert searched(a) == first  # straight to the remembered nodes: no new search
    assert {v.peer_id: v.progress.round for v in records.read_progress(b, SPEC.run_id)}[a.peer_id.to_base58()] == 4
    assert {v.peer_id: v.progress.round for v in records.read_progress(coord, SPEC.run_id)}[a.peer_id.to_base58()] == 4


def test_a_small_swarm_searches_again_soon_and_finds_a_node_that_joined(nodes, monkeypatch):
    coord, a, b = nodes
    assert publish(b, 1)
    joined = join(coord, SPEC)
    try:
        # fewer than num_replicas found: b searches again once _SMALL_FRESH_S has passed (0 here)
        assert dht_set(b, "_SMALL_FRESH_S", 0.0)
        assert publish(b, 2)
        assert searched(b)[1] == 4
        assert any(sk for sk in held(joined))  # the joiner holds b's record now
    finally:
        dht_set(b, "_SMALL_FRESH_S", replica_store._SMALL_FRESH_S)
        joined.shutdown()


def test_a_replica_that_left_is_forgotten_and_the_rest_still_get_every_write(nodes):
    coord, a, b = nodes
    gone = join(coord, SPEC)
    dht_set(a, "_SMALL_FRESH_S", 0.0)
    try:
        for _ in range(3):  # the node the test above started and stopped may still be in the routing
            assert publish(a, 5)  # tables: the store to it fails, and a forgets it
            if searched(a)[1] == 4:
                break
        assert searched(a)[1] == 4  # the new node is one of a's replicas
        dht_set(a, "_SMALL_FRESH_S", 3600.0)
        at = searched(a)[0]
    finally:
        gone.shutdown()
    assert publish(a, 6)  # stored on the others; the one that left did not answer ...
    assert searched(a) == (at, 3)  # ... and is forgotten, without a new search
    assert publish(a, 7)
    assert searched(a) == (at, 3)
    for reader in (coord, b):
        assert {v.peer_id: v.progress.round for v in records.read_progress(reader, SPEC.run_id)}[a.peer_id.to_base58()] == 7
    dht_set(a, "_SMALL_FRESH_S", replica_store._SMALL_FRESH_S)


async def _set(name: str, value: float, _dht, node) -> bool:
    setattr(replica_store, name, value)
    return True


def dht_set(dht, name: str, value: float) -> bool:
    """Set a module constant of swarm/replica_store.py inside ``dht``'s process."""
    return dht.run_coroutine(partial(_set, name, value))
