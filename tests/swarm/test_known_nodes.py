"""The nodes a peer met, remembered for its next start (swarm/dht/known_nodes.py): written from a
real node's connections, read back bounded with malformed lines skipped, and joined through once
the join nodes answer late."""

from __future__ import annotations

from swarm.dht import known_nodes
from swarm.dht.node import start_dht

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
OTHER_ID = "QmXjP5fwkdJ9UytA8Zs8SYzqfg3Wzo5yz88RoE6Nxc3U5W"


def test_a_node_remembers_the_nodes_it_is_connected_to(tmp_path):
    path = known_nodes.nodes_file(tmp_path / "identity.key")
    first = start_dht((), LOOPBACK)
    second = start_dht(first.get_visible_maddrs(), LOOPBACK)
    try:
        known_nodes.remember(second, path)
    finally:
        second.shutdown()
        first.shutdown()
    assert path.name == "identity.key.nodes"
    assert first.peer_id.to_base58() in {m.value_for_protocol("p2p") for m in known_nodes.recall(path)}


def test_a_dht_closing_as_a_stopping_peer_asks_costs_the_hint_not_the_stop(tmp_path):
    """A DHT process closing its loop answers GeneratorExit, a BaseException: a 32-peer bench's peer
    exited with an error on it, after its last round. One that never answers is waited for briefly."""
    from concurrent.futures import Future

    class Dht:
        def __init__(self, outcome):
            self.outcome = outcome

        def run_coroutine(self, coro, return_future=False):
            future = Future()
            if self.outcome is not None:
                future.set_exception(self.outcome)
            return future

    path = tmp_path / "x.nodes"
    known_nodes.remember(Dht(GeneratorExit()), path)
    known_nodes.remember(Dht(RuntimeError("closed")), path)
    old, known_nodes.REMEMBER_TIMEOUT_S = known_nodes.REMEMBER_TIMEOUT_S, 0.1
    try:
        known_nodes.remember(Dht(None), path)  # never answers
    finally:
        known_nodes.REMEMBER_TIMEOUT_S = old
    assert not path.exists()


def test_what_is_recalled_is_bounded_and_well_formed(tmp_path):
    path = tmp_path / "x.nodes"
    good = f"/ip4/127.0.0.1/tcp/2/p2p/{OTHER_ID}"
    path.write_text("\n".join(["junk", "/ip4/1.2.3.4/tcp/5", good] + [good] * 100) + "\n")
    found = known_nodes.recall(path)
    assert 1 <= len(found) <= known_nodes.MAX_KNOWN and {str(m) for m in found} == {good}
    path.write_bytes(b"\xff" * 100000)
    assert known_nodes.recall(path) == []
    assert known_nodes.recall(tmp_path / "missing.nodes") == [] and known_nodes.recall(None) == []
    assert known_nodes.nodes_file(None) is None


def test_a_stopped_node_cannot_make_remembering_fail(tmp_path):
    class Gone:
        def run_coroutine(self, _):
            raise RuntimeError("the DHT has stopped")

    known_nodes.remember(Gone(), tmp_path / "x.nodes")
    assert not (tmp_path / "x.nodes").exists()


def test_the_daemons_list_of_peers_is_asked_for_at_most_every_few_seconds():
    """Every run-access request of a stranger asked the p2p daemon for its connected peers (a control
    connection each); the list is now asked at most every ``LISTED_FOR_S``, each caller skipped alike."""
    import asyncio
    from types import SimpleNamespace

    from hivemind.p2p import PeerID
    from multiaddr import Multiaddr

    other, asker = PeerID.from_base58(OTHER_ID), PeerID.from_base58("QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN")

    class Daemon:
        asked = 0

        async def list_peers(self):
            self.asked += 1
            return [SimpleNamespace(peer_id=p, addrs=[Multiaddr(f"/ip4/10.0.0.{i}/tcp/31337")])
                    for i, p in enumerate((other, asker))]

    daemon = Daemon()

    async def many():
        return [await known_nodes.connected_nodes(daemon, skip=asker) for _ in range(100)]

    answers = asyncio.run(many())
    assert daemon.asked == 1
    assert all(a == [f"/ip4/10.0.0.0/tcp/31337/p2p/{OTHER_ID}"] for a in answers)
