"""swarm/future_pipes.py: futures sent to a helper process carry their result pipe once, and every
call still gets its answer: from several threads at once, and from a process forked afterwards (as
a peer's averager process calls the DHT process)."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import threading
from functools import partial
from types import SimpleNamespace

import hivemind
from hivemind.utils.mpfuture import MPFuture
from multiprocessing.reduction import ForkingPickler

from swarm import future_pipes
from swarm.future_pipes import send_futures_lean


class Recording:
    """A pipe end whose ``send`` records what it was given, pickled as multiprocessing would."""

    def __init__(self):
        self.sent = []

    def send(self, obj):
        self.sent.append(bytes(ForkingPickler.dumps(obj)))


def test_futures_carry_the_pipe_until_the_helper_answers_through_it_then_a_token_that_resolves_to_it():
    conn = Recording()
    send_futures_lean(conn)
    send_futures_lean(conn)  # idempotent: one wrapper
    sent = MPFuture()
    conn.send(("_call", [], dict(future=sent)))
    conn.send(("_call", [], dict(future=MPFuture())))  # not answered yet: the pipe again
    failed, cancelled = MPFuture(), MPFuture()
    for f in (failed, cancelled):
        conn.send(("_call", [], dict(future=f)))
    failed.set_exception(RuntimeError("no answer through the pipe"))
    cancelled.cancel()
    conn.send(("_call", [], dict(future=MPFuture())))  # neither counts as an answer
    assert all(b"rebuild_connection" in b for b in conn.sent)
    sent.set_result(1)  # answered: the helper holds the pipe
    conn.send(("_call", [], dict(future=MPFuture())))
    assert b"rebuild_connection" not in conn.sent[-1]  # a token, no connection
    future_pipes._kept.clear()
    received = [pickle.loads(b)[2]["future"] for b in conn.sent]
    assert all(f._sender_pipe is not None for f in received)
    assert received[-1]._sender_pipe is received[-2]._sender_pipe  # the token: the pipe last received whole
    # a future pickled outside a wrapped send carries its pipe as hivemind always did
    plain = pickle.loads(bytes(ForkingPickler.dumps(MPFuture())))
    assert plain._sender_pipe is not None


def test_kept_pipes_are_bounded_and_the_least_recently_used_goes_first(monkeypatch):
    monkeypatch.setattr(future_pipes, "MAX_KEPT", 2)
    future_pipes._kept.clear()
    a, b, c = SimpleNamespace(), SimpleNamespace(), SimpleNamespace()
    future_pipes._resolve(b"a", a)
    future_pipes._resolve(b"b", b)
    assert future_pipes._resolve(b"a", None) is a  # used: now the most recent
    future_pipes._resolve(b"c", c)
    assert list(future_pipes._kept) == [b"a", b"c"]
    future_pipes._kept.clear()


async def _double(dht, node, x):
    return 2 * x


def _child_calls(dht, out):
    try:
        out.put([dht.run_coroutine(partial(_double, x=i)) for i in range(20)])
    except Exception as e:  # reported, not hung
        out.put(repr(e))


def test_calls_from_threads_and_from_a_forked_process_all_get_their_answers():
    dht = hivemind.DHT(start=True)
    try:
        send_futures_lean(dht._outer_pipe)
        results, errors = {}, []

        def calls(t):
            try:
                results[t] = [dht.run_coroutine(partial(_double, x=100 * t + i)) for i in range(25)]
            except Exception as e:
                errors.append(e)

        threads = [threading.Thread(target=calls, args=(t,)) for t in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and all(results[t] == [2 * (100 * t + i) for i in range(25)] for t in range(6))
        out = mp.get_context("fork").Queue()
        child = mp.get_context("fork").Process(target=_child_calls, args=(dht, out))
        child.start()
        assert out.get(timeout=60) == [2 * i for i in range(20)]
        child.join(10)
        assert dht.run_coroutine(partial(_double, x=21)) == 42  # and the parent's calls go on
    finally:
        dht.shutdown()
