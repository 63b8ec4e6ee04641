"""swarm/dht/replica_reads.py: a DHT node that holds the progress key in its own storage (a replica) reads it
there between network reads; real hivemind nodes on loopback."""

from __future__ import annotations

import time

import pytest

from protocol.dht.keys import peers_key
from protocol.dht.records import Progress
from protocol.spec import RunSpec
from swarm import records
from swarm.dht import replica_reads
from swarm.dht.node import start_dht
from tests.support.dht_nodes import LOOPBACK, loopback_nodes

SPEC = RunSpec().replace(run_id="replica-test")


def progress(rnd: int) -> Progress:
    return Progress(rnd, 0, "training", SPEC.digest(), 1.0, 0.5, 0, 0.0, 0, 0, "hash", -1)


@pytest.fixture(scope="module")
def nodes():
    for started in loopback_nodes(SPEC, others=2):
        for n in started:
            records.fetch_spec(n, SPEC.run_id)  # as a peer does first: the spec's TTL is the records'
        yield started


def memo_of(node, key: str = peers_key(SPEC.run_id)) -> tuple:
    """What swarm/dht/replica_reads.py remembers ``node``'s replica reads of ``key`` by."""
    return node.peer_id.to_base58(), key


def rounds(dht) -> dict:
    return {v.peer_id: v.progress.round for v in records.read_progress(dht, SPEC.run_id)}


def test_a_replica_sees_every_store_at_once_without_a_network_read(nodes):
    _, a, b = nodes
    me = a.peer_id.to_base58()
    memo = memo_of(b)
    assert records.publish_progress(a, SPEC.run_id, me, progress(1), ttl=30).result(timeout=10)
    assert rounds(b)[me] == 1  # the first read goes over the network
    networked_at = replica_reads._confirmed[memo][0]
    for rnd in (2, 3):
        assert records.publish_progress(a, SPEC.run_id, me, progress(rnd), ttl=30).result(timeout=10)
        assert rounds(b)[me] == rnd  # b is a replica (3 nodes, 5 replicas): the store reached its storage
    assert replica_reads._confirmed[memo][0] == networked_at  # ... and it read it there


def test_reads_go_over_the_network_again_after_the_interval(nodes, monkeypatch):
    coord, a, _ = nodes
    me = a.peer_id.to_base58()
    memo = memo_of(coord)
    assert records.publish_progress(a, SPEC.run_id, me, progress(7), ttl=30).result(timeout=10)
    monkeypatch.setattr(replica_reads, "REPLICA_NETWORK_READ_S", 0.0)
    monkeypatch.setattr(replica_reads, "REPLICA_TRUST_S", 0.0)
    before = time.monotonic()
    assert rounds(coord)[me] == 7
    assert replica_reads._confirmed[memo][0] >= before


def test_a_client_mode_node_is_no_replica_and_sees_every_update(nodes):
    coord, a, _ = nodes
    client = start_dht(coord.get_visible_maddrs(), LOOPBACK, client_mode=True, run_ids=[SPEC.run_id])
    try:
        me, mine = a.peer_id.to_base58(), client.peer_id.to_base58()
        # a client's own store may land in its own storage (it counts itself among the nearest), but no
        # other node's store reaches it: its storage must not pass for a replica's
        assert records.publish_progress(client, SPEC.run_id, mine, progress(1), ttl=30).result(timeout=10)
        for rnd in (11, 12):
            assert records.publish_progress(a, SPEC.run_id, me, progress(rnd), ttl=30).result(timeout=10)
            assert rounds(client)[me] == rnd
        assert memo_of(client) not in replica_reads._confirmed
    finally:
        client.shutdown()


def test_a_replica_whose_records_are_fresh_keeps_reading_its_storage_past_the_interval(nodes, monkeypatch):
    _, a, b = nodes
    me = a.peer_id.to_base58()
    memo = memo_of(b)
    assert records.publish_progress(a, SPEC.run_id, me, progress(20), ttl=30).result(timeout=10)
    monkeypatch.setattr(replica_reads, "REPLICA_NETWORK_READ_S", 0.0)
    replica_reads._confirmed.pop(memo, None)
    assert rounds(b)[me] == 20  # a network read: it finds b a replica
    networked_at = replica_reads._confirmed[memo][0]
    assert records.publish_progress(a, SPEC.run_id, me, progress(21), ttl=30).result(timeout=10)
    assert rounds(b)[me] == 21  # every record b holds expires far ahead: read from its storage
    assert replica_reads._confirmed[memo][0] == networked_at
    monkeypatch.setattr(replica_reads, "REPLICA_TRUST_S", 0.0)  # past the longest trust: the network again
    assert rounds(b)[me] == 21
    assert replica_reads._confirmed[memo][0] > networked_at


def test_a_record_near_its_expiry_sends_the_next_read_to_the_network(nodes, monkeypatch):
    coord, a, b = nodes
    me, late = a.peer_id.to_base58(), coord.peer_id.to_base58()
    memo = memo_of(b)
    monkeypatch.setattr(replica_reads, "REPLICA_NETWORK_READ_S", 0.0)
    assert records.publish_progress(a, SPEC.run_id, me, progress(30), ttl=30).result(timeout=10)
    # a writer whose keep-alives stopped: its record expires within a third of the readers' TTL (10 s)
    assert records.publish_progress(coord, SPEC.run_id, late, progress(30), ttl=2).result(timeout=10)
    replica_reads._confirmed.pop(memo, None)
    rounds(b)
    networked_at = replica_reads._confirmed[memo][0]
    rounds(b)
    assert replica_reads._confirmed[memo][0] > networked_at  # not trusted past the interval: read over the network


def test_an_empty_key_read_on_a_replica_stays_off_the_network_and_sees_the_first_store(nodes, monkeypatch):
    coord, a, b = nodes
    key = "replica-test_nothing_here"
    memo = memo_of(b, key)
    assert records._read(b, key, 10.0, replica_ok=True) == []
    networked_at = replica_reads._confirmed[memo][0]  # empty there and here: a replica of an empty key
    monkeypatch.setattr(replica_reads, "REPLICA_NETWORK_READ_S", 0.0)  # b is among the key's nearest (3 nodes)
    assert records._read(b, key, 10.0, replica_ok=True) == []
    assert replica_reads._confirmed[memo][0] == networked_at  # read from its storage
    assert records._store(a, key, b"first", ttl=10.0, wait=True)
    assert [e.body for e in records._read(b, key, 10.0, replica_ok=True)] == [b"first"]


def test_a_record_that_expired_here_since_the_last_network_read_sends_the_next_read_out(nodes, monkeypatch):
    coord, a, b = nodes
    memo = memo_of(b)
    monkeypatch.setattr(replica_reads, "REPLICA_NETWORK_READ_S", 0.0)
    assert records.publish_progress(a, SPEC.run_id, a.peer_id.to_base58(), progress(40), ttl=30).result(timeout=10)
    assert records.publish_progress(coord, SPEC.run_id, coord.peer_id.to_base58(), progress(40), ttl=4.5).result(timeout=10)
    replica_reads._confirmed.pop(memo, None)
    rounds(b)
    networked_at = replica_reads._confirmed[memo][0]
    rounds(b)
    assert replica_reads._confirmed[memo][0] == networked_at  # both fresh: from its storage
    time.sleep(4.6)  # the coordinator's record expires unrefreshed, unseen by any read near its end
    rounds(b)
    assert replica_reads._confirmed[memo][0] > networked_at  # one record fewer than found: the network
