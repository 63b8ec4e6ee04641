"""Busy or refusing (swarm/access/join_probe.py): real DHT nodes on loopback answer whether their run is
private and whether the asker's token is the run's; the join loop (swarm/dht/node.py) tries a busy
node for longer (a peer: for as long as it is there) and through the other nodes it hands out, and
stops at once where the run refuses the node."""

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
                                   msgpack.packb({"private": True, "token_ok": 3}), b"\xc1",
                                   b"x" * (probe.MAX_ANSWER_BYTES + 1)])
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

    def answer(verdict, alternates=(), reached=True):
        def join_help(peers, key):
            asked.append(key)
            return probe.JoinHelp(verdict, list(alternates), reached)
        monkeypatch.setattr(dht_mod, "join_help", join_help)

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


ALTERNATE = Multiaddr(f"/ip4/127.0.0.2/tcp/2/p2p/{OTHER_ID}")


class Stop(BaseException):
    """Ends an endless join loop in a test."""


def test_a_peer_keeps_trying_a_busy_public_run_through_the_nodes_it_hands_out(busy_join, monkeypatch, caplog):
    attempts, asked, answer = busy_join
    answer(probe.PUBLIC, [ALTERNATE])
    sleeps = []

    def sleep(s):
        sleeps.append(s)
        if len(sleeps) > 2 * dht_mod.BUSY_JOIN_ATTEMPTS:
            raise Stop()

    monkeypatch.setattr(dht_mod.time, "sleep", sleep)
    monkeypatch.setattr(dht_mod, "JOIN_RETRY_S", 5.0)
    with caplog.at_level("WARNING", logger="voloco.swarm"), pytest.raises(Stop):
        start_dht([Multiaddr(f"/ip4/127.0.0.1/tcp/1/p2p/{OTHER_ID}")], LOOPBACK, keep_trying=True)
    assert len(attempts) > 2 * dht_mod.BUSY_JOIN_ATTEMPTS  # no limit while it may admit us
    assert [str(a) for a in attempts[1]][-1] == str(ALTERNATE) and len(attempts[0]) == 1
    assert max(sleeps) == dht_mod.MAX_JOIN_WAIT_S
    assert "Ctrl+C to stop" in caplog.text and "through 1 other node(s)" in caplog.text


@pytest.mark.parametrize("verdict, reached, token", [(probe.PRIVATE, True, None), (None, False, None),
                                                    (probe.TOKEN_BAD, True, "x" * 24)])
def test_a_peer_still_stops_where_the_run_refuses_it_or_nothing_answers(busy_join, verdict, reached, token):
    attempts, asked, answer = busy_join
    answer(verdict, [ALTERNATE], reached)
    assert failure(keep_trying=True, join_token=token)
    assert len(attempts) == (dht_mod.JOIN_ATTEMPTS if verdict is None else 1)


def test_a_node_hands_other_nodes_only_to_an_asker_it_would_admit():
    key = token_key(TOKEN)
    others = [f"/ip4/127.0.0.{i}/tcp/1/p2p/{OTHER_ID}" for i in range(2, 9)] + ["/x" * 200]

    async def alternates(asker):
        return others

    assert len(ask(probe.RunAccess(None, alternates), [])["join"]) == probe.MAX_ALTERNATES
    assert len(ask(probe.RunAccess(key, alternates), [probe.access_proof(key, OTHER_ID)])["join"]) == probe.MAX_ALTERNATES
    assert "join" not in ask(probe.RunAccess(key, alternates), [])  # private run, no token
    assert "join" not in ask(probe.RunAccess(key, alternates), [probe.access_proof(key, "QmSomeoneElse")])


def test_handed_out_nodes_are_read_bounded_and_the_malformed_left_out():
    good = f"/ip4/127.0.0.2/tcp/2/p2p/{OTHER_ID}"
    value = msgpack.packb({"private": False, "token_ok": None, "join": [good, "/ip4/1.2.3.4/tcp/5", "junk", 7]})
    response = dht_pb2.FindResponse(results=[dht_pb2.FindResult(type=dht_pb2.FOUND_REGULAR, value=value)])
    verdict, found = probe.read_answers(response, proved=False)
    assert verdict == probe.PUBLIC and [str(a) for a in found] == [good]
    too_many = msgpack.packb({"private": False, "token_ok": None, "join": [good] * (probe.MAX_ALTERNATES + 1)})
    with pytest.raises(probe.AccessError):
        probe.read_answers(dht_pb2.FindResponse(results=[dht_pb2.FindResult(type=dht_pb2.FOUND_REGULAR,
                                                                            value=too_many)]), proved=False)


def test_a_busy_node_names_the_nodes_it_is_connected_to():
    first = start_dht((), LOOPBACK)
    second = start_dht(first.get_visible_maddrs(), LOOPBACK)
    try:
        help_ = probe.join_help(first.get_visible_maddrs(), None)
        assert help_.verdict == probe.PUBLIC and help_.reached
        assert second.peer_id.to_base58() in {a.value_for_protocol("p2p") for a in help_.alternates}
    finally:
        second.shutdown()
        first.shutdown()


def test_the_nodes_a_peer_remembers_are_joined_through_once_the_join_nodes_answer_late(busy_join):
    attempts, asked, answer = busy_join
    answer(None, [], reached=False)
    known = Multiaddr(f"/ip4/127.0.0.3/tcp/3/p2p/{OTHER_ID}")
    assert failure(known=[known])
    assert len(attempts[0]) == 1 and str(known) in {str(m) for m in attempts[1]}
