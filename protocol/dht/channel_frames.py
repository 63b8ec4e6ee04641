"""The frames of a DHT channel: a node's DHT calls to one peer over one long-lived stream (sans-I/O).

swarm/dht/channels.py carries hivemind's DHT requests (ping, store, find) to a peer over a stream it
keeps open, in place of hivemind's unary calls, each of which opens a stream of its own. The bodies are
hivemind's own protobuf messages; this module frames them.

A request frame is a 9-byte header, then the body::

    method   1 byte: 1 ping, 2 store, 3 find, 4 find newer (a hivemind FindRequest whose keys are the
             key's id and the records the caller holds: protocol/dht/newer_reads.py)
    call id  4 bytes, big-endian: chosen by the caller, echoed in the answer
    length   4 bytes, big-endian: the body's bytes, at most ``MAX_BODY_BYTES``

An answer frame has the same header with a status in place of the method (0: the body is the
response message; 1: the body is an error message, UTF-8, at most ``MAX_ERROR_BYTES``).

``parse_header`` is the trust boundary for both sides: anything it does not raise ``ChannelFrameError``
for names a known method or status, and a body length within its bound, so a reader allocates no more
than that bound for any bytes a peer sends. After an error the stream must be closed.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

HEADER = struct.Struct(">BII")
HEADER_BYTES = HEADER.size

PING, STORE, FIND, FIND_NEWER = 1, 2, 3, 4
METHODS = {PING: "rpc_ping", STORE: "rpc_store", FIND: "rpc_find", FIND_NEWER: "rpc_find_newer"}

OK, ERROR = 0, 1
STATUSES = (OK, ERROR)

# hivemind's own bound on a unary message through its daemon (DEFAULT_MAX_MSG_SIZE): a channel
# takes nothing a unary call would refuse, and nothing larger.
MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_ERROR_BYTES = 512
MAX_CALL_ID = 2**32 - 1


class ChannelFrameError(ValueError):
    """Bytes that are not a channel frame: the stream they came on must be closed."""


class Header(NamedTuple):
    kind: int  # a method (request) or a status (answer)
    call_id: int
    length: int


def request_header(method: int, call_id: int, length: int) -> bytes:
    if method not in METHODS:
        raise ValueError(f"no such DHT channel method: {method}")
    return _pack(method, call_id, length, MAX_BODY_BYTES)


def answer_header(status: int, call_id: int, length: int) -> bytes:
    if status not in STATUSES:
        raise ValueError(f"no such DHT channel status: {status}")
    return _pack(status, call_id, length, MAX_ERROR_BYTES if status == ERROR else MAX_BODY_BYTES)


def _pack(kind: int, call_id: int, length: int, bound: int) -> bytes:
    if not 0 <= call_id <= MAX_CALL_ID:
        raise ValueError(f"call id {call_id} out of range")
    if not 0 <= length <= bound:
        raise ValueError(f"a body of {length} bytes is over the channel's bound of {bound}")
    return HEADER.pack(kind, call_id, length)


def parse_header(data: bytes, *, answer: bool) -> Header:
    """The header in ``data`` (exactly ``HEADER_BYTES``), checked; ``answer`` for the caller's side."""
    if len(data) != HEADER_BYTES:
        raise ChannelFrameError(f"a channel header is {HEADER_BYTES} bytes, got {len(data)}")
    kind, call_id, length = HEADER.unpack(data)
    if answer:
        if kind not in STATUSES:
            raise ChannelFrameError(f"unknown answer status {kind}")
        bound = MAX_ERROR_BYTES if kind == ERROR else MAX_BODY_BYTES
    else:
        if kind not in METHODS:
            raise ChannelFrameError(f"unknown DHT channel method {kind}")
        bound = MAX_BODY_BYTES
    if length > bound:
        raise ChannelFrameError(f"a frame announces {length} bytes, over the bound of {bound}")
    return Header(kind, call_id, length)


def error_body(message: str) -> bytes:
    """An error message as an answer's body: UTF-8, cut to ``MAX_ERROR_BYTES``."""
    return message.encode("utf-8", "replace")[:MAX_ERROR_BYTES]
