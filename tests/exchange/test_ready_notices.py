"""peer/exchange/ready_notices.py's answers to barriers that ask us directly whether we are done with
their round (and to merges that ask whether we have named our group's set), without a network: when a
question is answered, how long it is held, and what stays bounded; and protocol/round/peer_states.py's
``keeps_waiting`` and ``names_no_set_yet``, which decide it."""

from __future__ import annotations

import asyncio

from hivemind.proto import averaging_pb2, runtime_pb2

from peer.exchange import ready_notices
from protocol.dht.records import Progress, encode_body, parse_progress
from protocol.round.peer_states import keeps_waiting, names_no_set_yet
from protocol.round.timing import Timing
from tests.exchange.test_exchange_bounds import MATE, OUTSIDER, context, gatherer


SET_A, SET_B = "a" * 32, "b" * 32


def record(round_no: int, state: str, gathered_round: int = 0, gathered: str = "", before: str = "") -> Progress:
    return Progress(round=round_no, step=3, state=state, spec="s" * 16, loss=0.0, val_loss=0.0, tokens=0,
                    tokens_per_s=0.0, bytes_sent=0, bytes_received=0, params_hash="h",
                    gathered_round=gathered_round, gathered=gathered, gathered_before=before)


def body(round_no: int, state: str, *named) -> bytes:
    return encode_body(record(round_no, state, *named).to_wire())


def ask(round_no="7", wait: float = 5.0, until: bytes = ready_notices.DONE_Q) -> averaging_pb2.AveragingData:
    return averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=str(round_no).encode()), weight=wait,
                                       group_id=until)


def server(hold: float = 10.0):
    g = gatherer()
    g.timing = Timing().with_(ready_hold_s=hold)
    g._init_ready_notices()
    return g


def answered(msg) -> Progress:
    assert msg.code == averaging_pb2.NO_CODE
    return parse_progress(msg.tensor_part.buffer)


def test_keeps_waiting_for_a_peer_training_the_round_or_finishing_an_earlier_one():
    assert keeps_waiting(7, "training", 7) and keeps_waiting(7, "waiting", 7)
    assert keeps_waiting(6, "exchanging", 7) and keeps_waiting(6, "syncing", 7)  # a groupmate finishing the last round
    assert not keeps_waiting(7, "ready", 7) and not keeps_waiting(7, "exchanging", 7)
    assert not keeps_waiting(8, "training", 7)  # past it
    assert not keeps_waiting(7, "syncing", 7)  # not training it: the barrier does not wait for it
    for out in ("stopped", "starting", "linking"):
        assert not keeps_waiting(6, out, 7) and not keeps_waiting(7, out, 7)


def test_a_question_asked_while_we_train_is_answered_once_we_are_done():
    g = server()

    async def go():
        g.note_progress(body(7, "training"))
        question = asyncio.create_task(g.rpc_ready(ask(), context(MATE)))
        await asyncio.sleep(0.2)
        assert not question.done()
        g.note_progress(body(7, "training"))  # a keep-alive changes nothing
        await asyncio.sleep(5 * Timing().ready_watch_s)
        assert not question.done()
        g.note_progress(body(7, "ready"))
        return await asyncio.wait_for(question, 1.0)

    p = answered(asyncio.run(go()))
    assert (p.round, p.state) == (7, "ready")


def test_a_peer_done_past_or_out_of_the_round_answers_at_once():
    for round_no, state in ((7, "ready"), (8, "training"), (5, "stopped"), (7, "linking")):
        g = server()

        async def go():
            g.note_progress(body(round_no, state))
            return await asyncio.wait_for(g.rpc_ready(ask(wait=30.0), context(MATE)), 0.5)

        p = answered(asyncio.run(go()))
        assert (p.round, p.state) == (round_no, state)


def test_a_question_is_held_no_longer_than_it_asks_or_the_hold_allows():
    async def go(g, wait):
        g.note_progress(body(7, "training"))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        msg = await g.rpc_ready(ask(wait=wait), context(MATE))
        return msg, loop.time() - t0

    for hold, wait, least, most in ((10.0, 0.3, 0.25, 1.0), (0.3, 60.0, 0.25, 1.0), (10.0, float("nan"), 0.0, 1.0),
                                    (10.0, -5.0, 0.0, 1.0), (10.0, float("inf"), 0.0, 1.0)):
        msg, took = asyncio.run(go(server(hold), wait))
        assert least <= took < most, (hold, wait, took)
        assert answered(msg).state == "training"  # still training: the asker asks again


def test_malformed_rounds_are_refused_at_once_and_nothing_is_told_before_our_first_record():
    g = server()
    for bad in ("", "-1", "7.5", "x", "1" * (ready_notices.MAX_ROUND_CHARS + 1)):
        msg = asyncio.run(asyncio.wait_for(g.rpc_ready(ask(bad, wait=30.0), context(MATE)), 0.5))
        assert msg.code == averaging_pb2.BAD_GROUP_ID
    msg = asyncio.run(server(hold=0.2).rpc_ready(ask(wait=30.0), context(MATE)))
    assert msg.code == averaging_pb2.NOT_LOOKING_FOR_GROUP and not msg.tensor_part.buffer


def test_held_questions_are_bounded_per_caller_and_in_all(monkeypatch):
    monkeypatch.setattr(ready_notices, "MAX_HELD", 3)
    monkeypatch.setattr(ready_notices, "QUESTIONS_PER_PEER", 2)
    g = server()

    async def go():
        g.note_progress(body(7, "training"))
        held = [asyncio.create_task(g.rpc_ready(ask(), context(MATE))) for _ in range(2)]
        await asyncio.sleep(0.1)
        refused = await asyncio.wait_for(g.rpc_ready(ask(), context(MATE)), 0.5)  # a third from one caller
        held.append(asyncio.create_task(g.rpc_ready(ask(), context(OUTSIDER))))
        await asyncio.sleep(0.1)
        assert not any(t.done() for t in held) and g._ready_held == 3
        at_once = await asyncio.wait_for(g.rpc_ready(ask(), context(OUTSIDER)), 0.5)  # over MAX_HELD
        g.note_progress(body(7, "ready"))
        done = await asyncio.wait_for(asyncio.gather(*held), 1.0)
        return refused, at_once, done

    refused, at_once, done = asyncio.run(go())
    assert refused.code == averaging_pb2.BAD_GROUP_ID
    assert answered(at_once).state == "training"
    assert all(answered(m).state == "ready" for m in done) and g._ready_held == 0


def test_our_own_record_that_does_not_parse_is_never_served():
    g = server(hold=0.2)

    async def go():
        g.note_progress(b"\xc1 not msgpack")
        return await g.rpc_ready(ask(wait=30.0), context(MATE))

    assert asyncio.run(go()).code == averaging_pb2.NOT_LOOKING_FOR_GROUP
    g.note_progress(b"x" * (ready_notices.MAX_ANSWER_BYTES + 1))  # over the bound: not stored
    assert g._ready_len.value == len(b"\xc1 not msgpack")


def test_names_no_set_yet_while_in_the_round_or_behind_it_without_its_set():
    assert names_no_set_yet(record(7, "training"), 7) and names_no_set_yet(record(7, "exchanging"), 7)
    assert names_no_set_yet(record(6, "exchanging", 6, SET_B), 7)  # behind: still to come to round 7
    assert not names_no_set_yet(record(7, "exchanging", 7, SET_A), 7)
    assert not names_no_set_yet(record(8, "training", 8, SET_B, before=SET_A), 7)  # named it, and one more since
    assert not names_no_set_yet(record(8, "training"), 7)  # past the round without a set: none is coming
    for out in ("stopped", "starting", "linking"):
        assert not names_no_set_yet(record(7, out), 7)


def test_a_merges_question_is_held_past_done_until_our_set_is_named():
    g = server()

    async def go():
        g.note_progress(body(7, "training"))
        question = asyncio.create_task(g.rpc_ready(ask(until=ready_notices.SET), context(MATE)))
        g.note_progress(body(7, "ready"))  # done: what a barrier's question waits for, not a merge's
        await asyncio.sleep(5 * Timing().ready_watch_s)
        assert not question.done()
        g.note_progress(body(7, "exchanging", 7, SET_A))
        return await asyncio.wait_for(question, 1.0)

    p = answered(asyncio.run(go()))
    assert (p.round, p.state, p.set_of(7)) == (7, "exchanging", SET_A)


def test_a_question_of_a_kind_we_do_not_know_is_answered_at_once():
    g = server()

    async def go():
        g.note_progress(body(7, "training"))
        return await asyncio.wait_for(g.rpc_ready(ask(wait=30.0, until=b"something else"), context(MATE)), 0.5)

    assert answered(asyncio.run(go())).state == "training"
