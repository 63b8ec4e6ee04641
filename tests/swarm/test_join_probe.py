"""Busy or refusing (swarm/access/join_probe.py): real DHT nodes on loopback answer whether their run is
private and whether the asker's token is the run's; the join loop (swarm/dht/node.py) tries a busy
node for longer and stops at once where the run refuses the node."""

from __future__ import annotations

import msgpack
import pytest
from hivemind.proto import dht_pb2
from multiaddr import Multiaddr

import swarm.dht.node as dht_mod
from protocol.dht.records import token_key
from swarm.access import join_probe as probe
from swarm.console import UsageError
from swarm.dht.node import start_dht

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
TOKEN = "private-run-token-0123456789"
OTHER_ID = "QmXjP5fwkdJ9UytA8Zs8SYzqfg3Wzo5yz88RoE6Nxc3U5W"


def test_a_public_node_says_public():
    node = start_dht((), LOOPBACK)
    try:
        assert probe.run_access(node.get_visible_maddrs(), None) == probe.PUBLIC
        assert probe.run_access(node.get_visible_maddrs(), token_key("any token")) == probe.PUBLIC
    finally:
        node.shutdown()


def test_a_private_node_tells_the_token_apart_without_revealing_it():
    node = start_dht((), LOOPBACK, join_token=TOKEN)
    try:
        addrs = node.get_visible_maddrs()
        assert probe.run_access(addrs, None) == probe.PRIVATE
        assert probe.run_access(addrs, token_key(TOKEN)) == probe.TOKEN_OK
        assert probe.run_access(addrs, token_key(TOKEN + "x")) == probe.TOKEN_BAD
    finally:
        node.shutdown()


def test_nobody_listening_is_no_answer():
    assert probe.run_access([Multiaddr(f"/ip4/127.0.0.1/tcp/1/p2p/{OTHER_ID}")], None, timeout=3) is None


class Context:
    def __init__(self, peer_id: str):
        self.remote_id = type("Id", (), {"to_base58": lambda _self: peer_id})()


def ask(servicer: probe.RunAccess, keys, asker: str = OTHER_ID) -> dict:
    import asyncio

    response = asyncio.run(servicer.rpc_run_access(dht_pb2.FindRequest(keys=keys), Context(asker)))
    return msgpack.unpackb(response.results[0].value)


def test_a_proof_made_for_another_peer_id_proves_nothing():
    key = token_key(TOKEN)
    servicer = probe.RunAccess(key)
    assert ask(servicer, [probe.access_proof(key, OTHER_ID)])["token_ok"] is True
    assert ask(servicer, [probe.access_proof(key, OTHER_ID)], asker="QmSomeoneElse")["token_ok"] is False
    assert ask(servicer, [b"\x00" * 500])["token_ok"] is False  # malformed: refused, bounded
    assert ask(servicer, [b"a", b"b"])["token_ok"] is False
    assert ask(probe.RunAccess(None), [b"\x00" * 32]) == {"private": False, "token_ok": None}


@pytest.mark.parametrize("value", [b"", msgpack.packb([1, 2]), msgpack.packb({"private": "yes"}),
                                   msgpack.packb({"private": True, "token_ok": 3}), b"\xc1", b"x" * 100])
def test_a_hostile_answer_is_no_answer(value):
    response = dht_pb2.FindResponse(results=[dht_pb2.FindResult(type=dht_pb2.FOUND_REGULAR, value=value)])
    with pytest.raises(probe.AccessError):
        probe.read_answer(response, proved=False)


def test_a_private_node_that_ignores_the_proof_is_no_answer():
    response = dht_pb2.FindResponse(results=[dht_pb2.FindResult(
        type=dht_pb2.FOUND_REGULAR, value=msgpack.packb({"private": True, "token_ok": None}))])
    with pytest.raises(probe.AccessError):
        probe.read_answer(response, proved=True)
    assert probe.read_answer(response, proved=False) == probe.PRIVATE


# ---- the join loop: what each answer makes of a join node that does not answer in time -------------
@pytest.fixture
def busy_join(monkeypatch):
    attempts = []

    class Busy:  # hivemind's DHT when the join node answers but its DHT replies too late (or refuses)
        def __init__(self, **kwargs):
            attempts.append(kwargs["initial_peers"])
            raise RuntimeError("DHTNode bootstrap failed: none of the initial_peers responded to a ping.")

    monkeypatch.setattr(dht_mod.hivemind, "DHT", Busy)
    monkeypatch.setattr(dht_mod, "JOIN_RETRY_S", 0.0)
    asked = []

    def answer(verdict):
        def run_access(peers, key):
            asked.append(key)
            return verdict
        monkeypatch.setattr(dht_mod, "run_access", run_access)

    return attempts, asked, answer


def failure(**kwargs) -> str:
    with pytest.raises(UsageError) as info:
        start_dht([Multiaddr(f"/ip4/127.0.0.1/tcp/1/p2p/{OTHER_ID}")], LOOPBACK, **kwargs)
    return str(info.value)


def test_a_busy_public_run_is_tried_for_longer(busy_join, caplog):
    attempts, asked, answer = busy_join
    answer(probe.PUBLIC)
    with caplog.at_level("WARNING", logger="voloco.swarm"):
        message = failure()
    assert len(attempts) == dht_mod.BUSY_JOIN_ATTEMPTS and len(asked) == 1
    assert "too busy" in message and "--join-token" not in message
    assert "the run is public: the node is busy" in caplog.text


def test_a_private_run_without_the_token_is_said_at_once(busy_join):
    attempts, asked, answer = busy_join
    answer(probe.PRIVATE)
    message = failure()
    assert len(attempts) == 1
    assert "the run is private" in message and "--join-token" in message


def test_a_wrong_token_is_said_at_once_and_a_right_one_waits(busy_join):
    attempts, asked, answer = busy_join
    answer(probe.TOKEN_BAD)
    assert "check that --join-token is the one" in failure(join_token="x" * 24)
    assert len(attempts) == 1
    attempts.clear()
    answer(probe.TOKEN_OK)
    assert "too busy" in failure(join_token="x" * 24)
    assert len(attempts) == dht_mod.BUSY_JOIN_ATTEMPTS
