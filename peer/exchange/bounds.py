"""The exchange's bounds on what other peers can make this process read, hold and wait for.

- ``read_bounded_stream``: a streamed RPC answer read frame by frame, refused as soon as one frame
  or the whole answer exceeds its limit. hivemind's own stream reader allocates whatever length a
  frame header announces, so the exchange reads its payload streams here instead (the frames are
  hivemind's: a marker byte, an 8-byte big-endian length, a protobuf). Every answer read so is one
  msgpack object (an envelope, a packed set); one cut short, because the stream closed between two
  frames, raises ``AnswerCutShort``, which ``retry_until`` retries: it is not the peer's answer;
- ``StallCut``: a stream we serve, cut once its reader falls behind;
- ``retry_until``: a call repeated after quick failures (a reset stream, a group not open there
  yet) until a deadline, so that a transient failure between honest members costs no payload.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from contextlib import closing
from typing import Awaitable, Callable, List, Optional, Tuple, TypeVar

from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2
from hivemind.proto.p2pd_pb2 import RPCError

from protocol.wire.bounded_unpack import cut_short
from protocol.round.timing import Timing

FRAME_SLACK = 1024  # a frame's protobuf fields around its chunk of payload
T = TypeVar("T")


class ExchangeLimitError(IOError):
    """A peer sent more than the exchange reads from it."""


class AnswerCutShort(IOError):
    """A stream that ended between two frames before its answer was whole: a transport failure,
    retried (a member's payload read so once failed to verify and was excluded: CI, 2026-11-27)."""


class NotInGroup(KeyError):
    """A member of our group answered that it gathers this round in another group: it will not
    take part in ours, so it is not asked again (peer/exchange/late_join.py)."""


def refused(peer: PeerID, code: int) -> KeyError:
    """The error for an answer that carries ``code`` instead of data."""
    name = averaging_pb2.MessageCode.Name(code)
    if code == averaging_pb2.GROUP_DISBANDED:
        return NotInGroup(f"{peer} gathers this round in another group ({name})")
    return KeyError(f"{peer} does not serve it ({name})")


async def read_bounded_stream(
    p2p: P2P, peer: PeerID, handle_name: str, request: averaging_pb2.AveragingData, *, limit: int, chunk: int,
    began: Optional[Callable[[], None]] = None,
) -> Tuple[bytes, int]:
    """Call a stream handler that answers ``AveragingData`` chunks; return (the joined buffers, wire bytes).
    ``began()`` is called when a frame of data (not an error or a refusal) arrives while none has yet.

    Raises ExchangeLimitError past ``limit`` bytes of buffers or a frame longer than ``chunk`` plus
    slack, KeyError when the peer answers with a code or an error, before reading any further, and
    AnswerCutShort when the joined buffers are the start of a msgpack object but not all of it.
    """
    _, reader, writer = await p2p.call_binary_stream_handler(peer, handle_name)
    with closing(writer):
        await P2P.send_protobuf(request, writer)
        await P2P.send_protobuf(P2P.END_OF_STREAM, writer)
        parts: List[bytes] = []
        total = wire = 0
        while True:
            try:
                marker = await reader.readexactly(1)
            except asyncio.IncompleteReadError:  # the handler finished: end of the answer
                break
            size = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
            if size > chunk + FRAME_SLACK:
                raise ExchangeLimitError(f"{peer} announced a frame of {size} bytes (at most {chunk + FRAME_SLACK})")
            data = await reader.readexactly(size)
            wire += 1 + P2P.HEADER_LEN + size
            if marker == P2P.ERROR_MARKER:
                raise KeyError(f"{peer} failed: {RPCError.FromString(data).message[:200]}")
            msg = averaging_pb2.AveragingData.FromString(data)
            if msg.code != averaging_pb2.NO_CODE:
                raise refused(peer, msg.code)
            if began is not None and not total:  # the first frame of data (not a refusal): the answer flows
                began()
            total += len(msg.tensor_part.buffer)
            if total > limit:
                raise ExchangeLimitError(f"{peer} sent more than {limit} bytes")
            parts.append(msg.tensor_part.buffer)
    if not parts:
        raise KeyError(f"{peer} sent nothing")
    answer = b"".join(parts)
    if cut_short(answer):
        raise AnswerCutShort(f"{peer}'s answer ended after {len(answer)} bytes, before it was whole")
    return answer, wire


class StallCut:
    """A stream we serve, cut (``cut()``) once it falls behind the slowest rate a download may take
    (``timing.download_min_rate`` after ``timing.gather_slot_s`` of grace, counted from ``begin()``)
    or a gather slot passes without a part taken: hivemind puts no deadline on a stream's serving
    side, and a reader that stops would hold its place as long as its connection lived (state
    serving, and the sets, lists and envelopes of peer/exchange/set_server.py). Armed for a gather
    slot from its making; made in the serving task's event loop."""

    def __init__(self, timing: Timing, cut: Callable[[], None]):
        self._timing, self._cut, self._loop = timing, cut, asyncio.get_running_loop()
        self._began = time.monotonic()
        self._handle = self._loop.call_later(timing.gather_slot_s, cut)

    def begin(self) -> None:
        """The transfer starts now (what came before, e.g. the state's copy, is not counted)."""
        self._began = time.monotonic()

    def sent(self, sent: int) -> float:
        """``sent`` bytes have gone out (or are about to): the cut moves to when the stream is due
        next, which it returns (monotonic seconds)."""
        t, now = self._timing, time.monotonic()
        due = min(now + t.gather_slot_s, self._began + t.gather_slot_s + sent / t.download_min_rate)
        self._handle.cancel()
        self._handle = self._loop.call_later(max(0.0, due - now), self._cut)
        return due

    def cancel(self) -> None:
        self._handle.cancel()


async def retry_until(deadline: float, attempt: Callable[[], Awaitable[T]], first_pause: float = Timing.retry_first_pause_s,
                      longest_pause: float = Timing.retry_longest_pause_s) -> T:
    """``attempt()`` until it succeeds, each try bounded by the time left to ``deadline`` (event-loop
    time); the last failure is raised. A peer that sent too much, or gathers in another group, is not
    asked again."""
    loop = asyncio.get_running_loop()
    pause = first_pause
    while True:
        try:
            return await asyncio.wait_for(attempt(), timeout=max(0.0, deadline - loop.time()))
        except (ExchangeLimitError, NotInGroup):
            raise
        except Exception:
            if deadline - loop.time() <= pause:
                raise
        await asyncio.sleep(pause)
        pause = min(2 * pause, longest_pause)


def keep_bounded(kept: OrderedDict, key, value, most: int, most_bytes: Optional[int]) -> None:
    """Put ``key`` -> ``value`` last in ``kept``, then drop the oldest entries past ``most`` of them or
    past ``most_bytes`` bytes of values (None: no such bound; the newest is kept even alone over it):
    what a peer keeps of what other peers sent or asked, served on (tests/exchange/test_set_lists.py)."""
    kept[key] = value
    kept.move_to_end(key)
    while len(kept) > most or (most_bytes is not None and len(kept) > 1 and sum(map(len, kept.values())) > most_bytes):
        kept.popitem(last=False)
