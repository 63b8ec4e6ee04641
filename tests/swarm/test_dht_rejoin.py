"""A join node restarted before any request to it failed (swarm/dht/rejoin.py): its peers' tables still
hold its peer id, its own table is empty, and only the periodic ping of the join nodes tells it about
the swarm again, so that a newcomer joining through it finds the peers. Real DHT nodes on loopback."""

from __future__ import annotations

import contextlib
import functools
import logging
import socket
import time

import swarm.dht.rejoin as rejoin
from swarm.dht.node import start_dht
from tests.support.dht_nodes import loopback_nodes

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


async def _peers(_dht, node) -> set:
    return {p.to_base58() for p in node.protocol.routing_table.uid_to_peer_id.values()}


def _table(dht) -> set:
    return dht.run_coroutine(_peers)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_periodic_ping_comes_due_once_a_period_from_a_random_start():
    schedule: dict = {}
    first = [t for t in range(0, 100) if rejoin.refresh_due(float(t), 10.0, schedule)]
    assert first[0] <= 10 and all(b - a == 10 for a, b in zip(first, first[1:])) and len(first) >= 9


def test_a_restarted_join_node_learns_the_swarm_and_a_newcomer_finds_it(tmp_path, monkeypatch):
    monkeypatch.setattr(rejoin, "CHECK_EVERY_S", 0.5)
    monkeypatch.setattr(rejoin, "JOIN_REFRESH_S", 2.0)
    key, port = str(tmp_path / "coordinator.key"), _free_port()
    where = [f"/ip4/127.0.0.1/tcp/{port}"]
    coordinator = start_dht((), where, identity_path=key)
    nodes = [coordinator]
    try:
        join = coordinator.get_visible_maddrs()
        peer = start_dht(join, LOOPBACK)
        nodes.append(peer)
        me = peer.peer_id.to_base58()
        assert me in _table(coordinator)
        # nothing lost on either side: a join node with nobody to ask, a peer whose table holds its join node
        assert coordinator.run_coroutine(functools.partial(rejoin.check, joins=[])) == -1
        assert peer.run_coroutine(functools.partial(rejoin.check, joins=[str(m) for m in join])) == -1
        coordinator.shutdown()
        coordinator = start_dht((), where, identity_path=key)  # the same peer id and port, an empty table
        nodes[0] = coordinator
        assert me not in _table(coordinator)
        deadline = time.monotonic() + 30
        while me not in _table(coordinator):
            assert time.monotonic() < deadline, "the peer never told the restarted join node about itself"
            time.sleep(0.5)
        newcomer = start_dht(join, LOOPBACK)
        nodes.append(newcomer)
        assert me in _table(newcomer), "a newcomer joining through the restarted node did not find the peer"
    finally:
        for node in reversed(nodes):
            try:
                node.shutdown()
            except Exception:
                pass


def test_a_peer_that_keeps_failing_to_find_the_swarm_says_so_at_a_bounded_rate(caplog):
    now = [0.0]
    lost = rejoin.LostSwarm(clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="voloco.swarm"):
        for t in range(0, 300, 5):  # a check every 5 s, nobody answering for 5 minutes
            now[0] = float(t)
            lost.note(0)
    warnings = [r.getMessage() for r in caplog.records if "lost the swarm" in r.getMessage()]
    assert len(warnings) == 5 and "for 15 s" in warnings[0]  # after a quarter of a minute, then once a minute
    caplog.clear()
    lost.note(2)  # found again: the next loss starts a new count
    now[0] += 5
    lost.note(-1)
    lost.note(0)
    assert not [r for r in caplog.records if "lost the swarm" in r.getMessage()]


_three_nodes = contextlib.contextmanager(loopback_nodes)  # a join node and two peers that joined through it


async def _suspend_all(_dht, node, failures: int) -> None:
    """In a node's process: suspend every node of its table as hivemind does after ``failures``
    requests in a row went unanswered (a link down for a while: the suspensions doubled each time)."""
    for peer in node.protocol.routing_table.uid_to_peer_id.values():
        node.blacklist.ban_counter[peer] = failures - 1
        node.blacklist.register_failure(peer)


async def _hold_locally(_dht, node) -> None:
    from hivemind.dht.routing import DHTID
    from hivemind.utils import MSGPackSerializer, get_dht_time

    node.protocol.storage.store(DHTID.generate(source="progress"), MSGPackSerializer.dumps("round 7"),
                                get_dht_time() + 60)


async def _suspended(_dht, node) -> int:
    return sum(1 for p in node.protocol.routing_table.uid_to_peer_id.values() if p in node.blacklist)


def test_a_table_whose_every_node_is_suspended_counts_as_lost_and_an_answer_lifts_every_suspension():
    """After a link came back, a table may still hold every node, each suspended for minutes: the node's
    reads then answer from its own storage only, and it trains alone. That is a lost swarm too; once a
    join node answers, the suspensions made while this node was cut off are lifted, not only the join node's."""
    with _three_nodes(None, others=2) as (join_node, other, peer):
        join = [str(m) for m in join_node.get_visible_maddrs()]
        assert other.peer_id.to_base58() in _table(peer)
        other.run_coroutine(_hold_locally)  # a record only the other peer holds
        peer.run_coroutine(functools.partial(_suspend_all, failures=8))  # 5 s * 2 ** 7: over 10 minutes
        assert peer.run_coroutine(_suspended) == 2
        assert peer.get("progress", latest=True) is None  # reads see nobody
        assert peer.run_coroutine(functools.partial(rejoin.check, joins=join)) >= 1
        assert peer.run_coroutine(_suspended) == 0
        assert peer.get("progress", latest=True).value == "round 7"


async def _forget_all(_dht, node) -> None:
    """In a node's process: an empty table, every node it held suspended, none remembered."""
    table = node.protocol.routing_table
    for uid, peer in list(table.uid_to_peer_id.items()):
        node.blacklist.ban_counter[peer] = 7
        node.blacklist.register_failure(peer)
        del table[uid]
    rejoin._KNOWN.clear()


def test_a_node_that_found_the_swarm_again_fills_its_table_with_the_nodes_it_had_suspended():
    with _three_nodes(None, others=2) as (join_node, other, peer):
        join = [str(m) for m in join_node.get_visible_maddrs()]
        peer.run_coroutine(_forget_all)
        assert not _table(peer)
        assert peer.run_coroutine(functools.partial(rejoin.check, joins=join)) == 1  # the join node alone
        deadline = time.monotonic() + 10  # hivemind adds the nodes that answered in tasks of their own
        while other.peer_id.to_base58() not in _table(peer):
            assert time.monotonic() < deadline, "the lookup after the rejoin left out the node it had suspended"
            time.sleep(0.2)
