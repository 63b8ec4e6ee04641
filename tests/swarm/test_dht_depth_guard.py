"""A DHT value nested a few hundred tuples deep, stored into a node or returned by a find: hivemind
decodes a dictionary value before any validator runs, recursing through C for each tuple, and about
200 of them (2 KB) killed the node's process. swarm/dht/depth_guard.py refuses them first."""

from __future__ import annotations

import asyncio
import functools
import time
from types import SimpleNamespace

import hivemind
import msgpack
import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.proto import dht_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time

from protocol.wire.bounded_unpack import MAX_DEPTH
from swarm.dht.depth_guard import DepthCheckedSerializer, install_guard
from swarm.dht.node import start_dht

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
TUPLE = 0x40  # hivemind's extension type for a tuple


def nested_tuples(levels: int) -> bytes:
    """msgpack of a tuple inside a tuple ... ``levels`` deep, as hivemind packs tuples (built without recursion)."""
    element = msgpack.ExtType(TUPLE, msgpack.packb([1]))
    for _ in range(levels - 1):
        element = msgpack.ExtType(TUPLE, msgpack.packb([element]))
    return msgpack.packb(element)


def test_the_guarded_decoder_refuses_deep_nesting_and_decodes_the_rest_as_hivemind_does(monkeypatch):
    with pytest.raises(ValueError, match=f"more than {MAX_DEPTH} levels"):
        DepthCheckedSerializer.loads(nested_tuples(400))
    value = DictionaryDHTValue()
    value.store("subkey", b"value", get_dht_time() + 60)
    for honest in ((1, (2, "x")), {"a": [1, 2]}, b"bytes", value):
        raw = MSGPackSerializer.dumps(honest)
        assert DepthCheckedSerializer.dumps(honest) == raw
        got = DepthCheckedSerializer.loads(raw)
        assert (list(got.items()) if honest is value else got) == (list(value.items()) if honest is value else MSGPackSerializer.loads(raw))
    node = SimpleNamespace(protocol=SimpleNamespace(serializer=MSGPackSerializer))
    monkeypatch.setattr(DHTProtocol, "serializer", MSGPackSerializer)  # (restored after the test)
    asyncio.run(install_guard(None, node))  # a DHT process not forked from ours: guarded in place
    assert node.protocol.serializer is DepthCheckedSerializer and DHTProtocol.serializer is DepthCheckedSerializer


async def _store_raw(victim, data, _dht, node):
    """From the attacker's DHT process: one STORE of a whole dictionary value ``data`` at ``victim``."""
    request = dht_pb2.StoreRequest(keys=[DHTID.generate().to_bytes()], subkeys=[DHTProtocol.IS_DICTIONARY],
                                   values=[data], expiration_time=[get_dht_time() + 60], in_cache=[False],
                                   peer=node.protocol.node_info)
    try:
        return list((await node.protocol.get_stub(victim).rpc_store(request, timeout=10)).store_ok)
    except Exception as e:
        return repr(e)


async def _routing(_dht, node) -> int:
    return len(node.protocol.routing_table.uid_to_peer_id)


def test_a_store_of_a_value_nested_hundreds_of_tuples_deep_leaves_the_node_running():
    victim = start_dht((), LOOPBACK)
    attacker = hivemind.DHT(initial_peers=[str(m) for m in victim.get_visible_maddrs()], start=True)
    try:
        answer = attacker.run_coroutine(functools.partial(_store_raw, victim.peer_id, nested_tuples(1000)))
        time.sleep(1.0)
        assert victim.is_alive(), f"the node's DHT process died (its answer: {answer})"
        assert victim.run_coroutine(_routing) >= 1  # and it still serves its own calls
    finally:
        attacker.shutdown()
        victim.shutdown()
