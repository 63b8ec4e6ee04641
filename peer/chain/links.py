"""The links of a chain stage to its neighbours: TCP connections speaking ``protocol.chain.frames``.

* ``StageLink``: a TCP connection to one neighbour, over asyncio streams (uvloop where
  installed: ``run``). ``connect_link`` dials a neighbour; ``peer.chain.listener.StageListener``
  accepts them, checks each ``hello`` (run digest, chain id, stage index, round, protocol
  version) and answers ``reject`` with the reason to anything else, then keeps listening.
* Every read has a deadline per frame, so a dead or stalled neighbour (or one that trickles
  bytes) is detected. Whatever a neighbour sends that this stage cannot use closes that
  connection with a logged reason and surfaces as a ``LinkError`` subclass to the caller:
  bad bytes (``FrameError``: truncated, oversized, wrong shape or dtype, non-finite values,
  out-of-range token ids), a frame of another step or micro-batch, values the codec cannot
  decode, token ids of another batch (``BatchMismatch``). Nothing a neighbour sends is fatal to
  the process.
* ``link_codec``: the activation codec of a link (the subspace basis and the wire dtype).
* Before the handshake completes a connection costs little: frames of at most
  ``HANDSHAKE_MAX_BYTES``, reads of that size, one deadline for the whole handshake.
* With a ``LinkAuth`` (this stage's identity key and the peer id the chain assignment names for
  the neighbour) both ends prove who they are (peer/chain/handshake.py, protocol/chain/link_auth.py):
  a stranger who copies a hello's public fields is rejected.

The errors are in ``peer.chain.errors``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
from dataclasses import dataclass
from typing import Deque, Optional, Tuple

import torch

from peer.chain import handshake
from peer.chain.errors import (BatchMismatch, LinkClosed, LinkError, LinkProtocolError, LinkTimeout, NonFiniteOutput,
                               RoundClosed)
from peer.chain.handshake import LinkAuth
from protocol.chain.activations import ActivationCodec
from protocol.errors import FrameError
from protocol.chain.frames import (
    HANDSHAKE_MAX_BYTES, LINK_VERSION, NONCE_BYTES, Activations, Bye, Close, Frame, FrameDecoder, FrameFormat, Grads, Hello,
    encode_frame,
)
from protocol.chain.subspace import subspace_basis

try:  # pragma: no cover - depends on the platform
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

__all__ = ["StageIdentity", "LinkAuth", "link_codec", "StageLink", "connect_link", "opposite", "run"]

log = logging.getLogger("voloco.pipeline")

READ_BYTES = 1 << 16  # what one read takes from the socket after the handshake


# --- links -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageIdentity:
    """Who this stage is, as its hello says and its neighbours check."""

    run_digest: str
    chain_id: str
    stage: int
    round: int


class _Fp32Codec(ActivationCodec):
    """The codec with fp32 values on the wire (``protocol.chain.frames`` accepts fp32 for uncompressed
    links and debugging; ``ActivationCodec`` itself only speaks 16-bit)."""

    def __init__(self, U: torch.Tensor):
        super().__init__(U, torch.float16)
        self.dtype = torch.float32


def link_codec(d: int, k: int, seed: int, dtype: torch.dtype = torch.float16) -> ActivationCodec:
    """The codec of one link: ``subspace_basis(d, k, seed)`` (the identity when k == d) with
    ``dtype`` values on the wire (fp16, bf16, or fp32 for debugging / exactness checks)."""
    U = subspace_basis(d, k, seed)
    return _Fp32Codec(U) if dtype == torch.float32 else ActivationCodec(U, dtype)


def opposite(role: str) -> str:
    return "downstream" if role == "upstream" else "upstream"


def neighbour_of(stage: int, role: str) -> int:
    """The stage at the other end of a link whose ``role`` end is ``stage``."""
    return stage + 1 if role == "upstream" else stage - 1


class StageLink:
    """One TCP connection to a neighbour stage, after a successful handshake.

    ``role`` is this stage's place on the link, as in ``protocol.chain.frames``: ``"upstream"`` (this
    stage sends activations and receives grads: the link to stage i+1) or ``"downstream"``.
    ``fmt`` bounds the frames (its ``micro_batch`` is the exact number of sequences of every
    frame of a step), ``codec`` encodes/decodes them (both ends must use the same k, dtype,
    seed). ``timeout``: seconds to receive a whole frame (or to flush what we wrote).

    Sends never block the compute (``transport.write`` buffers), so a chain cannot deadlock on
    full socket buffers; ``flush`` waits until the bytes left. After any error the link is
    closed and every later call raises the same error."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        local: StageIdentity,
        role: str,
        fmt: FrameFormat,
        codec: ActivationCodec,
        timeout: float = 30.0,
    ):
        if role not in ("upstream", "downstream"):
            raise ValueError(f"role must be 'upstream' or 'downstream', got {role!r}")
        if codec.k != fmt.k or codec.d != fmt.d_model:
            raise ValueError(f"codec (d {codec.d}, k {codec.k}) does not match the frame format (d {fmt.d_model}, k {fmt.k})")
        self.reader, self.writer = reader, writer
        self.local, self.role, self.fmt, self.codec = local, role, fmt, codec
        self.timeout = float(timeout)
        self._decoder = FrameDecoder(fmt, HANDSHAKE_MAX_BYTES)  # until handshake_done()
        self._read_bytes = HANDSHAKE_MAX_BYTES
        self._frames: Deque[Frame] = collections.deque()
        self._error: Optional[LinkError] = None
        self.bytes_sent = 0
        self.bytes_received = 0
        try:
            peer = writer.get_extra_info("peername")
        except Exception:  # pragma: no cover
            peer = None
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer)

    @property
    def neighbour_stage(self) -> int:
        """The stage at the other end of this end's identity (a listener's link takes the listener's
        identity when it answers the hello: peer/chain/listener.py)."""
        return neighbour_of(self.local.stage, self.role)

    @property
    def name(self) -> str:
        return f"stage {self.local.stage} <-> stage {self.neighbour_stage} ({self.peer})"

    @property
    def closed(self) -> bool:
        return self._error is not None

    def handshake_done(self) -> None:
        """From now on frames may be as large as the format allows."""
        self._decoder.max_frame_bytes = self.fmt.max_frame_bytes
        self._read_bytes = READ_BYTES

    # -- failure --------------------------------------------------------------------------------
    def _fail(self, exc: LinkError, level: int = logging.WARNING) -> LinkError:
        if self._error is None:
            self._error = exc
            log.log(level, "chain %s: closing link %s: %s", self.local.chain_id, self.name, exc.reason)
            self._close_transport()
        return self._error

    def _close_transport(self) -> None:
        try:
            self.writer.close()
        except Exception:  # pragma: no cover - closing a broken transport
            pass

    def _check_open(self) -> None:
        if self._error is not None:
            raise self._error

    # -- sending --------------------------------------------------------------------------------
    def send(self, frame: Frame) -> None:
        """Queue one frame for sending (never blocks)."""
        self._check_open()
        data = encode_frame(frame, self.fmt)
        if self.writer.is_closing():
            raise self._fail(LinkClosed("connection closed by the neighbour", self))
        self.writer.write(data)
        self.bytes_sent += len(data)

    async def flush(self, timeout: Optional[float] = None) -> None:
        """Wait until the kernel took what we wrote (back-pressure from a slow neighbour)."""
        self._check_open()
        try:
            await asyncio.wait_for(self.writer.drain(), self.timeout if timeout is None else timeout)
        except asyncio.TimeoutError:
            raise self._fail(LinkTimeout(f"neighbour did not read our frames within {self.timeout:g} s", self)) from None
        except (ConnectionError, OSError) as e:
            raise self._fail(LinkClosed(f"connection lost while sending: {e}", self)) from None

    def _encoded(self, where: str, encode, *args: torch.Tensor) -> torch.Tensor:
        """The codec's output; its ValueError (shapes were checked by the caller: values that
        are not finite in the wire dtype, NaN or overflow, which the message tells apart) closes the
        link. ``where``: the step and micro-batch, for the log."""
        self._check_open()
        try:
            return encode(*args)
        except ValueError as e:
            raise self._fail(NonFiniteOutput(f"cannot send {where}: {e}", self)) from e

    def send_activations(self, step: int, mb: int, tokens: torch.Tensor, h: torch.Tensor, T: torch.Tensor) -> None:
        """Encode the boundary activation ``h`` (b, S, d) against ``T`` and send it with its ids."""
        values = self._encoded(f"step {step} micro-batch {mb}", self.codec.encode_forward, h, tokens, T)
        self.send(Activations(mb, step, tokens, values))

    def send_grads(self, step: int, mb: int, g: torch.Tensor) -> None:
        self.send(Grads(mb, step, self._encoded(f"step {step} micro-batch {mb}", self.codec.encode_backward, g)))

    def send_close(self, step: int) -> None:
        """Tell the next stage the round ends before ``step``: no frames of that step will come."""
        self.send(Close(step))

    # -- receiving ------------------------------------------------------------------------------
    async def _recv_frame(self, timeout: Optional[float]) -> Frame:
        """The next frame, whatever its type; the deadline covers the whole frame."""
        self._check_open()
        if self._frames:
            return self._frames.popleft()
        limit = self.timeout if timeout is None else timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        while not self._frames:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise self._timeout(limit)
            try:
                data = await asyncio.wait_for(self.reader.read(self._read_bytes), remaining)
            except asyncio.TimeoutError:
                raise self._timeout(limit) from None
            except (ConnectionError, OSError) as e:
                raise self._fail(LinkClosed(f"connection lost: {e}", self)) from None
            if not data:
                if self._decoder.buffered:
                    raise self._fail(
                        LinkProtocolError(f"truncated frame: connection closed with {self._decoder.buffered} bytes of a frame", self)
                    )
                raise self._fail(LinkClosed("connection closed by the neighbour", self))
            self.bytes_received += len(data)
            try:
                self._frames.extend(self._decoder.feed(data))
            except FrameError as e:
                raise self._fail(LinkProtocolError(f"bad frame: {e}", self)) from e
        return self._frames.popleft()

    def _timeout(self, limit: float) -> LinkError:
        partial = f" ({self._decoder.buffered} bytes of a frame received)" if self._decoder.buffered else ""
        return self._fail(LinkTimeout(f"no complete frame within {limit:g} s{partial}", self))

    async def recv(self, timeout: Optional[float] = None, close_before: Optional[int] = None, close_from: int = 0) -> Frame:
        """The next data frame (activations or grads). ``bye`` -> LinkClosed, a handshake frame
        in the middle of the stream -> LinkProtocolError. With ``close_before`` (a step's first
        activations are due), ``close`` of that step -> RoundClosed, the link left open, unless that
        step is under ``close_from`` (the round's floor of steps): LinkProtocolError."""
        frame = await self._recv_frame(timeout)
        if isinstance(frame, Bye):
            raise self._fail(LinkClosed("neighbour said bye", self), logging.INFO)
        if isinstance(frame, Close) and close_before is not None and self.role == "downstream":
            if frame.step != close_before:
                raise self._fail(LinkProtocolError(f"close before step {frame.step}, expected step {close_before}", self))
            if frame.step < close_from:  # what no honest first stage sends: not passed on down the chain
                raise self._fail(LinkProtocolError(f"close before step {frame.step}, under the round's floor "
                                                   f"(no close before step {close_from})", self))
            raise RoundClosed(frame.step)
        if not isinstance(frame, (Activations, Grads)):
            raise self._fail(LinkProtocolError(f"unexpected {type(frame).__name__} frame after the handshake", self))
        return frame

    def _expect(self, frame: Frame, kind: type, step: int, mb: int) -> None:
        what = "activations" if kind is Activations else "grads"
        if not isinstance(frame, kind):
            raise self._fail(LinkProtocolError(f"expected {what}, got {type(frame).__name__}", self))
        if frame.step != step or frame.mb != mb:
            raise self._fail(
                LinkProtocolError(f"expected {what} of step {step} micro-batch {mb}, got step {frame.step} micro-batch {frame.mb}", self)
            )
        shape = (self.fmt.micro_batch, self.fmt.seq_len, self.fmt.k)
        if tuple(frame.values.shape) != shape:
            raise self._fail(LinkProtocolError(f"{what} of shape {tuple(frame.values.shape)}, expected {shape}", self))
        if frame.values.dtype != self.codec.dtype:
            raise self._fail(LinkProtocolError(f"{what} in {frame.values.dtype}, this link uses {self.codec.dtype}", self))

    def _decoded(self, what: str, decode, *args: torch.Tensor) -> torch.Tensor:
        """The codec's decoding of a checked frame; whatever it raises, or a non-finite result,
        is the neighbour's doing (``T`` was checked by the caller) and closes the link."""
        try:
            out = decode(*args)
        except (ValueError, IndexError) as e:
            raise self._fail(LinkProtocolError(f"undecodable {what}: {e}", self)) from e
        if not torch.isfinite(out).all():
            raise self._fail(LinkProtocolError(f"{what} decode to non-finite values", self))
        return out

    async def recv_activations(
        self, step: int, mb: int, T: torch.Tensor, expect_tokens: Optional[torch.Tensor] = None, close_from: int = 0
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """(token ids (b, S) int64 on the CPU, decoded h (b, S, d) float32 on T's device) of micro-batch ``mb``. With
        ``expect_tokens``, ids that differ raise BatchMismatch (and close the link). At micro-batch 0,
        the previous stage's ``close`` of this step raises RoundClosed (the link stays open), if
        ``step`` is at least ``close_from``."""
        frame = await self.recv(close_before=step if mb == 0 else None, close_from=close_from)
        self._expect(frame, Activations, step, mb)
        if expect_tokens is not None and not torch.equal(frame.tokens, expect_tokens.to("cpu", frame.tokens.dtype)):
            raise self._fail(
                BatchMismatch(f"micro-batch {mb} of step {step}: the token ids from stage {self.neighbour_stage} are not this stage's batch", self)
            )
        return frame.tokens, self._decoded("activations", self.codec.decode_forward, frame.values, frame.tokens, T)

    async def recv_grads(self, step: int, mb: int, device: Optional[torch.device] = None) -> torch.Tensor:
        """The decoded gradient (b, S, d) float32 for micro-batch ``mb``, on ``device`` (default: the CPU)."""
        frame = await self.recv()
        self._expect(frame, Grads, step, mb)
        return self._decoded("grads", self.codec.decode_backward, frame.values, device)

    # -- closing --------------------------------------------------------------------------------
    async def close(self, bye: bool = True) -> None:
        """Say bye (best effort) and close; later calls raise LinkClosed."""
        if self._error is not None:
            return
        if bye:
            try:
                self.writer.write(encode_frame(Bye()))
                await asyncio.wait_for(self.writer.drain(), 1.0)
            except Exception:
                pass
        self._error = LinkClosed("closed by this stage", self)
        self._close_transport()
        try:
            await asyncio.wait_for(self.writer.wait_closed(), 1.0)
        except Exception:
            pass


def _hello(local: StageIdentity, role: str, nonce: bytes = b"") -> Hello:
    return Hello(run=local.run_digest, chain=local.chain_id, stage=local.stage, round=local.round, role=role,
                 version=LINK_VERSION, nonce=nonce)


async def connect_link(
    host: str, port: int, *, local: StageIdentity, role: str, fmt: FrameFormat, codec: ActivationCodec,
    timeout: float = 30.0, handshake_timeout: float = 10.0, auth: Optional[LinkAuth] = None,
) -> StageLink:
    """Dial a neighbour's listener, send our hello, wait for hello_ok. ``role`` is ours on the
    link (``"upstream"`` when dialling stage i+1). With ``auth``, the listener must prove it is
    ``auth.neighbour`` and we prove who we are. Raises HandshakeRejected (with the listener's
    reason), LinkTimeout, LinkClosed or LinkProtocolError; OSError if nothing listens."""
    deadline = asyncio.get_running_loop().time() + handshake_timeout
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), handshake_timeout)
    link = StageLink(reader, writer, local=local, role=role, fmt=fmt, codec=codec, timeout=timeout)
    hello = _hello(local, role, os.urandom(NONCE_BYTES) if auth is not None else b"")
    link.send(hello)
    await handshake.dial(link, hello, auth, deadline)
    link.handshake_done()
    return link


def run(coro):
    """Run a coroutine on uvloop where installed, else on asyncio's default loop."""
    if uvloop is not None:
        return uvloop.run(coro)
    return asyncio.run(coro)  # pragma: no cover

