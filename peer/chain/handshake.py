"""The handshake of a stage link, both sides: ``hello`` -> (``challenge`` -> ``auth`` ->) ``hello_ok``.

The dialer sends its hello; the listener reads it (``read_hello``: a hello of a round the listener has
not reached yet is held until it has, peer/chain/listener.py), checks its public fields
(``protocol.chain.frames.check_hello``) and, when it has a ``LinkAuth``, challenges the dialer to prove it is the peer the chain assignment
names for that stage while proving the same of itself (protocol/chain/link_auth.py). Everything here
runs on a ``StageLink`` (peer/chain/links.py) that still reads with the handshake's small frame
limit, within one deadline for the whole exchange.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from peer.chain.errors import HandshakeRejected, LinkProtocolError
from protocol.chain import link_auth
from protocol.errors import FrameError
from protocol.chain.frames import NONCE_BYTES, Auth, Challenge, Hello, HelloOk, Reject, check_hello
from protocol.wire.signed import Signer

if TYPE_CHECKING:  # pragma: no cover
    from peer.chain.links import StageLink

__all__ = ["LinkAuth", "dial", "read_hello", "answer"]


@dataclass(frozen=True)
class LinkAuth:
    """What a stage needs to authenticate a link: its own identity key and the libp2p peer id
    (bytes) that the chain assignment names for the neighbour on that link."""

    signer: Signer
    neighbour: bytes


def _left(deadline: float) -> float:
    return max(0.0, deadline - asyncio.get_running_loop().time())


async def dial(link: "StageLink", hello: Hello, auth: "LinkAuth | None", deadline: float) -> None:
    """The dialer's side, after ``hello`` was sent: returns once the listener said hello_ok.
    Raises HandshakeRejected, LinkProtocolError (and the link's own LinkTimeout, LinkClosed)."""
    frame = await link._recv_frame(_left(deadline))
    if isinstance(frame, Challenge):
        if auth is None:
            raise link._fail(LinkProtocolError("the listener asks for authentication; this stage has no identity key", link))
        me = auth.signer.peer_id
        try:
            link_auth.check(auth.neighbour, frame.key, frame.sig, "listener", hello, me, auth.neighbour, frame.nonce)
        except FrameError as e:
            raise link._fail(LinkProtocolError(str(e), link)) from None
        link.send(Auth(*link_auth.prove(auth.signer, "dialer", hello, me, auth.neighbour, frame.nonce)))
        frame = await link._recv_frame(_left(deadline))
    elif auth is not None and isinstance(frame, HelloOk):
        raise link._fail(LinkProtocolError("the listener did not prove it is the stage the chain names", link))
    if isinstance(frame, Reject):
        raise link._fail(HandshakeRejected(f"neighbour rejected our hello: {frame.reason}", link))
    if not isinstance(frame, HelloOk):
        raise link._fail(LinkProtocolError(f"expected hello_ok, got {type(frame).__name__}", link))


async def read_hello(link: "StageLink", deadline: float):
    """The dialer's first frame, unchecked (``answer`` checks it): a listener may look at its round
    first. Raises the link's LinkError (garbage, timeout, closed)."""
    return await link._recv_frame(_left(deadline))


async def answer(link: "StageLink", frame, expect: dict, auth: "LinkAuth | None", deadline: float) -> Hello:
    """The listener's side, up to (not including) its hello_ok: the dialer's checked hello.
    ``frame``: what ``read_hello`` read; ``expect``: ``check_hello``'s keyword arguments. Raises
    FrameError with the reason to send back in a reject (a hello from the wrong neighbour, or one
    that cannot prove who it is), or the link's LinkError (garbage, timeout, closed)."""
    hello = check_hello(frame, **expect)
    if auth is None:
        return hello
    if len(hello.nonce) != NONCE_BYTES:
        raise link_auth.LinkAuthError("this stage authenticates its neighbours: the hello has no nonce")
    me, nonce = auth.signer.peer_id, os.urandom(NONCE_BYTES)
    link.send(Challenge(nonce, *link_auth.prove(auth.signer, "listener", hello, auth.neighbour, me, nonce)))
    reply = await link._recv_frame(_left(deadline))
    if not isinstance(reply, Auth):
        raise link_auth.LinkAuthError(f"expected auth, got {type(reply).__name__}")
    link_auth.check(auth.neighbour, reply.key, reply.sig, "dialer", hello, auth.neighbour, me, nonce)
    return hello
