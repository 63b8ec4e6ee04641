"""peer/exchange/set_server.py's answers to groupmates about the sets we merged, and the sets we keep
serving after fetching them, without a network: who is told, how long a question is held open,
and what stays bounded."""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from hivemind.proto import averaging_pb2, runtime_pb2

from peer.exchange.set_server import KEEP_FETCHED, KEEP_OFFERS
from protocol.dht.records import Progress, encode_body
from protocol.round.group_sets import DIGEST_CHARS, pack_names, parse_names
from protocol.round.peer_states import offers_no_set
from protocol.round.timing import Timing
from tests.exchange.test_exchange_bounds import MATE, ME, OUTSIDER, context, gatherer

OURS, THEIRS = "1" * DIGEST_CHARS, "2" * DIGEST_CHARS
MEMBERS = frozenset([ME.peer_id, MATE.peer_id])


ROUND = 7


def server():
    g = gatherer()
    g._fetched, g._merged = OrderedDict(), OrderedDict()
    g._init_ready_notices()
    return g


def ask(name: str = OURS, wait: float = 0.0, round_no=None) -> averaging_pb2.AveragingData:
    return averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=name.encode()), weight=wait,
                                       group_id=b"" if round_no is None else str(round_no).encode())


def record(round_no: int, gathered_round: int = 0, gathered: str = "", before: str = "") -> Progress:
    return Progress(round=round_no, step=0, state="training", spec="s" * 16, loss=0.0, val_loss=0.0, tokens=0,
                    tokens_per_s=0.0, bytes_sent=0, bytes_received=0, params_hash="h", gathered_round=gathered_round,
                    gathered=gathered, gathered_before=before)


def test_a_peer_that_merges_another_set_of_the_round_or_is_long_past_it_offers_none():
    assert offers_no_set(record(ROUND + 1, ROUND, THEIRS), ROUND, OURS)  # it agreed another set
    assert offers_no_set(record(ROUND + 2, ROUND + 1, OURS, before=THEIRS), ROUND, OURS)  # ... the round before
    assert offers_no_set(record(ROUND + 3), ROUND, OURS)  # long past the round
    assert not offers_no_set(record(ROUND + 1, ROUND, OURS), ROUND, OURS)  # ours: its merge may still run
    assert not offers_no_set(record(ROUND + 1, ROUND - 1, THEIRS), ROUND, OURS)  # no set of the round named yet
    assert not offers_no_set(record(ROUND), ROUND, OURS)  # still in the round
    assert not offers_no_set(record(ROUND + 2), ROUND, OURS)  # a set it names may be late: still held


def test_a_groupmate_that_took_another_set_says_so_at_once_and_only_when_asked_with_the_round():
    """peer/exchange/set_server.py ``rpc_merged``: a member that gave up the group's gather and took
    another set for the round used to hold its groupmates' questions until their waits ran out (160 s
    in a 32-peer run of bench/scale.py); a question without a round is only held, as before."""
    g = server()

    async def go(question, wait_for=None):
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        task = asyncio.create_task(g.rpc_merged(question, context(MATE)))
        if wait_for is not None:
            await asyncio.sleep(3 * Timing.merged_poll_s)
            assert not task.done()
            g.note_progress(encode_body(wait_for.to_wire()))
        return await asyncio.wait_for(task, 5.0), loop.time() - t0

    g.note_progress(encode_body(record(ROUND + 1, ROUND, THEIRS).to_wire()))
    answer, took = asyncio.run(go(ask(wait=30.0, round_no=ROUND)))
    assert answer.code == averaging_pb2.GROUP_DISBANDED and took < 1.0
    answer, took = asyncio.run(go(ask(wait=0.5)))  # no round named: held until its wait
    assert answer.code == averaging_pb2.NOT_LOOKING_FOR_GROUP and took >= 0.45
    # still in the round when asked, then it takes another set: the held question is answered then
    g.note_progress(encode_body(record(ROUND).to_wire()))
    answer, took = asyncio.run(go(ask(wait=30.0, round_no=ROUND), wait_for=record(ROUND + 1, ROUND, THEIRS)))
    assert answer.code == averaging_pb2.GROUP_DISBANDED and took < 2.0
    # a round that is not a number is refused
    for bad in (b"x7", b"1" * 13):
        q = ask(wait=30.0)
        q.group_id = bad
        assert asyncio.run(g.rpc_merged(q, context(MATE))).code == averaging_pb2.BAD_GROUP_ID


def test_a_groupmate_is_told_what_we_merged_and_an_outsider_nothing():
    g = server()

    async def go():
        await g._offer_merged(OURS, MEMBERS, pack_names([OURS, THEIRS]))
        return await g.rpc_merged(ask(), context(MATE)), await g.rpc_merged(ask(), context(OUTSIDER))

    told, refused = asyncio.run(go())
    assert parse_names(told.tensor_part.buffer) == (OURS, THEIRS)
    assert refused.code == averaging_pb2.BAD_GROUP_ID and not refused.tensor_part.buffer


def test_a_question_asked_before_we_merged_is_answered_once_we_have():
    g = server()

    async def go():
        question = asyncio.create_task(g.rpc_merged(ask(wait=5.0), context(MATE)))
        await asyncio.sleep(3 * Timing.merged_poll_s)
        assert not question.done()
        await g._offer_merged(OURS, MEMBERS, pack_names([OURS]))
        return await asyncio.wait_for(question, 2.0)

    assert parse_names(asyncio.run(go()).tensor_part.buffer) == (OURS,)


def test_a_question_is_held_open_no_longer_than_it_asks_and_a_nan_wait_is_none():
    g = server()

    async def go(wait):
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        answer = await g.rpc_merged(ask(wait=wait), context(MATE))
        return answer, loop.time() - t0

    for wait, most in ((0.3, 1.5), (float("nan"), 0.5), (-5.0, 0.5)):
        answer, took = asyncio.run(go(wait))
        assert answer.code == averaging_pb2.NOT_LOOKING_FOR_GROUP and took < most


def test_malformed_names_are_refused_at_once():
    g = server()
    for name in ("short", "x" * (DIGEST_CHARS + 1)):
        answer = asyncio.run(g.rpc_merged(ask(name, wait=30.0), context(MATE)))
        assert answer.code == averaging_pb2.BAD_GROUP_ID


def test_offers_and_fetched_sets_are_bounded():
    g = server()

    async def offer_many():
        for i in range(3 * KEEP_OFFERS):
            await g._offer_merged(f"{i:032x}", MEMBERS, pack_names([]))

    asyncio.run(offer_many())
    assert len(g._merged) == KEEP_OFFERS and f"{3 * KEEP_OFFERS - 1:032x}".encode() in g._merged
    for i in range(3 * KEEP_FETCHED):
        g._keep_fetched(f"{i:032x}".encode(), b"set")
    assert len(g._fetched) == KEEP_FETCHED
    # a fetched set is served on by its name; an unknown name gets nothing
    assert g._packed_set(f"{3 * KEEP_FETCHED - 1:032x}".encode()) == b"set"
    assert g._packed_set(b"0" * DIGEST_CHARS) is None


def test_fetched_sets_are_bounded_in_bytes_too(monkeypatch):
    import peer.exchange.set_server as set_server

    monkeypatch.setattr(set_server, "KEEP_FETCHED_BYTES", 100)
    g = server()
    for i in range(4):
        g._keep_fetched(str(i).encode(), b"x" * 60)
    assert list(g._fetched) == [b"3"]  # the newest is kept even alone over the bound



def test_a_fetched_set_is_served_on_only_once_the_host_checked_it(monkeypatch):
    """A set fetched from another group is served on to peers that ask us for it only after the host's
    ``open_set`` accepted it (``keep_checked_set``, peer/round/draw.py), as the set fetched from that
    source: a garbled set under a real name, kept and served on, made the peers asking us refuse us."""
    import peer.exchange.set_server as set_server
    from hivemind.p2p import PeerID
    from hivemind.utils import MPFuture

    g = server()
    g._unchecked_sets, g._p2p, g.prefix, g._max_group_size, g._max_payload_bytes = OrderedDict(), None, "p", 4, 1 << 16
    g._count = lambda sent=0, received=0: None
    answers = {}

    async def read(p2p, peer, handle, request, limit, chunk):
        return answers[peer.to_base58()], 10

    monkeypatch.setattr(set_server, "read_bounded_stream", read)
    honest, liar = PeerID(MATE.peer_id).to_base58(), PeerID(OUTSIDER.peer_id).to_base58()
    answers.update({honest: b"the set", liar: b"garbage"})

    async def fetch(peer):
        future = MPFuture()
        await g._fetch_set(peer, THEIRS, 1.0, future)
        return future.result()

    assert asyncio.run(fetch(liar)) == b"garbage" and asyncio.run(fetch(honest)) == b"the set"
    assert g._packed_set(THEIRS.encode()) is None  # nothing served before the host checked it
    asyncio.run(g._keep_checked_set(honest, THEIRS))
    asyncio.run(g._keep_checked_set(honest, OURS))  # nothing fetched under that name: nothing kept
    assert g._packed_set(THEIRS.encode()) == b"the set" and list(g._fetched) == [THEIRS.encode()]
    assert list(g._unchecked_sets) == [(THEIRS.encode(), liar)]  # refused by the host: pushed out in time
    for i in range(3 * KEEP_FETCHED):
        answers[liar] = b"x"
        asyncio.run(g._fetch_set(liar, f"{i:032x}", 1.0, MPFuture()))
    assert len(g._unchecked_sets) == KEEP_FETCHED and g._packed_set(THEIRS.encode()) == b"the set"


def test_our_groups_set_is_packed_once_for_every_asker(monkeypatch):
    """A set of ours is packed once and the one copy served to every asker (each call packed it anew:
    askers that stop reading held a copy each, up to a full group's payloads)."""
    import peer.exchange.set_server as set_server
    from types import SimpleNamespace

    g = server()
    g._packed_sets = OrderedDict()
    packed = []
    monkeypatch.setattr(set_server.group_sets, "pack_set", lambda binding, envelopes: packed.append(bytes(8)) or packed[-1])
    agreement = SimpleNamespace(outcome=lambda: SimpleNamespace(payloads={b"o": b"p"}), serve=lambda owner, digest: b"e",
                                binding=None)
    g._groups[b"g"] = SimpleNamespace(set_digest=OURS, agreement=agreement)
    served = [g._packed_set(OURS.encode()) for _ in range(5)]
    assert len(packed) == 1 and all(s is packed[0] for s in served)


def test_questions_from_strangers_are_held_only_up_to_a_bound():
    """Any peer could ask about a made-up set and be held for up to ``merged_wait_max_s`` (600 s),
    polled every 0.1 s, without a bound over callers (8,000 held questions took 45 % of a core). A
    caller in none of our groups is held only while fewer than ``MAX_STRANGERS_HELD`` such are; a
    groupmate is held whatever the strangers hold."""
    from hivemind.p2p import PeerID

    from peer.exchange.groups import Group
    from peer.exchange.set_server import MAX_STRANGERS_HELD
    from protocol.wire.signed import Signer
    g = server()
    g._groups[b"g" * 20] = Group(b"g" * 20, None, frozenset({PeerID(MATE.peer_id).to_bytes()}))
    strangers = [Signer.generate() for _ in range(MAX_STRANGERS_HELD + 8)]

    async def go():
        held = [asyncio.create_task(g.rpc_merged(ask("9" * DIGEST_CHARS, wait=600.0), context(s))) for s in strangers]
        mate = asyncio.create_task(g.rpc_merged(ask(wait=600.0), context(MATE)))
        await asyncio.sleep(3 * Timing.merged_poll_s)
        answered = [t.result().code for t in held if t.done()]
        pending = sum(not t.done() for t in held)
        mate_held = not mate.done()
        for t in [*held, mate]:
            t.cancel()
        await asyncio.gather(*held, mate, return_exceptions=True)
        return answered, pending, mate_held

    answered, pending, mate_held = asyncio.run(go())
    assert pending == MAX_STRANGERS_HELD and answered == [averaging_pb2.NOT_LOOKING_FOR_GROUP] * 8
    assert mate_held
    assert g._strangers_held == 0  # every held question let go of its place


def test_a_caller_that_stops_reading_loses_its_place():
    """hivemind puts no deadline on a stream's serving side: a caller that asked for a set and never
    read held one of the ``SERVING_AT_ONCE`` places as long as its connection lived. The stream is now
    cut a gather slot after its last chunk was taken, and the place given back."""
    from peer.exchange.set_server import SET_CHUNK_BYTES
    from protocol.wire.signed import Signer
    g = server()
    g.timing = Timing().with_(gather_slot_s=0.3)
    g._packed_set = lambda digest: bytes(4 * SET_CHUNK_BYTES)
    callers = [Signer.generate() for _ in range(3)]

    async def stalled(caller):  # takes the first chunk, then never reads again (a send that never drains)
        async for _ in g.rpc_fetch_set(ask(), context(caller)):
            await asyncio.Event().wait()

    async def go():
        tasks = [asyncio.create_task(stalled(c)) for c in callers]
        await asyncio.sleep(0.1)
        held = sum(g._stream_calls._running.values())
        await asyncio.sleep(0.6)
        cut = [t.cancelled() for t in tasks]
        await asyncio.sleep(0.1)  # the closed generators give their places back
        return held, cut, sum(g._stream_calls._running.values())

    held, cut, after = asyncio.run(go())
    assert held == 3 and all(cut) and after == 0
