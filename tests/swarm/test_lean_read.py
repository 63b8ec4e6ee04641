"""swarm/dht/lean_read.py: a network read of a dictionary key asks one replica for what is newer than the
reader's last view, the others for what is newer than that; real hivemind nodes on loopback, the reader
a client-mode node (never a replica, so every read goes over the network)."""

from __future__ import annotations

import time

import pytest
from hivemind.proto import dht_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.auth import AuthRole, AuthRPCWrapper

from protocol.dht import channel_frames
from protocol.dht.keys import peers_key
from protocol.dht.records import Progress
from protocol.spec import RunSpec
from swarm import records
from swarm.dht.lean_read import lean_read_stats
from swarm.dht.node import start_dht
from tests.support.dht_nodes import LOOPBACK, loopback_nodes

SPEC = RunSpec().replace(run_id="lean-read-test")
KEY = peers_key(SPEC.run_id)


def progress(rnd: int) -> Progress:
    return Progress(rnd, 0, "training", SPEC.digest(), 1.0, 0.5, 0, 0.0, 0, 0, "hash", -1)


@pytest.fixture(scope="module")
def swarm():
    for servers in loopback_nodes(SPEC, others=3):
        for n in servers:
            records.fetch_spec(n, SPEC.run_id)
        client = start_dht(servers[0].get_visible_maddrs(), LOOPBACK, client_mode=True, run_ids=[SPEC.run_id])
        records.fetch_spec(client, SPEC.run_id)
        try:
            yield servers, client
        finally:
            client.shutdown()


def rounds(dht) -> dict:
    return {v.peer_id: v.progress.round for v in records.read_progress(dht, SPEC.run_id)}


def served(dht) -> int:
    from swarm.dht.channels import channel_stats
    return dht.run_coroutine(channel_stats).get("served_rpc_find_newer", 0)


async def _store_on_one(holder_b58: str, key: str, subkey, value, expiration: float, beam_size, _dht, node) -> bool:
    """In a writer's DHT process: a lean store that reaches one node only (a replica that the writer's
    other stores missed)."""
    from hivemind.p2p import PeerID
    from swarm.dht import lean_store as module

    async def only(*_args):
        return [PeerID.from_base58(holder_b58)]
    real, module.nearest_nodes = module.nearest_nodes, only
    try:
        return await module.lean_store(key, subkey, value, expiration, beam_size, _dht, node)
    finally:
        module.nearest_nodes = real


async def _both(key: str, _dht, node):
    """In the reader's DHT process: (a lean read, hivemind's get) of ``key``, as subkey -> (value, expiration)."""
    from swarm.dht.lean_read import lean_get

    def plain(found):
        return {k: (v.value, v.expiration_time) for k, v in found.value.items()}
    lean = await lean_get(node, key, 5, lambda: node.get(key, latest=True))
    return plain(lean), plain(await node.get(key, latest=True, beam_size=5))


async def _lean_and_storage(key: str, _dht, node):
    """In a node's DHT process: (subkey -> expiration of what its storage holds under ``key`` before a
    lean read, after it, and of what the read returned)."""
    from hivemind.dht.routing import DHTID
    from swarm.dht.lean_read import lean_get

    def stored():
        item = node.protocol.storage.get(DHTID.generate(source=key))
        return {} if item is None else {k: v.expiration_time for k, v in item.value.items()}
    before = stored()
    found = await lean_get(node, key, 5, lambda: node.get(key, latest=True))
    return before, stored(), {k: v.expiration_time for k, v in found.value.items()}


class _Hostile:
    """A hostile replica's FIND_NEWER answers, by ``kind``: ``forged`` records nobody signed; ``garbled``
    a record whose value is no bytes; ``endless`` one old record of its storage, the newer withheld, said
    to expire never (hivemind's search ends at an answer that expires late enough, so a reader that
    believed it read no further);
    ``regular`` a plain value said to expire never."""

    def __init__(self, protocol, kind: str):
        self.protocol, self.kind = protocol, kind

    async def rpc_find_newer(self, request, context=None):
        from hivemind.dht.storage import DictionaryDHTValue
        dumps, late = self.protocol.serializer.dumps, get_dht_time() + 30
        if self.kind == "regular":
            return dht_pb2.FindResponse(results=[dht_pb2.FindResult(
                type=dht_pb2.FOUND_REGULAR, value=b"\xc1junk", expiration_time=float("inf"))])
        found = DictionaryDHTValue()
        if self.kind == "endless":  # one old, valid record of its storage, the newer ones withheld
            from hivemind.dht.routing import DHTID
            stored = self.protocol.storage.get(DHTID.from_bytes(request.keys[0]))
            oldest = min(stored.value.items(), key=lambda kv: kv[1].expiration_time) if stored is not None else None
            if oldest is not None:
                found.store(oldest[0], oldest[1].value, oldest[1].expiration_time)
        elif self.kind == "forged":
            found.store("12D3KooWForgedPeerForgedPeerForgedPeerForgedPeer", b"\x93\x01\x02\x03", late)
        elif self.kind == "garbled":
            found.store("12D3KooWGarbledPeer", 5, late)
        expiration = float("inf") if self.kind == "endless" else late
        return dht_pb2.FindResponse(results=[dht_pb2.FindResult(
            type=dht_pb2.FOUND_DICTIONARY, value=dumps(found), expiration_time=expiration)])


async def _turn_hostile(kind, _dht, node) -> None:
    """This node's FIND_NEWER answers as ``_Hostile(kind)``, or honestly again for ``kind`` None."""
    from swarm.dht.lean_read import NewerRecords
    server, _ = node.protocol._voloco_channels
    servicer = NewerRecords(node.protocol) if kind is None else _Hostile(node.protocol, kind)
    server.newer = AuthRPCWrapper(servicer, AuthRole.SERVICER, node.protocol.authorizer)


async def _turn_old(_dht, node) -> None:
    """This node's channels no longer know FIND_NEWER, as an older voloco's."""
    channel_frames.METHODS.pop(channel_frames.FIND_NEWER, None)


def test_a_lean_read_sees_what_hiveminds_get_sees_and_asks_for_it_with_find_newer(swarm):
    servers, client = swarm
    for i, writer in enumerate(servers[1:]):
        assert records.publish_progress(writer, SPEC.run_id, writer.peer_id.to_base58(), progress(10 + i), ttl=30).result(timeout=10)
    before = sum(served(s) for s in servers)
    seen = rounds(client)
    assert all(seen[w.peer_id.to_base58()] == 10 + i for i, w in enumerate(servers[1:]))
    lean, whole = client.run_coroutine(_partial(_both, KEY))
    assert lean == whole and len(lean) >= 3  # the records, values and expirations of hivemind's own read
    assert set(seen) >= {w.peer_id.to_base58() for w in servers[1:]}
    assert sum(served(s) for s in servers) > before  # the replicas were asked with FIND_NEWER
    assert client.run_coroutine(lean_read_stats).get("whole", 0) == 0


def test_a_read_with_nothing_new_moves_no_record(swarm):
    servers, client = swarm
    rounds(client)
    stats = client.run_coroutine(lean_read_stats)
    time.sleep(1.1)  # the membership's shortest read interval: the next read goes to the network again
    rounds(client)
    after = client.run_coroutine(lean_read_stats)
    assert after["reads"] > stats["reads"]
    assert after["records"] == stats["records"]


def test_a_record_only_one_replica_got_is_read_whichever_replica_it_is(swarm, monkeypatch):
    servers, client = swarm
    writer = servers[1]
    me = writer.peer_id.to_base58()
    for rnd, holder in enumerate(servers, start=40):
        def store_on_holder(dht, key, subkey, value, expiration, beam_size=None, wait=False):
            return dht.run_coroutine(_partial(_store_on_one, holder.peer_id.to_base58(), key, subkey, value, expiration,
                                              beam_size))
        monkeypatch.setattr(records, "store_lean", store_on_holder)
        assert records.publish_progress(writer, SPEC.run_id, me, progress(rnd), ttl=30)
        deadline = time.monotonic() + 5
        while rounds(client).get(me) != rnd and time.monotonic() < deadline:
            time.sleep(0.3)
        assert rounds(client)[me] == rnd, f"the record held by {holder.peer_id} alone was not read"


def test_a_lean_read_leaves_the_readers_own_storage_as_the_stores_left_it(swarm, monkeypatch):
    """hivemind's get merges what other replicas sent into the node's own storage dictionary; a lean
    read keeps a dictionary of its own, so a replica's storage holds only what was stored on it."""
    servers, _ = swarm
    reader, writer, holder = servers[0], servers[2], servers[3]

    def store_on_holder(dht, key, subkey, value, expiration, beam_size=None, wait=False):
        return dht.run_coroutine(_partial(_store_on_one, holder.peer_id.to_base58(), key, subkey, value, expiration,
                                          beam_size))
    assert records.publish_progress(writer, SPEC.run_id, writer.peer_id.to_base58(), progress(54), ttl=30).result(timeout=10)
    monkeypatch.setattr(records, "store_lean", store_on_holder)  # the next version reaches the holder only
    assert records.publish_progress(writer, SPEC.run_id, writer.peer_id.to_base58(), progress(55), ttl=30)
    monkeypatch.undo()
    before, after, found = reader.run_coroutine(_partial(_lean_and_storage, KEY))
    newer = [k for k in found if found[k] > before.get(k, float("-inf"))]
    assert newer, "the record only the holder got was not read"
    assert after == before


def _partial(fn, *args):
    from functools import partial
    return partial(fn, *args)


@pytest.mark.parametrize("kind", ["forged", "garbled", "endless", "regular"])
def test_a_hostile_replicas_answer_is_refused_and_the_read_goes_on(swarm, kind):
    """Three of the four replicas hostile: each lean read (one, no retry) returns what hivemind's get
    of the honest finds returns, and raises nothing."""
    servers, client = swarm
    hostile, writer = servers[:3], servers[3]
    assert records.publish_progress(servers[0], SPEC.run_id, servers[0].peer_id.to_base58(), progress(69), ttl=20).result(timeout=10)
    for h in hostile:
        h.run_coroutine(_partial(_turn_hostile, kind))
    try:
        for rnd in (70, 71, 72):
            assert records.publish_progress(writer, SPEC.run_id, writer.peer_id.to_base58(), progress(rnd), ttl=30).result(timeout=10)
            lean, whole = client.run_coroutine(_partial(_both, KEY))
            assert lean == whole
    finally:
        for h in hostile:
            h.run_coroutine(_partial(_turn_hostile, None))


def test_a_replica_without_find_newer_is_read_with_hiveminds_find(swarm):
    servers, client = swarm
    old, writer = servers[0], servers[1]
    old.run_coroutine(_turn_old)
    for rnd in (90, 91):
        assert records.publish_progress(writer, SPEC.run_id, writer.peer_id.to_base58(), progress(rnd), ttl=30).result(timeout=10)
        deadline = time.monotonic() + 5
        while rounds(client).get(writer.peer_id.to_base58()) != rnd and time.monotonic() < deadline:
            time.sleep(0.3)
        assert rounds(client)[writer.peer_id.to_base58()] == rnd
    assert client.run_coroutine(lean_read_stats).get("asked_whole", 0) >= 1


def test_a_private_run_serves_lean_reads_to_members_and_refuses_a_stranger():
    import asyncio

    from hivemind.dht.routing import DHTID

    from protocol.dht.newer_reads import pack_held
    from tests.swarm.test_dht_channels import TOKEN, _answer, _raw_channel

    node = start_dht((), LOOPBACK, join_token=TOKEN)
    try:
        member = start_dht(node.get_visible_maddrs(), LOOPBACK, join_token=TOKEN)
        try:
            for who, subkey in ((node, "from-node"), (member, "from-member")):
                assert who.store("private-dictionary", subkey.encode(), get_dht_time() + 60, subkey=subkey)
            lean, whole = member.run_coroutine(_partial(_both, "private-dictionary"))
            assert lean == whole and set(lean) == {"from-node", "from-member"}
            assert served(node) >= 1
        finally:
            member.shutdown()

        request = dht_pb2.FindRequest(keys=[DHTID.generate(source="private-dictionary").to_bytes(), pack_held([])])
        body = request.SerializeToString()

        async def script(reader, writer):
            writer.write(channel_frames.request_header(channel_frames.FIND_NEWER, 3, len(body)) + body)
            await writer.drain()
            return await _answer(reader)

        head, why = asyncio.run(_raw_channel(node)(script))
        assert head.kind == channel_frames.ERROR and b"refused" in why
    finally:
        node.shutdown()


class _NoChannelProtocol:
    """A DHT protocol stand-in whose stub has no channel to the peer just now (or, with ``old``, whose
    channel broke on FIND_NEWER, as an older voloco's does), and whose hivemind find finds nothing."""

    def __init__(self, old: bool):
        import asyncio
        from hivemind.dht.routing import DHTID
        from swarm.dht import lean_read
        self.node_id, self.rpc_semaphore, self.wait_timeout = DHTID.generate(), asyncio.Semaphore(4), 1.0
        self.finds = 0
        self.raised = lean_read.not_served if old else lean_read.no_channel_now

    def get_stub(self, _peer):
        protocol = self

        class Stub:
            async def rpc_find_newer(self, request, timeout=None):
                from swarm.dht.channels import ChannelPool

                class Unserved:  # every open fails: the pool calls what stands in for a missing channel
                    async def call_binary_stream_handler(self, _peer, _name):
                        raise ConnectionError("protocols not supported")
                return await ChannelPool(Unserved()).call("peer", channel_frames.FIND_NEWER, request, timeout,
                                                          protocol.raised, no_channel=protocol.raised)
        return Stub()

    async def call_find(self, _peer, _keys):
        self.finds += 1
        return {}


@pytest.mark.parametrize("old", [False, True])
def test_a_replica_without_a_channel_just_now_is_read_with_find_that_once(old):
    """A channel's back-off lasts seconds (a node still starting, a server at its channel bound): a
    lean read then asks that replica with hivemind's find, but only an older voloco, whose channel
    breaks on FIND_NEWER, is asked so for ``NOT_SERVED_S`` (it once was, too, for a missing channel)."""
    import asyncio
    from types import SimpleNamespace
    from hivemind.dht.routing import DHTID
    from swarm.dht import lean_read

    protocol = _NoChannelProtocol(old)
    node = SimpleNamespace(node_id=protocol.node_id, protocol=protocol)
    answer = asyncio.run(lean_read._ask(node, "peer", DHTID.generate(source="k"), b""))
    assert answer is None and protocol.finds == 1  # asked with hivemind's find, which found nothing
    assert ((node.node_id, "peer") in lean_read._not_served) == old
    lean_read._not_served.pop((node.node_id, "peer"), None)
