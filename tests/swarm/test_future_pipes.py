"""swarm/future_pipes.py: futures sent to a helper process carry their result pipe once, and every
call still gets its answer: from several threads at once, and from a process forked afterwards (as
a peer's averager process calls the DHT process)."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import threading
from functools import partial

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


def test_the_first_future_carries_the_pipe_and_later_ones_a_token_that_resolves_to_it():
    conn = Recording()
    send_futures_lean(conn)
    send_futures_lean(conn)  # idempotent: one wrapper
    futures = [MPFuture() for _ in range(3)]
    for f in futures:
        conn.send(("_call", [], dict(future=f)))
    first, *later = (len(b) for b in conn.sent)
    assert all(n < first for n in later)  # no connection pickled in them
    future_pipes._kept.clear()
    received = [pickle.loads(b)[2]["future"] for b in conn.sent]
    pipes = {id(f._sender_pipe) for f in received}
    assert len(pipes) == 1 and received[0]._sender_pipe is not None
    # a future pickled outside a wrapped send carries its pipe as hivemind always did
    plain = pickle.loads(bytes(ForkingPickler.dumps(MPFuture())))
    assert plain._sender_pipe is not None


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
