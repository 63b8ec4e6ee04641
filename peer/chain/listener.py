"""A stage's listener: accepts its upstream neighbour's connections and checks each handshake.

Each connection must open with a valid hello from the expected neighbour, within
``handshake_timeout``; at most ``MAX_PENDING_HANDSHAKES`` connections are in a handshake at once (a
new one drops the oldest, so stalled strangers cannot lock an honest neighbour out). A hello of a
round this stage has not reached yet is held until it has, and so is any hello that reaches a
listener whose stage has no chain yet (``stage < 0``: started before the stage's first chain, so that
it can announce its port). Between a round's end and the next ``retarget`` (``end_round``) no hello is
taken: one of the round just ended is refused at once (its dialer must catch up), one of a later
round is held as above. The link itself is peer/chain/links.py.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any, Dict, List, Optional

from peer.chain import handshake
from peer.chain.errors import LinkClosed, LinkError, LinkProtocolError, LinkTimeout
from peer.chain.handshake import LinkAuth
from peer.chain.links import StageIdentity, StageLink, neighbour_of, opposite
from protocol.chain.activations import ActivationCodec
from protocol.chain.frames import Frame, FrameFormat, Hello, HelloOk, Reject, check_hello, encode_frame
from protocol.errors import FrameError

__all__ = ["MAX_PENDING_HANDSHAKES", "MAX_ROUNDS_AHEAD", "StageListener"]

MAX_PENDING_HANDSHAKES = 4  # connections in a handshake at once, per listener
MAX_ROUNDS_AHEAD = 2  # a hello of a round at most this far past the listener's is held, not rejected
MAX_REJECTED = 64  # the latest reasons kept (anyone who reaches the port can fail a handshake, again and again)


class StageListener:
    """Accepts neighbours on a TCP port: each connection must open with a valid hello from the
    expected neighbour (stage ``local.stage - 1`` if ``role`` is ``"downstream"``, else
    ``local.stage + 1``), same run digest, chain, round and protocol version, and, when ``auth``
    is set, prove it is ``auth.neighbour``, all within ``handshake_timeout``. A bad hello is
    answered with ``reject`` + the reason, logged, appended to ``rejected`` and closed; the
    listener keeps accepting. Good links queue up for ``accept``. ``local`` and ``auth`` may be
    changed between rounds."""

    def __init__(
        self, *, local: StageIdentity, role: str, fmt: FrameFormat, codec: ActivationCodec,
        timeout: float = 30.0, handshake_timeout: float = 5.0, auth: Optional[LinkAuth] = None,
    ):
        if role not in ("upstream", "downstream"):
            raise ValueError(f"role must be 'upstream' or 'downstream', got {role!r}")
        self.local, self.role, self.fmt, self.codec, self.auth = local, role, fmt, codec, auth
        self.timeout, self.handshake_timeout = timeout, handshake_timeout
        self.rejected: "collections.deque[str]" = collections.deque(maxlen=MAX_REJECTED)
        self._queue: "asyncio.Queue[StageLink]" = asyncio.Queue()
        self._server: Optional[asyncio.AbstractServer] = None
        self._handshakes: Dict[asyncio.Task, StageLink] = {}  # in the order they began
        self._moved = asyncio.Event()  # set (and replaced) when retarget changes who this stage is
        self._ended = False  # the round of ``local`` is over and the next not begun (end_round .. retarget)

    @classmethod
    async def start(cls, host: str = "127.0.0.1", port: int = 0, **kwargs: Any) -> "StageListener":
        listener = cls(**kwargs)
        listener._server = await asyncio.start_server(listener._on_connect, host, port)
        return listener

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = StageLink(reader, writer, local=self.local, role=self.role, fmt=self.fmt, codec=self.codec, timeout=self.timeout)
        if len(self._handshakes) >= MAX_PENDING_HANDSHAKES:
            # close the one that has stalled longest of the address holding the most: a flood of empty
            # connections from one host then evicts its own, not a neighbour's handshake from another
            hosts = collections.Counter(_host_of(pending) for pending in self._handshakes.values())
            crowded = max(hosts, key=lambda h: hosts[h])
            oldest = next(t for t, pending in self._handshakes.items() if _host_of(pending) == crowded)
            stale = self._handshakes.pop(oldest)
            stale._fail(LinkTimeout("dropped for a newer connection: too many in a handshake", stale), logging.INFO)
        task = asyncio.current_task()
        self._handshakes[task] = link
        try:
            if await self._handshake(link):
                link.handshake_done()
                link.send(HelloOk())
                # one neighbour, one link: its newest connection is the one it uses, and one that dials
                # again and again holds one socket here, not one a dial (tests/chain/test_stage_link_guard.py)
                for older in self._dequeue():
                    await older.close(bye=False)
                self._queue.put_nowait(link)
        finally:
            self._handshakes.pop(task, None)

    async def _handshake(self, link: StageLink) -> bool:
        """Whether the connection proved to be the expected neighbour (else answered, logged, closed)."""
        deadline = asyncio.get_running_loop().time() + self.handshake_timeout
        try:
            frame = await handshake.read_hello(link, deadline)
            await self._reach(frame, link, deadline)
            if link.closed:  # dropped for a newer connection, or the listener closed, while held
                return False
            if self._ended:  # the neighbour's hello (any other is refused for what it is), but no round to link
                theirs = getattr(frame, "round", self.local.round)
                check_hello(frame, **self._expect(theirs))
                raise FrameError(f"this stage has ended round {self.local.round}: " + (
                    f"it is not at round {theirs} yet" if theirs > self.local.round else "catch up and dial again"))
            link.local = self.local
            await handshake.answer(link, frame, self._expect(self.local.round), self.auth, deadline)
            if self._ended or link.local != self.local:  # the round ended (or moved) during the proof's round trip
                raise FrameError(f"this stage has ended round {link.local.round} during the handshake: dial again")
            return True
        except FrameError as e:  # a well-formed hello from the wrong neighbour, or one that cannot prove who it is
            reason = f"rejected hello: {e}"
            self.rejected.append(reason)
            try:
                link.writer.write(encode_frame(Reject(str(e))))
            except Exception:  # pragma: no cover
                pass
            link._fail(LinkProtocolError(reason, link))
        except LinkError as e:  # garbage, timeout, closed before the hello
            self.rejected.append(f"handshake failed: {e.reason}")
        return False

    def _expect(self, round_no: int) -> dict:
        """``check_hello``'s keyword arguments for this stage's neighbour as this stage is now (not as it
        was when the connection came), at ``round_no``."""
        local = self.local
        return dict(run_digest=local.run_digest, chain_id=local.chain_id, stage=neighbour_of(local.stage, self.role),
                    round=round_no, role=opposite(self.role))

    def _ahead(self, frame: Frame, link: StageLink) -> bool:
        """Whether ``frame`` is a hello this stage would take were it at the hello's round, one or
        two rounds past its own, or any hello while this stage has no chain yet (anything else is
        answered at once)."""
        local = self.local
        if isinstance(frame, Hello) and local.stage < 0:  # the neighbour was told of this stage first
            return True
        if not isinstance(frame, Hello) or not local.round < frame.round <= local.round + MAX_ROUNDS_AHEAD:
            return False
        try:
            check_hello(frame, **self._expect(frame.round))
        except FrameError:
            return False
        return True

    async def _reach(self, frame: Frame, link: StageLink, deadline: float) -> None:
        """Hold a hello of this stage's neighbour that names a later round than this stage's (at most
        ``MAX_ROUNDS_AHEAD``) until this stage is retargeted to that round, or until ``deadline``
        (then ``check_hello`` rejects it as before): the neighbour that concluded the round first
        dials at once, and this stage, a moment behind, takes the link when it gets there instead of
        making it redial (tests/chain/test_stage_link_guard.py::test_a_hello_a_round_ahead_waits_for_this_stage,
        ``test_a_hello_before_this_stage_has_a_chain_waits_for_it``)."""
        loop = asyncio.get_running_loop()
        while self._ahead(frame, link) and not link.closed and loop.time() < deadline:
            moved = self._moved
            try:
                await asyncio.wait_for(moved.wait(), deadline - loop.time())
            except asyncio.TimeoutError:
                return

    async def retarget(self, local: StageIdentity, auth: Optional[LinkAuth]) -> int:
        """Accept as ``local`` from now on (a new round or chain): links that passed the handshake
        as an earlier identity and were never accepted are closed, so ``accept`` cannot hand out a
        link of a past round (its neighbour gave up on it long ago). Returns how many were dropped."""
        changed = local != self.local or auth is not self.auth
        ended, self._ended = self._ended, False
        self.local, self.auth = local, auth
        stale = self._dequeue() if changed else []  # before the held hellos wake: they queue links of `local`
        if changed or ended:  # wake the hellos held for a later round (_reach)
            self._wake()
        for link in stale:
            await link.close(bye=False)
        return len(stale)

    async def end_round(self) -> int:
        """This stage has ended its round: until the next ``retarget`` a hello of that round (or an
        earlier one) is refused with the reason, and one of a later round is held. Links of the round
        that passed the handshake but were never accepted are closed. Without this, a neighbour that
        missed the round's exchange (and so still trains it) would link up with this stage's ended
        round, and lose that link at our next ``retarget``: both ends then waited ``round_wait`` for
        each other (tests/chain/test_stage_link_guard.py::test_a_hello_of_a_round_this_stage_has_ended_is_refused).
        Returns how many links were closed."""
        self._ended = True
        stale = self._dequeue()
        for link in stale:
            await link.close(bye=False)
        return len(stale)

    def _dequeue(self) -> List[StageLink]:
        """The links that passed the handshake and were never accepted, taken out of the queue."""
        out = []
        while not self._queue.empty():
            out.append(self._queue.get_nowait())
        return out

    def _wake(self) -> None:
        self._moved.set()
        self._moved = asyncio.Event()

    async def accept(self, timeout: Optional[float] = None) -> StageLink:
        """The next neighbour that passed the handshake as ``local`` is now and is still open
        (asyncio.TimeoutError after ``timeout``)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - loop.time())
            link = await asyncio.wait_for(self._queue.get(), left)
            if link.local == self.local and not link.closed and not link.reader.at_eof():
                return link
            await link.close(bye=False)  # handshaken as an identity this listener has left, or gone

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for link in list(self._handshakes.values()):  # their handshakes end at once, as failed
            link._fail(LinkClosed("the listener closed", link), logging.DEBUG)
        self._wake()  # held hellos see their links closed
        for link in self._dequeue():
            await link.close(bye=False)


def _host_of(link: StageLink) -> str:
    """The address a link's connection came from ("" where the socket no longer says)."""
    peer = link.writer.get_extra_info("peername")
    return str(peer[0]) if peer else ""
