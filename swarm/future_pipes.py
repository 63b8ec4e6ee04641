"""Each helper process receives a caller's result pipe once, not with every call.

Every call a peer makes to hivemind's DHT or averager process (a read, a store, a matchmaking poll)
sends an ``MPFuture`` through the helper's pipe, and hivemind pickles each future with the caller's
result pipe, a ``multiprocessing`` connection. Unpickling a connection is a file-descriptor hand-over:
the receiver connects to the caller's resource-sharer thread, answers its HMAC challenge and receives
the descriptor. In a 32-peer run of bench/scale.py that hand-over was a fifth of a DHT process's CPU
samples (bench/RESULTS.md, "A caller's result pipe, sent once"), and the caller's sharer thread did
its half in the caller.

``send_futures_lean(conn)`` wraps the ``send`` of one helper's pipe (the end the callers write): the
first future that carries a given result pipe carries it whole, with a token; later ones carry the
token only, and the helper takes the pipe from what it kept (``_resolve``). The helper keeps at most
``MAX_KEPT`` pipes (a peer has a few callers: its main process and its averager process). What a
writer has delivered is recorded only once the write has returned, under a lock per pipe, and a
pipe delivers in order, so a token never arrives before its pipe. A process forked while another
thread held the lock gets a fresh one. Only futures pickled inside a wrapped ``send`` change: a
future pickled anywhere else carries its pipe as hivemind always did. Guarded by
tests/swarm/test_future_pipes.py.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from typing import Any, Optional, Set

from hivemind.utils.mpfuture import MPFuture

logger = logging.getLogger("voloco.swarm")

MAX_KEPT = 64  # result pipes a helper keeps; one per caller process
_TOKEN_ATTR = "_voloco_pipe_token"
_local = threading.local()  # the wrapped pipe being written by this thread, if any
_kept: "OrderedDict[bytes, Any]" = OrderedDict()  # token -> result pipe, in the receiving process
_kept_lock = threading.Lock()
_installed = False


class _Delivery:
    """What one writer process has delivered through one wrapped pipe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.delivered: Set[bytes] = set()
        self.pending: Set[bytes] = set()
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self.lock = threading.Lock()  # a lock held by another thread at the fork is never released here
        self.pending = set()


def _token(pipe) -> bytes:
    token = getattr(pipe, _TOKEN_ATTR, None)
    if token is None:
        token = os.urandom(16)
        setattr(pipe, _TOKEN_ATTR, token)
    return token


def _resolve(token: bytes, pipe):
    """Unpickling, in the helper: the pipe itself the first time (kept), the kept one after."""
    with _kept_lock:
        if pipe is not None:
            setattr(pipe, _TOKEN_ATTR, token)  # forwarded on, it goes by the same token
            _kept[token] = pipe
            _kept.move_to_end(token)
            while len(_kept) > MAX_KEPT:
                _kept.popitem(last=False)
            return pipe
        kept = _kept.get(token)
    if kept is None:  # cannot happen in order; the call's caller then times out instead of getting an answer
        logger.warning("a call's result pipe was never received: its result cannot be sent back")
    return kept


class _PipeRef:
    __slots__ = ("token", "pipe")

    def __init__(self, token: bytes, pipe) -> None:
        self.token, self.pipe = token, pipe

    def __reduce__(self):
        return _resolve, (self.token, self.pipe)


_hivemind_getstate = MPFuture.__getstate__


def _getstate(self) -> dict:
    state = _hivemind_getstate(self)
    delivery: Optional[_Delivery] = getattr(_local, "delivery", None)
    pipe = state.get("_sender_pipe")
    if delivery is not None and pipe is not None:
        token = _token(pipe)
        if token in delivery.delivered:
            state["_sender_pipe"] = _PipeRef(token, None)
        else:
            delivery.pending.add(token)
            state["_sender_pipe"] = _PipeRef(token, pipe)
    return state


def send_futures_lean(conn) -> None:
    """Wrap ``conn.send`` (a helper's pipe, the writing end) so that futures sent through it carry each
    result pipe once. Idempotent."""
    global _installed
    if getattr(conn, "_voloco_lean_send", False):
        return
    if not _installed:
        MPFuture.__getstate__ = _getstate
        _installed = True
    send, delivery = conn.send, _Delivery()

    def lean_send(obj) -> None:
        with delivery.lock:
            _local.delivery, delivery.pending = delivery, set()
            try:
                send(obj)
            finally:
                _local.delivery = None
            delivery.delivered |= delivery.pending  # written: every later message is read after it

    conn.send = lean_send
    conn._voloco_lean_send = True
