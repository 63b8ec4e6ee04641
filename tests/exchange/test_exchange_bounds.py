"""The exchange's bounds (peer/exchange/gatherer.py, peer/exchange/bounds.py), without a network: what a peer
can make this process read, create, evict and wait for through the gather RPCs."""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing as mp
import os
import time
from collections import OrderedDict
from types import SimpleNamespace

import msgpack
import pytest
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2

from peer.exchange.gatherer import CALLS_PER_PEER, SERVING_AT_ONCE, PayloadGatherer
from peer.exchange.bounds import AnswerCutShort, ExchangeLimitError, read_bounded_stream, retry_until
from swarm.call_limits import CallLimiter
from protocol.wire.bounded_unpack import cut_short
from protocol.round.reconcile import Agreement, parse_answer
from protocol.wire.signed import open_envelope
from tests.support.agreement_sim import MAX_PAYLOAD, binding_of, signer

ME, MATE, OUTSIDER = (signer(i) for i in range(3))
GID = b"group-1"


# ---- reading a payload stream -------------------------------------------------------------------
def frame(msg, marker: bytes = b"\x00") -> bytes:
    data = msg.SerializeToString()
    return marker + len(data).to_bytes(8, "big") + data


def chunk(data: bytes) -> averaging_pb2.AveragingData:
    return averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=data))


class FakeStreams:
    """A p2p whose stream handler answers ``data`` then closes; records how much was read."""

    def __init__(self, data: bytes):
        self.data, self.reader = data, None

    async def call_binary_stream_handler(self, peer, name):
        self.reader = asyncio.StreamReader()
        self.reader.feed_data(self.data)
        self.reader.feed_eof()
        writer = SimpleNamespace(write=lambda b: None, drain=_nothing, close=lambda: None)
        return None, self.reader, writer


async def _nothing():
    return None


def read(data: bytes, limit: int = 1000, chunk_bytes: int = 100):
    return asyncio.run(read_bounded_stream(FakeStreams(data), "peer", "h", averaging_pb2.AveragingData(), limit=limit, chunk=chunk_bytes))


def test_a_stream_is_joined_and_its_wire_bytes_counted():
    answer = msgpack.packb([b"a" * 100, b"b" * 50])
    data = frame(chunk(answer[:100])) + frame(chunk(answer[100:]))
    assert read(data) == (answer, len(data))


def test_began_is_told_of_the_first_frame_of_data_and_never_of_a_refusal():
    # protocol/round/fetch_clock.py waits to the deadline for a sender whose payload flows: a member that
    # answers every fetch with a refusal must not count as one
    calls = []
    data = frame(chunk(b"abc")) + frame(chunk(b"def"))
    asyncio.run(read_bounded_stream(FakeStreams(data), "peer", "h", averaging_pb2.AveragingData(), limit=1000,
                                    chunk=100, began=lambda: calls.append(1)))
    assert calls == [1]
    refusal = frame(averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID))
    with pytest.raises(KeyError):
        asyncio.run(read_bounded_stream(FakeStreams(refusal), "peer", "h", averaging_pb2.AveragingData(), limit=1000,
                                        chunk=100, began=lambda: calls.append(2)))
    assert calls == [1]


def test_an_answer_cut_between_two_frames_is_a_transport_failure_that_is_retried():
    answer = msgpack.packb([b"id", b"key", b"signature", b"p" * 500])
    with pytest.raises(AnswerCutShort):
        read(frame(chunk(answer[:256])) + frame(chunk(answer[256:400])))  # the stream closed after two frames

    async def cut_once():
        calls.append(1)
        return await read_bounded_stream(FakeStreams(frame(chunk(answer[: 256 if len(calls) == 1 else None]))),
                                         "peer", "h", averaging_pb2.AveragingData(), limit=1000, chunk=1000)

    calls = []
    assert asyncio.run(_retried(cut_once)) == (answer, len(frame(chunk(answer))))
    assert len(calls) == 2
    assert not cut_short(answer) and not cut_short(b"\xc1 not msgpack") and cut_short(answer[:-1])


async def _retried(attempt):
    return await retry_until(asyncio.get_running_loop().time() + 5, attempt, first_pause=0.01)


def test_a_frame_announcing_64_mib_is_refused_before_it_is_read():
    streams = FakeStreams(b"\x00" + (64 << 20).to_bytes(8, "big") + b"x" * 4096)
    with pytest.raises(ExchangeLimitError):
        asyncio.run(read_bounded_stream(streams, "peer", "h", averaging_pb2.AveragingData(), limit=1000, chunk=100))
    assert len(streams.reader._buffer) == 4096  # the body was left unread


def test_reading_stops_once_the_payload_limit_is_passed():
    data = b"".join(frame(chunk(b"x" * 100)) for _ in range(1000))  # 100 kB against a 1 kB limit
    streams = FakeStreams(data)
    with pytest.raises(ExchangeLimitError):
        asyncio.run(read_bounded_stream(streams, "peer", "h", averaging_pb2.AveragingData(), limit=1000, chunk=100))
    assert len(streams.reader._buffer) > len(data) - 2000  # it stopped after about 1 kB


@pytest.mark.parametrize("data", [
    b"", frame(averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)),
    frame(averaging_pb2.AveragingData(), marker=b"\x01"),
], ids=["nothing", "a-code", "an-error"])
def test_a_peer_that_does_not_serve_raises_key_error(data):
    with pytest.raises(KeyError):
        read(data)


def test_call_limiter_refuses_beyond_its_count_per_peer():
    limiter = CallLimiter(2)
    with limiter.admit("a") as one, limiter.admit("a") as two, limiter.admit("a") as three, limiter.admit("b") as other:
        assert (one, two, three, other) == (True, True, False, True)
    with limiter.admit("a") as again:
        assert again
    everyone = CallLimiter(2, total=3)  # new identities, each within its own count, are bounded together
    with everyone.admit("a") as one, everyone.admit("b") as two, everyone.admit("c") as three, everyone.admit("d") as four:
        assert (one, two, three, four) == (True, True, True, False)


def test_retry_until_outlasts_transient_failures_but_not_its_deadline_or_a_flood():
    async def scenario(failures: int, error: Exception, within: float):
        calls = []

        async def attempt():
            calls.append(1)
            if len(calls) <= failures:
                raise error
            return "served"

        loop = asyncio.get_running_loop()
        try:
            return await retry_until(loop.time() + within, attempt), len(calls)
        except Exception as e:
            return type(e).__name__, len(calls)

    assert asyncio.run(scenario(2, KeyError("reset"), 2.0)) == ("served", 3)
    assert asyncio.run(scenario(99, KeyError("reset"), 0.5))[0] == "KeyError"
    assert asyncio.run(scenario(99, ExchangeLimitError("flood"), 2.0)) == ("ExchangeLimitError", 1)


# ---- the gather RPCs ----------------------------------------------------------------------------
def gatherer(timeout: float = 0.2) -> PayloadGatherer:
    g = PayloadGatherer.__new__(PayloadGatherer)  # the RPC side only: no DHT, no process
    g.dht = SimpleNamespace(peer_id=PeerID(ME.peer_id))
    g.gather_timeout, g._groups, g._group_opened, g._calls = timeout, OrderedDict(), None, CallLimiter(CALLS_PER_PEER)
    g._stream_calls, g._packed_sets = CallLimiter(CALLS_PER_PEER, total=SERVING_AT_ONCE), OrderedDict()
    g._bytes_sent, g._bytes_received = mp.Value(ctypes.c_int64, 0), mp.Value(ctypes.c_int64, 0)
    g._parent_pid = None  # hivemind's __del__ asks whether its process is alive
    return g


def open_group(g: PayloadGatherer, gid: bytes = GID):
    # three members: one agreement round after the first, so relay requests of round 2 exist
    agreement = Agreement(binding_of([ME.peer_id, MATE.peer_id, signer(3).peer_id], group_id=gid), ME, MAX_PAYLOAD)
    group = g._open_group(gid, agreement)
    agreement.seal(b"my payload")
    group.done[0].set()
    return group


def context(key) -> P2PContext:
    return P2PContext(handle_name="h", local_id=PeerID(ME.peer_id), remote_id=PeerID(key.peer_id))


def fetch_request(gid: bytes = GID, owner=ME, digest: bytes = b""):
    return averaging_pb2.AveragingData(group_id=gid, peer_id=owner.peer_id, tensor_part=runtime_pb2.Tensor(buffer=digest))


async def collect(stream):
    return [m async for m in stream]


def test_a_member_gets_our_signed_payload_an_outsider_gets_nothing():
    async def scenario():
        g = gatherer()
        group = open_group(g)
        mine = await collect(g.rpc_fetch_payload(fetch_request(), context(MATE)))
        theirs = await collect(g.rpc_fetch_payload(fetch_request(), context(OUTSIDER)))
        relay = await g.rpc_relay(averaging_pb2.AveragingData(group_id=GID), context(OUTSIDER))
        return group, mine, theirs, relay

    group, mine, theirs, relay = asyncio.run(scenario())
    envelope = b"".join(m.tensor_part.buffer for m in mine)
    assert open_envelope(envelope, group.agreement.context, ME.peer_id, MAX_PAYLOAD)[2] == b"my payload"
    assert [m.code for m in theirs] == [averaging_pb2.BAD_GROUP_ID] and relay.code == averaging_pb2.BAD_GROUP_ID


def test_calls_naming_unknown_groups_create_and_evict_nothing():
    async def scenario():
        g = gatherer(timeout=0.05)
        open_group(g)
        answers = await asyncio.gather(*(collect(g.rpc_fetch_payload(fetch_request(gid=os.urandom(16)), context(MATE)))
                                         for _ in range(CALLS_PER_PEER)))
        return g, answers

    g, answers = asyncio.run(scenario())
    assert list(g._groups) == [GID]
    # a group of the round is open here: any other group of it is refused at once, as one we gather elsewhere
    assert all([m.code for m in a] == [averaging_pb2.GROUP_DISBANDED] for a in answers)


def test_a_group_unknown_here_is_refused_after_the_wait_when_we_gather_in_none():
    async def scenario():
        g = gatherer(timeout=0.05)
        g._round_no = 3  # the open group is of an earlier round
        open_group(g)
        g._round_no = 4
        return await collect(g.rpc_fetch_payload(fetch_request(gid=os.urandom(16)), context(MATE)))

    assert [m.code for m in asyncio.run(scenario())] == [averaging_pb2.BAD_GROUP_ID]


def test_a_member_that_asks_before_the_group_opens_here_is_served_once_it_does():
    async def scenario():
        g = gatherer(timeout=2.0)
        task = asyncio.ensure_future(collect(g.rpc_fetch_payload(fetch_request(), context(MATE))))
        await asyncio.sleep(0.05)
        open_group(g)
        return await task

    msgs = asyncio.run(scenario())
    assert msgs and all(m.code == averaging_pb2.NO_CODE for m in msgs)


def test_one_peer_runs_at_most_its_share_of_calls_and_the_rest_are_refused_at_once():
    async def scenario():
        g = gatherer(timeout=1.0)
        waiting = [asyncio.ensure_future(collect(g.rpc_fetch_payload(fetch_request(gid=b"later"), context(MATE))))
                   for _ in range(CALLS_PER_PEER)]
        await asyncio.sleep(0.05)
        t = time.monotonic()
        refused = await collect(g.rpc_fetch_payload(fetch_request(gid=b"later"), context(MATE)))
        elapsed = time.monotonic() - t
        other = asyncio.ensure_future(collect(g.rpc_fetch_payload(fetch_request(gid=b"later"), context(OUTSIDER))))
        await asyncio.sleep(0.01)
        admitted_elsewhere = not other.done()
        for task in waiting + [other]:
            task.cancel()
        return refused, elapsed, admitted_elsewhere

    refused, elapsed, admitted_elsewhere = asyncio.run(scenario())
    assert [m.code for m in refused] == [averaging_pb2.BAD_GROUP_ID] and elapsed < 0.5
    assert admitted_elsewhere  # another peer's calls are counted on their own


def test_a_relay_request_is_answered_once_our_previous_round_is_over():
    async def scenario():
        g = gatherer()
        group = open_group(g)
        request = averaging_pb2.AveragingData(group_id=GID, tensor_part=runtime_pb2.Tensor(buffer=group.agreement.request(2)))
        task = asyncio.ensure_future(g.rpc_relay(request, context(MATE)))
        await asyncio.sleep(0.05)
        early = task.done()
        group.done[1].set()
        bad = averaging_pb2.AveragingData(group_id=GID, tensor_part=runtime_pb2.Tensor(buffer=b"\xc1"))
        return early, await task, await g.rpc_relay(bad, context(MATE))

    early, answer, bad = asyncio.run(scenario())
    assert not early and answer.code == averaging_pb2.NO_CODE and parse_answer(answer.tensor_part.buffer, 3) == ([], [])
    assert bad.code == averaging_pb2.PROTOCOL_VIOLATION


def test_matchmaking_data_reads_as_hivemind_writes_it_and_garbage_reads_as_none():
    from hivemind.averaging.averager import AveragingMode
    from hivemind.utils.serializer import MSGPackSerializer

    from peer.exchange.matchmaking import read_gathered

    announcement = [7, "ab" * 8]
    written = MSGPackSerializer.dumps([100.0, AveragingMode.NODE.value, MSGPackSerializer.dumps(announcement)])
    assert read_gathered(MSGPackSerializer, written) == [100.0, AveragingMode.NODE.value, announcement]
    for junk in (b"", b"\xc1", MSGPackSerializer.dumps([1, 2]), MSGPackSerializer.dumps([1, 2, "not bytes"]),
                 MSGPackSerializer.dumps([1, 2, b"\xc1"])):
        assert read_gathered(MSGPackSerializer, junk) is None


def deep_tuples(levels: int) -> bytes:
    """msgpack of ``levels`` tuples inside one another as hivemind packs a tuple (extension 0x40 holding
    the msgpack of a list): about 200 of them crash hivemind's decoder (C stack), 1.4 KB for 300."""
    import msgpack

    data = msgpack.packb([0])
    for _ in range(levels):
        data = msgpack.packb([msgpack.ExtType(0x40, data)])
    return data


def test_a_deeply_nested_announcement_is_left_out_of_the_group():
    """An announcement nested a thousand lists deep, or 300 tuples deep, reads as garbage (None: the
    member is left out by every member alike); before, the lists made its error message raise
    RecursionError past ``members_of_round``, failing the group's gather, and the tuples crashed the
    process that decoded them (protocol/wire/bounded_unpack.py ``packed_nesting``)."""
    from hivemind.averaging.averager import AveragingMode
    from hivemind.utils.serializer import MSGPackSerializer

    from peer.exchange.matchmaking import read_gathered
    from protocol.round.reconcile import members_of_round

    nested = [7, "ab" * 8, "", []]
    for _ in range(1000):
        nested = [nested]
    for announcement in (MSGPackSerializer.dumps(nested), deep_tuples(300)):
        written = MSGPackSerializer.dumps([100.0, AveragingMode.NODE.value, announcement])
        assert read_gathered(MSGPackSerializer, written) is None
    kept, dropped = members_of_round([None, [7, "ab" * 8, "", []]], 7)
    assert list(kept) == [1] and list(dropped) == [0]
    assert read_gathered(MSGPackSerializer, deep_tuples(300)) is None  # the outer data itself


def test_a_dht_record_nested_past_the_limit_is_refused_before_any_validator_decodes_it(tmp_path):
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer, get_dht_time

    from protocol.dht.keys import owned_subkey, peers_key
    from swarm.access.identity import prepare_identity
    from swarm.dht.validators import key_id, node_validators

    identity = prepare_identity(str(tmp_path / "id.key"))[0]
    (validator,) = node_validators(identity, None)
    subkey = MSGPackSerializer.dumps(owned_subkey(identity.public_key))
    for value in (deep_tuples(300), MSGPackSerializer.dumps(_deep_list(1000))):
        record = DHTRecord(key_id(peers_key("test")), subkey, value, get_dht_time() + 20)
        assert validator.validate(record) is False  # (the tuples: a crash of the DHT process before)


def _deep_list(levels: int):
    value = {"peer": "x", "body": b"", "mac": b""}
    for _ in range(levels):
        value = [value]
    return value
