"""Each helper process receives a caller's result pipe once, not with every call.

Every call a peer makes to hivemind's DHT or averager process (a read, a store, a matchmaking poll)
sends an ``MPFuture`` through the helper's pipe, and hivemind pickles each future with the caller's
result pipe, a ``multiprocessing`` connection. Unpickling a connection is a file-descriptor hand-over:
the receiver connects to the caller's resource-sharer thread, answers its HMAC challenge and receives
the descriptor. In a 32-peer run of bench/scale.py that hand-over was a fifth of a DHT process's CPU
samples (bench/RESULTS.md, "A caller's result pipe, sent once"), and the caller's sharer thread did
its half in the caller.

``send_futures_lean(conn)`` wraps the ``send`` of one helper's pipe (the end the callers write): a
future carries its result pipe whole, with a token, until the helper has answered one such future
with a result through that pipe (then it holds the pipe: it sent the answer on it); later futures
carry the token only, and the helper takes the pipe from what it kept (``_resolve``). So a token
never reaches a helper that lacks its pipe, even where the helper dropped a message it could not
read. The helper keeps at most ``MAX_KEPT`` pipes, the least recently used going first (a peer has a
few callers: its main process and its averager process). A future forwarded by a process that did
not make it carries its pipe whole, as do futures pickled anywhere but inside a wrapped ``send``.
Guarded by tests/swarm/test_future_pipes.py.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from functools import partial
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
    """The result pipes one writer process knows its helper holds (answered through) for one wrapped pipe."""

    def __init__(self) -> None:
        self.delivered: Set[bytes] = set()

    def answered(self, token: bytes, future) -> None:
        """A future that carried the pipe ``token`` is done: with a result, it came through that pipe."""
        if not future.cancelled() and future.exception() is None:
            self.delivered.add(token)


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
        if kept is not None:
            _kept.move_to_end(token)
    if kept is None:  # cannot happen: a token is sent only once the helper answered through its pipe
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
    if delivery is not None and pipe is not None and self._origin_pid == os.getpid():
        token = _token(pipe)
        if token in delivery.delivered:
            state["_sender_pipe"] = _PipeRef(token, None)
        else:
            state["_sender_pipe"] = _PipeRef(token, pipe)
            self.add_done_callback(partial(delivery.answered, token))
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
        _local.delivery = delivery
        try:
            send(obj)
        finally:
            _local.delivery = None

    conn.send = lean_send
    conn._voloco_lean_send = True
