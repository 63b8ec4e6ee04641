"""swarm/dht/channels.py and protocol/dht/channel_frames.py: a node's DHT calls over one stream a peer,
served by the node's own DHTProtocol behind hivemind's authorizer wrapper; real nodes on loopback."""

from __future__ import annotations

import asyncio
import gc
import random
import struct
import time
from functools import partial

import hivemind
from hivemind.dht.protocol import DHTProtocol
from hivemind.p2p import P2P, PeerID
import pytest
from hivemind.dht.routing import DHTID
from hivemind.proto import dht_pb2
from hivemind.utils import get_dht_time

from protocol.dht import channel_frames as frames
from swarm.dht import channels as dht_channels, lean_store
from swarm.dht.node import start_dht
from swarm.dht.channels import HANDLER, ChannelPool, channel_stats
from tests.support.dht_nodes import LOOPBACK, loopback_nodes

TOKEN = "channel-test-token-0123456789"


# ---- frames -------------------------------------------------------------------------------------------
def test_headers_round_trip_and_bound_what_a_reader_allocates():
    head = frames.parse_header(frames.request_header(frames.STORE, 7, 300), answer=False)
    assert head == (frames.STORE, 7, 300)
    assert frames.parse_header(frames.answer_header(frames.ERROR, 9, 12), answer=True) == (frames.ERROR, 9, 12)
    with pytest.raises(ValueError):
        frames.request_header(frames.FIND, 1, frames.MAX_BODY_BYTES + 1)
    with pytest.raises(frames.ChannelFrameError, match="over the bound"):
        frames.parse_header(struct.pack(">BII", frames.STORE, 1, frames.MAX_BODY_BYTES + 1), answer=False)
    with pytest.raises(frames.ChannelFrameError, match="over the bound"):
        frames.parse_header(struct.pack(">BII", frames.ERROR, 1, frames.MAX_ERROR_BYTES + 1), answer=True)
    with pytest.raises(frames.ChannelFrameError, match="method"):
        frames.parse_header(struct.pack(">BII", 0, 1, 1), answer=False)
    with pytest.raises(frames.ChannelFrameError, match="9 bytes"):
        frames.parse_header(b"\x01\x02", answer=False)
    rng = random.Random(0)
    for _ in range(20000):
        data = bytes(rng.getrandbits(8) for _ in range(frames.HEADER_BYTES))
        for answer in (False, True):
            try:
                head = frames.parse_header(data, answer=answer)
            except frames.ChannelFrameError:
                continue
            assert head.length <= frames.MAX_BODY_BYTES
            assert head.kind in (frames.STATUSES if answer else frames.METHODS)
    assert len(frames.error_body("é" * 1000)) == frames.MAX_ERROR_BYTES


# ---- real nodes -----------------------------------------------------------------------------------------
def stats(dht) -> dict:
    return dht.run_coroutine(channel_stats)


@pytest.fixture(scope="module")
def trio():
    yield from loopback_nodes(None, others=2)


def test_stores_and_reads_go_over_channels_and_reach_every_node(trio):
    a, b, c = trio
    for i in range(6):
        assert b.store("channel-key", f"v{i}", get_dht_time() + 60, subkey=f"s{i}")
    before = stats(c)
    found = c.get("channel-key", latest=True)
    assert {k: v.value for k, v in found.value.items()} == {f"s{i}": f"v{i}" for i in range(6)}
    mine, theirs = stats(b), stats(a)
    assert mine["calls_channel"] >= 6 and mine["open"] >= 1
    assert theirs["served_rpc_store"] >= 6
    assert stats(c)["calls_channel"] > before.get("calls_channel", 0)


async def _know_strangers(count, _dht, node) -> int:
    """In a node's process: put ``count`` made-up nodes in its routing table; how many it then knows."""
    for i in range(count):
        node.protocol.routing_table.add_or_update_node(DHTID.generate(source=f"stranger-{i}"),
                                                       PeerID(b"\x00\x24" + bytes([i]) * 36))
    return len(node.protocol.routing_table.uid_to_peer_id)


async def _num_replicas(_dht, node) -> int:
    return node.num_replicas


async def _forget_strangers(count, _dht, node) -> None:
    for i in range(count):
        try:
            del node.protocol.routing_table[DHTID.generate(source=f"stranger-{i}")]
        except KeyError:  # dropped already: a search found it silent
            pass


async def _find_both_ways(peer_id, key_id, _dht, node):
    """In a node's process: the nearest nodes a peer's find answer names for a key, over a channel and unary."""
    over_channel = await node.protocol.call_find(peer_id, [key_id])
    unary = super(DHTProtocol, node.protocol).get_stub(node.protocol.p2p, peer_id)
    answer = await unary.rpc_find(dht_pb2.FindRequest(keys=[key_id.to_bytes()], peer=node.protocol.node_info))
    return len(over_channel[key_id][1]), len(answer.results[0].nearest_node_ids)


def test_a_find_over_a_channel_names_a_few_nearest_nodes_not_a_bucket(trio):
    """The caller builds a PeerID for every node an answer names, and voloco's searches keep 8: at 32
    peers hivemind's 20 names were 53 of a peer's 61 KB of find answers a round (bench/RESULTS.md)."""
    a, b, _ = trio
    try:
        assert a.run_coroutine(partial(_know_strangers, 30)) > 30
        served = stats(a).get("served_rpc_find", 0)
        key_id = DHTID.generate(source="some-key")
        over_channel, unary = b.run_coroutine(partial(_find_both_ways, a.peer_id, key_id))
        assert over_channel == dht_channels.FIND_NEIGHBORS and unary == 20  # hivemind's bucket_size
        assert dht_channels.FIND_NEIGHBORS >= b.run_coroutine(_num_replicas) + lean_store.SPARE_CANDIDATES  # what a lean search keeps
        assert stats(a)["served_rpc_find"] > served
        # stores and reads still reach the key's nodes (the made-up ones do not answer: spares stand in)
        assert b.store("few-neighbors-key", "v", get_dht_time() + 60, subkey="s")
        assert a.get("few-neighbors-key", latest=True).value["s"].value == "v"
    finally:
        a.run_coroutine(partial(_forget_strangers, 30))


def _raw_channel(node):
    """A P2P of a stranger, and a coroutine opening a raw stream to ``node``'s channel handler."""

    async def run(script):
        p2p = await P2P.create(initial_peers=[str(m) for m in node.get_visible_maddrs()])
        try:
            _, reader, writer = await p2p.call_binary_stream_handler(node.peer_id, HANDLER)
            try:
                return await script(reader, writer)
            finally:
                writer.close()
        finally:
            await p2p.shutdown()

    return run


async def _answer(reader):
    head = frames.parse_header(await asyncio.wait_for(reader.readexactly(frames.HEADER_BYTES), 10), answer=True)
    return head, await reader.readexactly(head.length)


def _ping_frame(call_id: int) -> bytes:
    body = dht_pb2.PingRequest(validate=False).SerializeToString()
    return frames.request_header(frames.PING, call_id, len(body)) + body


def test_a_malformed_request_is_answered_with_an_error_and_the_channel_goes_on(trio):
    a = trio[0]

    async def script(reader, writer):
        writer.write(frames.request_header(frames.STORE, 1, 5) + b"\xff\xff\xff\xff\xff")
        writer.write(_ping_frame(2))
        await writer.drain()
        return await _answer(reader), await _answer(reader)

    (bad, why), (good, body) = asyncio.run(_raw_channel(a)(script))
    assert bad.kind == frames.ERROR and bad.call_id == 1 and b"StoreRequest" in why
    assert good.kind == frames.OK and good.call_id == 2
    assert dht_pb2.PingResponse.FromString(body).peer.node_id == a.run_coroutine(_node_id)


async def _node_id(_dht, node) -> bytes:
    return node.node_id.to_bytes()


def test_a_frame_over_the_bound_closes_the_channel_without_reading_it(trio):
    a = trio[0]
    before = stats(a).get("served_bad_frames", 0)

    async def script(reader, writer):
        writer.write(struct.pack(">BII", frames.STORE, 1, 2**32 - 1) + b"x" * 100)
        await writer.drain()
        try:
            return await asyncio.wait_for(reader.read(1), 10)
        except ConnectionError:
            return b""

    assert asyncio.run(_raw_channel(a)(script)) == b""  # closed, nothing answered
    assert stats(a)["served_bad_frames"] == before + 1
    assert trio[1].store("after-a-bad-frame", 1, get_dht_time() + 60)  # the node serves on


def test_one_stranger_gets_a_bounded_number_of_channels(trio):
    a = trio[0]

    async def many():
        p2p = await P2P.create(initial_peers=[str(m) for m in a.get_visible_maddrs()])
        try:
            opened = [await p2p.call_binary_stream_handler(a.peer_id, HANDLER)
                      for _ in range(dht_channels.MAX_SERVED_PER_PEER + 2)]
            answered = 0
            for i, (_, reader, writer) in enumerate(opened):
                try:
                    writer.write(_ping_frame(i))
                    await writer.drain()
                    head, _ = await _answer(reader)
                    answered += head.kind == frames.OK
                except (asyncio.IncompleteReadError, ConnectionError):
                    pass
            for _, _, writer in opened:
                writer.close()
            return answered
        finally:
            await p2p.shutdown()

    assert asyncio.run(many()) == dht_channels.MAX_SERVED_PER_PEER


async def _held(key: str, _dht, node):
    item = node.protocol.storage.get(DHTID.generate(source=key))
    return None if item is None else item.value


def test_a_private_run_refuses_a_channel_request_without_the_token():
    node = start_dht((), LOOPBACK, join_token=TOKEN)
    try:
        member = start_dht(node.get_visible_maddrs(), LOOPBACK, join_token=TOKEN)
        try:
            assert member.store("members-key", 1, get_dht_time() + 60)
            assert stats(member)["calls_channel"] >= 1
            assert node.run_coroutine(partial(_held, "members-key")) == b"\x01"  # msgpack of 1
        finally:
            member.shutdown()

        request = dht_pb2.StoreRequest(keys=[DHTID.generate(source="intruder-key").to_bytes()], subkeys=[b""],
                                       values=[b"\x01"], expiration_time=[get_dht_time() + 60], in_cache=[False])
        body = request.SerializeToString()

        async def script(reader, writer):
            writer.write(frames.request_header(frames.STORE, 5, len(body)) + body)
            await writer.drain()
            return await _answer(reader)

        head, why = asyncio.run(_raw_channel(node)(script))
        assert head.kind == frames.ERROR and b"refused" in why
        assert node.run_coroutine(partial(_held, "intruder-key")) is None
    finally:
        node.shutdown()


async def _lose_answers(_dht, node) -> None:
    """In a node's process: serve each channel request, then close the channel unanswered."""
    server, _ = node.protocol._voloco_channels
    serve = server._serve

    async def lossy(*args):
        await serve(*args)
        raise ConnectionError("the answer is lost")

    server._serve = lossy


async def _ping(peer_id, _dht, node):
    return await node.protocol.call_ping(peer_id)


def test_a_private_call_made_again_unary_after_its_answer_was_lost_is_signed_anew():
    """The request reached the peer, which saw its nonce: the same signed request sent again unary
    would be refused as a replay."""
    node = start_dht((), LOOPBACK, join_token=TOKEN)
    try:
        node.run_coroutine(_lose_answers)
        member = start_dht(node.get_visible_maddrs(), LOOPBACK, join_token=TOKEN)
        try:
            assert member.run_coroutine(partial(_ping, node.peer_id)) is not None
            assert stats(member).get("calls_broken", 0) >= 1
        finally:
            member.shutdown()
    finally:
        node.shutdown()


def test_a_plain_hivemind_peer_is_called_unary():
    node = start_dht((), LOOPBACK)
    try:
        plain = hivemind.DHT(initial_peers=[str(m) for m in node.get_visible_maddrs()], host_maddrs=LOOPBACK,
                             start=True)
        try:
            assert node.store("plain-key", "x", get_dht_time() + 60)
            seen = stats(node)
            assert seen.get("calls_open_failed", 0) >= 1 and seen.get("calls_unary", 0) >= 1
            assert plain.get("plain-key", latest=True).value == "x"
        finally:
            plain.shutdown()
    finally:
        node.shutdown()


# ---- a channel that breaks ------------------------------------------------------------------------------
class _Streams:
    """A stand-in for hivemind's P2P whose streams lead to a local server that closes after one header."""

    def __init__(self, port: int):
        self.port = port
        self.opened = 0

    async def call_binary_stream_handler(self, _peer, _name):
        self.opened += 1
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        return None, reader, writer


def test_a_call_whose_channel_breaks_is_made_again_unary():
    async def run():
        async def closer(reader, writer):
            await reader.readexactly(frames.HEADER_BYTES)
            writer.close()

        server = await asyncio.start_server(closer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = ChannelPool(_Streams(port))
        unary_calls = []

        async def unary(request, timeout=None):
            unary_calls.append(timeout)
            return dht_pb2.PingResponse(available=True)

        began = time.monotonic()
        answer = await pool.call("peer", frames.PING, dht_pb2.PingRequest(), 5.0, unary)
        server.close()
        return answer, unary_calls, pool.stats, time.monotonic() - began

    answer, unary_calls, pool_stats, took = asyncio.run(run())
    assert answer.available and len(unary_calls) == 1 and 0 < unary_calls[0] <= 5.0
    assert pool_stats["broken"] == 1 and took < 5.0


def test_a_channel_whose_calls_go_unanswered_is_closed_and_the_next_call_opens_another():
    async def run():
        async def silent(reader, writer):
            while await reader.read(1024):
                pass

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        streams = _Streams(server.sockets[0].getsockname()[1])
        pool = ChannelPool(streams)

        async def unary(request, timeout=None):
            raise AssertionError("no fall-back: the channel opened")

        timed_out = 0
        for _ in range(dht_channels.TIMEOUTS_TO_CLOSE + 1):
            try:
                await pool.call("peer", frames.PING, dht_pb2.PingRequest(), 0.2, unary)
            except asyncio.TimeoutError:
                timed_out += 1
        server.close()
        return timed_out, streams.opened

    timed_out, opened = asyncio.run(run())
    assert timed_out == dht_channels.TIMEOUTS_TO_CLOSE + 1
    assert opened == 2  # closed after TIMEOUTS_TO_CLOSE unanswered calls; the next call opened a new one


class _StuckStreams:
    """A stand-in for hivemind's P2P whose streams take no bytes: every write waits for ever."""

    def __init__(self):
        self.opened = 0

    async def call_binary_stream_handler(self, _peer, _name):
        self.opened += 1

        class Stuck:
            def write(self, _data):
                pass

            async def drain(self):
                await asyncio.Event().wait()

            def close(self):
                pass

        return None, asyncio.StreamReader(), Stuck()


def test_a_call_whose_stream_takes_no_bytes_ends_within_its_timeout_and_the_channel_is_replaced():
    async def run():
        streams = _StuckStreams()
        pool = ChannelPool(streams)

        async def unary(request, timeout=None):
            raise AssertionError("no fall-back: the channel opened")

        took = []
        for _ in range(2):
            began = time.monotonic()
            with pytest.raises(asyncio.TimeoutError):
                await pool.call("peer", frames.PING, dht_pb2.PingRequest(), 0.3, unary)
            took.append(time.monotonic() - began)
        return took, streams.opened

    took, opened = asyncio.run(run())
    assert max(took) < 2.0
    assert opened == 2  # a stream whose frame may be cut is not used again


def test_closing_a_channel_under_a_timed_out_call_logs_no_unread_error(caplog):
    """The call whose timeout closes the channel leaves its answer unread: asyncio must not log it."""
    async def run():
        async def silent(reader, writer):
            while await reader.read(1024):
                pass

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        pool = ChannelPool(_Streams(server.sockets[0].getsockname()[1]))
        for _ in range(dht_channels.TIMEOUTS_TO_CLOSE):
            with pytest.raises(asyncio.TimeoutError):
                await pool.call("peer", frames.PING, dht_pb2.PingRequest(), 0.2, None)
        server.close()

    with caplog.at_level("ERROR", logger="asyncio"):
        asyncio.run(run())
        gc.collect()
    assert "never retrieved" not in caplog.text


class _Unserved:
    """A stand-in for hivemind's P2P at a peer that serves no channel (yet): every open fails."""

    def __init__(self):
        self.opened = 0

    async def call_binary_stream_handler(self, _peer, _name):
        self.opened += 1
        raise ConnectionError("failed to negotiate protocol: protocols not supported")


def test_a_peer_without_channels_is_asked_again_after_a_second_then_ever_less_often(monkeypatch):
    """A node contacted while it still starts serves its channels a moment later: its callers try again
    after NO_CHANNEL_FIRST_S, doubling up to NO_CHANNEL_S, instead of calling it unary for 15 s (a
    start-up's burst of calls: 675 unary calls at an 8-peer start, 25 with the back-off, bench/RESULTS.md)."""
    now = [1000.0]
    monkeypatch.setattr(dht_channels.time, "monotonic", lambda: now[0])
    streams = _Unserved()
    pool = ChannelPool(streams)

    async def unary(request, timeout=None):
        return dht_pb2.PingResponse(available=True)

    def call_at(t: float) -> int:
        now[0] = 1000.0 + t
        assert asyncio.run(pool.call("peer", frames.PING, dht_pb2.PingRequest(), 5.0, unary)).available
        return streams.opened

    assert call_at(0.0) == 1
    assert call_at(0.9) == 1  # unary within the first second
    assert call_at(1.1) == 2
    assert call_at(2.9) == 2  # then 2 s
    assert call_at(3.2) == 3
    waits = [dht_channels.no_channel_for(n) for n in range(1, 8)]
    assert waits == sorted(waits) and waits[0] == dht_channels.NO_CHANNEL_FIRST_S and waits[-1] == dht_channels.NO_CHANNEL_S
    assert pool.stats["unary"] == 5 and pool.stats["open_failed"] == 3
    assert dht_channels.no_channel_for(10 ** 6) == dht_channels.NO_CHANNEL_S  # no overflow


def test_a_channel_that_answers_ends_the_backoff():
    """After failed opens, a channel whose server answers resets the count: the next failure waits a second again."""
    pool = ChannelPool(_Unserved())
    pool.unserved["peer"] = (0.0, 3)

    async def run():
        async def pong(reader, writer):
            head = frames.parse_header(await reader.readexactly(frames.HEADER_BYTES), answer=False)
            await reader.readexactly(head.length)
            body = dht_pb2.PingResponse(available=True).SerializeToString()
            writer.write(frames.answer_header(frames.OK, head.call_id, len(body)) + body)
            await writer.drain()
            await reader.read(1)

        server = await asyncio.start_server(pong, "127.0.0.1", 0)
        pool.p2p = _Streams(server.sockets[0].getsockname()[1])
        opened = await pool._channel("peer", 1.0)
        still_counted = "peer" in pool.unserved  # opened, not yet answered
        answer = await pool.call("peer", frames.PING, dht_pb2.PingRequest(), 5.0, None)
        pool.close()
        server.close()
        return opened, still_counted, answer

    opened, still_counted, answer = asyncio.run(run())
    assert opened is not None and still_counted and answer.available
    assert "peer" not in pool.unserved and pool.stats["channel"] == 1


def test_a_server_that_takes_channels_and_closes_them_unanswered_starts_the_backoff():
    """A server at its bound (MAX_SERVED) accepts the stream, then closes it: each call to it paid an
    open and a unary call, since the open had succeeded. Now that counts as a failed open."""

    async def run():
        async def closer(reader, writer):
            await reader.readexactly(frames.HEADER_BYTES)
            writer.close()

        server = await asyncio.start_server(closer, "127.0.0.1", 0)
        streams = _Streams(server.sockets[0].getsockname()[1])
        pool = ChannelPool(streams)

        async def unary(request, timeout=None):
            return dht_pb2.PingResponse(available=True)

        answers = [await pool.call("peer", frames.PING, dht_pb2.PingRequest(), 5.0, unary) for _ in range(3)]
        server.close()
        return answers, streams.opened, pool

    answers, opened, pool = asyncio.run(run())
    assert all(a.available for a in answers)  # made again unary
    assert opened == 1 and pool.unserved["peer"][1] == 1  # the next calls within the back-off are unary at once
    assert pool.stats["broken"] == 1 and pool.stats["unary"] == 3


def test_an_idle_channel_is_kept_for_minutes_and_closed_before_its_server_would(monkeypatch):
    """A channel unused for a few rounds stays open (at 32 peers a round's DHT keys land on other nodes
    each round: at a minute's idle limit a peer opened 2.0 channels a round anew, each a stream's
    negotiation, bench/RESULTS.md), and the caller closes it before the server drops it as silent
    (``SERVED_IDLE_S``), so that no call is sent down a channel its server has closed."""
    now = [1000.0]
    monkeypatch.setattr(dht_channels.time, "monotonic", lambda: now[0])

    class _Open:
        closed, pending, used = False, {}, 1000.0

        def close(self):
            self.closed = True

    pool = ChannelPool(_Unserved())
    channel = pool.channels["peer"] = _Open()
    for idle in (60.0, 120.0, 180.0):
        now[0] = 1000.0 + idle
        pool._sweep()
        assert pool.channels.get("peer") is channel and not channel.closed, idle
    # swept every SWEEP_S: closed at most IDLE_S + SWEEP_S idle, which is before the server's limit
    now[0] = 1000.0 + dht_channels.IDLE_S + dht_channels.SWEEP_S
    pool._sweep()
    assert "peer" not in pool.channels and channel.closed
    assert dht_channels.IDLE_S + dht_channels.SWEEP_S < dht_channels.SERVED_IDLE_S
