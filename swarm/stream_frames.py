"""hivemind's reader of a stream's messages, with a bound on one message's size.

Every protobuf stream a process serves or calls through hivemind's p2p daemon (a payload, set or
list fetch, a state download, matchmaking's join requests) reads each message as a length header and
then that many bytes, with no bound: a stranger that announced 2^40 bytes and kept sending had all
of it kept in memory, before any handler of ours ran (200 MiB sent, 205 MiB more resident). Every
message voloco streams is a chunk of at most 256 KiB (peer/exchange/agreement_rounds.py
``CHUNK_BYTES``, peer/exchange/set_server.py ``SET_CHUNK_BYTES``) and hivemind's own are smaller
(state parts of 64 KiB, matchmaking messages of a few KB a member), so a message over
``MAX_MESSAGE_BYTES`` ends its stream at its header.

``install()`` replaces ``P2P.receive_raw_data``; installed before a process starts its DHT node, so
the forked DHT and averager processes inherit it (tests/swarm/test_stream_frames.py).
"""

from __future__ import annotations

import asyncio

from hivemind.p2p import P2P

__all__ = ["MAX_MESSAGE_BYTES", "MessageTooLarge", "bounded_receive_raw_data", "install"]

MAX_MESSAGE_BYTES = 16 << 20


class MessageTooLarge(ValueError):
    """A stream's message header announced more than ``MAX_MESSAGE_BYTES``."""


async def bounded_receive_raw_data(reader: asyncio.StreamReader) -> bytes:
    """One message's bytes, as hivemind's ``P2P.receive_raw_data`` reads them, refused at its header
    when it announces more than ``MAX_MESSAGE_BYTES``."""
    header = await reader.readexactly(P2P.HEADER_LEN)
    length = int.from_bytes(header, P2P.BYTEORDER)
    if length > MAX_MESSAGE_BYTES:
        raise MessageTooLarge(f"a stream message of {length} bytes announced (at most {MAX_MESSAGE_BYTES})")
    return await reader.readexactly(length)


def install() -> None:
    """Every stream this process (and a process forked from it) reads from now on is bounded so."""
    P2P.receive_raw_data = staticmethod(bounded_receive_raw_data)
