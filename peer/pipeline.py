"""One pipeline stage of a chain: its share of the model, its links to its neighbours, one step.

A chain (ALGORITHMS.md section 5) is one replica cut into stages, one low-resource peer each;
stage ``i`` owns blocks ``[start, end)``, stage 0 also the embedding and the last stage the final
norm and head (``protocol.chains.stage_shapes``). This module is the engine a stage runs:

* ``StageModel``: the tensors one stage owns, under the full model's names
  (``blocks.3.attn.qkv.weight``), initialised bit-identically to ``build_model`` without ever
  materialising the rest of the model.
* ``StageLink``: a TCP connection to one neighbour, over asyncio streams (uvloop where
  installed: ``run``), speaking ``protocol.frames``. ``connect_link`` dials a neighbour;
  ``StageListener`` accepts them, checks each ``hello`` (run digest, chain id, stage index,
  round, protocol version) and answers ``reject`` with the reason to anything else, then keeps
  listening. Every read has a deadline per frame, so a dead or stalled neighbour (or one that
  trickles bytes) is detected; any bad byte (``FrameError``: truncated, oversized, wrong shape,
  non-finite values, out-of-range token ids) closes that connection with a logged reason and
  surfaces as a ``LinkError`` subclass to the caller; nothing is fatal to the process.
* ``run_inner_step``: one inner step of the chain with GPipe micro-batching (below).

The schedule of one inner step (every stage calls ``run_inner_step`` with the same ``step``)::

    stage 0        for mb in 0..M-1: h = embed(x_mb); out_mb = blocks(h); send c = enc(out_mb)
    stage 0<i<S-1  for mb: h = dec(c); out_mb = blocks(h); send enc(out_mb)
                   for mb: g = dec(grads); out_mb.backward(g); send enc(h.grad) upstream
    stage S-1      for mb: h = dec(c); loss_mb = head(blocks(h), y_mb) / M; backward;
                   send enc(h.grad) upstream                    (one-forward-one-backward)
    stage 0        for mb: g = dec(grads); out_mb.backward(g)
    every stage    clip its own gradients; optimizer step on its own parameters

Micro-batches are processed in order 0..M-1 at every stage, forward and backward, so each
stage accumulates its parameter gradients in the same order as one process running the M
micro-batches one after another (what ``tests/test_pipeline.py`` compares against). The loss of
a micro-batch is scaled by 1/M: the sum of the gradients is the gradient of the whole batch's
mean loss (micro-batches have equal sizes). A step that fails half-way (a ``LinkError``) leaves
the parameters and the optimizer state untouched: the update happens only after all M
micro-batches went through.

Gradient clipping is per stage: each stage clips the norm of its own gradients to
``inner.grad_clip``. Global-norm clipping (what ``InnerTrainer`` does for a full replica) would
need every stage to know the norm of the whole model's gradient, i.e. one more exchange per step
(the sums of squares travel down the chain and the total back up, or an all-reduce), and the
frame protocol has no frame for it today. Per-stage clipping bounds the global norm by
``grad_clip * sqrt(S)``; with the usual clip of 1.0 it is rarely active after warm-up anyway.

Targets: an ``activations`` frame carries the token ids of x only (``protocol.frames`` has no
field for y), so the last stage takes the batch from its caller (a chain's stages draw the same
batch stream) and checks that the ids it receives are its own x. See ``run_inner_step``.

T (the embedding at the last outer step, the codec's anchor) is an argument: both ends of a link
must use the same bits of it, so the caller refreshes it after every outer step on every stage,
including stages that do not own the embedding. Frames carry the step number
(``trainer.step_count``, which keeps growing across rounds), and a frame of another step is
refused; a link's hello pins the round (open new links for a new round to re-check it).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
from dataclasses import dataclass
from typing import Any, Deque, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from peer.model import Block, Model, RMSNorm, _exact_normal, rope_cache
from protocol import PROTOCOL_VERSION
from protocol.activations import (
    ActivationCodec,
    constrain_to_subspace_,
    project_gradients_,
    subspace_basis,
)
from protocol.errors import FrameError
from protocol.frames import (
    Activations,
    Bye,
    Frame,
    FrameDecoder,
    FrameFormat,
    Grads,
    Hello,
    HelloOk,
    Reject,
    check_hello,
    encode_frame,
)
from protocol.spec import ModelSpec, RunSpec

try:  # pragma: no cover - depends on the platform
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

__all__ = [
    "StageModel",
    "init_stage_parameters",
    "StageIdentity",
    "StageError",
    "LinkError",
    "LinkProtocolError",
    "HandshakeRejected",
    "LinkTimeout",
    "LinkClosed",
    "BatchMismatch",
    "link_codec",
    "StageLink",
    "StageListener",
    "connect_link",
    "run_inner_step",
    "run",
]

log = logging.getLogger("voloco.pipeline")

_INIT_CHUNK = 1 << 20  # peer/model.py's _exact_normal draws in chunks of this many values


# --- the stage's share of the model --------------------------------------------------------------


class StageModel(nn.Module):
    """Blocks ``[start, end)`` of the model, with the embedding if ``start == 0`` and the final
    norm and head if ``end == n_layers``; parameter names and order are the full model's
    (``protocol.chains.stage_shapes``), so payloads, state dicts and checkpoints match.

    The modules are created on the meta device and only the owned tensors are allocated, then
    ``init_stage_parameters`` fills them with exactly the bits ``build_model(spec, seed)`` gives
    (``seed=None``: left uninitialised, e.g. to load a state dict). Memory peak: the owned
    parameters, plus during init one fp32 copy of the largest owned tensor (``_exact_normal``
    returns a fresh tensor) and the scratch of one draw chunk (2^20 values: ~52 MiB of int64
    and float64 temporaries); the other stages' tensors are never allocated."""

    def __init__(
        self,
        spec: ModelSpec,
        start: int,
        end: int,
        seed: Optional[int] = 0,
        mlp_slices: int = 1,
        attn_slices: int = 1,
    ):
        super().__init__()
        spec.check()
        spec.check_slices(mlp_slices, attn_slices)
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= spec.n_layers):
            raise ValueError(f"block range [{start}, {end}) is not a non-empty part of [0, {spec.n_layers})")
        self.spec = spec
        self.start, self.end = start, end
        self.mlp_slices, self.attn_slices = mlp_slices, attn_slices
        self.is_first, self.is_last = start == 0, end == spec.n_layers
        with torch.device("meta"):  # no allocation and no RNG use: only the owned tensors get memory
            if self.is_first:
                self.embed = nn.Embedding(spec.vocab_size, spec.d_model)
            # a ModuleDict keyed by the global index keeps the full model's names: blocks.{i}.*
            self.blocks = nn.ModuleDict({str(i): Block(spec, mlp_slices, attn_slices) for i in range(start, end)})
            if self.is_last:
                self.norm = RMSNorm(spec.d_model, spec.norm_eps)
                self.head = nn.Linear(spec.d_model, spec.vocab_size, bias=False)
        self.to_empty(device="cpu")
        cos, sin = rope_cache(spec.d_model // spec.n_heads, spec.seq_len, spec.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if seed is not None:
            init_stage_parameters(self, seed)

    @classmethod
    def for_run(cls, spec: RunSpec, start: int, end: int, init: bool = True) -> "StageModel":
        """The stage of ``spec``'s model (its seed and partial-update slicing)."""
        return cls(spec.model, start, end, spec.seed if init else None, spec.partial.slices, spec.partial.attn_slices)

    @classmethod
    @torch.no_grad()
    def from_model(cls, model: Model, start: int, end: int) -> "StageModel":
        """A copy of blocks ``[start, end)`` (and embedding / head as owned) of a full model."""
        first_mlp = model.blocks[0].mlp
        stage = cls(model.spec, start, end, None, first_mlp.slices, model.blocks[0].attn.slices)
        full = dict(model.named_parameters())
        for name, p in stage.named_parameters():
            p.copy_(full[name])
        return stage

    def param_shapes(self):
        """Owned tensors by name, in the model's order (equals ``stage_shapes`` of the run)."""
        return {name: tuple(p.shape) for name, p in self.named_parameters()}

    # the three parts of Model's forward, with Model's own code where it only reads owned modules
    def embed_tokens(self, idx: torch.Tensor) -> torch.Tensor:
        if not self.is_first:
            raise RuntimeError(f"stage [{self.start}, {self.end}) does not own the embedding")
        return Model.embed_tokens(self, idx)

    def forward_blocks(self, h: torch.Tensor) -> torch.Tensor:
        T = h.shape[1]
        if T > self.spec.seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than model.seq_len={self.spec.seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        for block in self.blocks.values():
            h = block(h, cos, sin)
        return h

    def forward_head(self, h: torch.Tensor, targets: Optional[torch.Tensor] = None):
        if not self.is_last:
            raise RuntimeError(f"stage [{self.start}, {self.end}) does not own the head")
        return Model.forward_head(self, h, targets)


@torch.no_grad()
def init_stage_parameters(stage: StageModel, seed: int) -> None:
    """``init_parameters`` of peer/model.py restricted to the stage: walk the full model's tensors
    in order on one generator seeded with ``seed``; draw the owned ones exactly as
    ``_exact_normal`` does and replay (draw into a reused buffer, then drop) the draws of the
    others, with the same call shapes, so the generator is where it would be."""
    spec = stage.spec
    generator = torch.Generator(device="cpu").manual_seed(int(seed))
    residual_std = spec.init_std / math.sqrt(2 * spec.n_layers)
    own = dict(stage.named_parameters())
    scratch: Optional[torch.Tensor] = None
    for name, shape in spec.param_shapes(stage.mlp_slices, stage.attn_slices).items():
        p = own.get(name)
        if len(shape) == 1:  # norm weights: ones, no draw
            if p is not None:
                p.fill_(1.0)
            continue
        if p is not None:
            std = residual_std if (".attn.out." in name or ".mlp.down." in name) else spec.init_std
            p.copy_(_exact_normal(tuple(shape), std, generator))
            continue
        n = math.prod(shape)
        for start in range(0, n, _INIT_CHUNK):
            m = min(_INIT_CHUNK, n - start)
            if scratch is None or scratch.shape[0] != m:
                scratch = torch.empty((m, 3), dtype=torch.int64)
            torch.randint(0, 1 << 62, (m, 3), dtype=torch.int64, generator=generator, out=scratch)
    missing = set(own) - set(spec.param_shapes(stage.mlp_slices, stage.attn_slices))
    if missing:  # pragma: no cover - StageModel and ModelSpec disagree on names
        raise RuntimeError(f"stage parameters unknown to the spec: {sorted(missing)}")


# --- errors -------------------------------------------------------------------------------------


class StageError(Exception):
    """A pipeline step could not complete; the process is fine, the step did not happen."""


class LinkError(StageError):
    """A link to a neighbour failed; it has been closed. ``reason`` is what was logged."""

    def __init__(self, reason: str, link: Optional["StageLink"] = None):
        self.reason = reason
        self.link = link
        super().__init__(f"{link.name}: {reason}" if link is not None else reason)


class LinkProtocolError(LinkError, FrameError):
    """The neighbour sent bytes that break the protocol (``__cause__`` is the decoder's
    FrameError when there is one); also a ``FrameError``, so ``except ProtocolError`` sees it."""


class HandshakeRejected(LinkProtocolError):
    """Our hello was refused by the listener (``reason`` is what it sent back)."""


class LinkTimeout(LinkError):
    """No complete frame from the neighbour within the read deadline (dead or stalled)."""


class LinkClosed(LinkError):
    """The neighbour closed the connection (or said bye) between frames."""


class BatchMismatch(StageError):
    """The token ids that reached the last stage are not those of the batch it was given."""


# --- links -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageIdentity:
    """Who this stage is, as its hello says and its neighbours check."""

    run_digest: str
    chain_id: str
    stage: int
    round: int


class _Fp32Codec(ActivationCodec):
    """The codec with fp32 values on the wire (``protocol.frames`` accepts fp32 for uncompressed
    links and debugging; ``ActivationCodec`` itself only speaks 16-bit)."""

    def __init__(self, U: torch.Tensor):
        super().__init__(U, torch.float16)
        self.dtype = torch.float32


def link_codec(d: int, k: int, seed: int, dtype: torch.dtype = torch.float16) -> ActivationCodec:
    """The codec of one link: ``subspace_basis(d, k, seed)`` (the identity when k == d) with
    ``dtype`` values on the wire (fp16, bf16, or fp32 for debugging / exactness checks)."""
    U = subspace_basis(d, k, seed)
    return _Fp32Codec(U) if dtype == torch.float32 else ActivationCodec(U, dtype)


def _opposite(role: str) -> str:
    return "downstream" if role == "upstream" else "upstream"


class StageLink:
    """One TCP connection to a neighbour stage, after a successful handshake.

    ``role`` is this stage's place on the link, as in ``protocol.frames``: ``"upstream"`` (this
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
        self.neighbour_stage = local.stage + 1 if role == "upstream" else local.stage - 1
        self._decoder = FrameDecoder(fmt)
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
    def name(self) -> str:
        return f"stage {self.local.stage} <-> stage {self.neighbour_stage} ({self.peer})"

    @property
    def closed(self) -> bool:
        return self._error is not None

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

    def send_activations(self, step: int, mb: int, tokens: torch.Tensor, h: torch.Tensor, T: torch.Tensor) -> None:
        """Encode the boundary activation ``h`` (b, S, d) against ``T`` and send it with its ids."""
        self.send(Activations(mb, step, tokens, self.codec.encode_forward(h, tokens, T)))

    def send_grads(self, step: int, mb: int, g: torch.Tensor) -> None:
        self.send(Grads(mb, step, self.codec.encode_backward(g)))

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
                data = await asyncio.wait_for(self.reader.read(1 << 16), remaining)
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

    async def recv(self, timeout: Optional[float] = None) -> Frame:
        """The next data frame (activations or grads). ``bye`` -> LinkClosed, a handshake frame
        in the middle of the stream -> LinkProtocolError."""
        frame = await self._recv_frame(timeout)
        if isinstance(frame, Bye):
            raise self._fail(LinkClosed("neighbour said bye", self), logging.INFO)
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

    async def recv_activations(self, step: int, mb: int, T: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(token ids (b, S) int64, decoded h (b, S, d) float32) of micro-batch ``mb``."""
        frame = await self.recv()
        self._expect(frame, Activations, step, mb)
        return frame.tokens, self.codec.decode_forward(frame.values, frame.tokens, T)

    async def recv_grads(self, step: int, mb: int) -> torch.Tensor:
        """The decoded gradient (b, S, d) float32 for micro-batch ``mb``."""
        frame = await self.recv()
        self._expect(frame, Grads, step, mb)
        return self.codec.decode_backward(frame.values)

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


def _hello(local: StageIdentity, role: str) -> Hello:
    return Hello(run=local.run_digest, chain=local.chain_id, stage=local.stage, round=local.round, role=role, version=PROTOCOL_VERSION)


async def connect_link(
    host: str,
    port: int,
    *,
    local: StageIdentity,
    role: str,
    fmt: FrameFormat,
    codec: ActivationCodec,
    timeout: float = 30.0,
    handshake_timeout: float = 10.0,
) -> StageLink:
    """Dial a neighbour's listener, send our hello, wait for hello_ok. ``role`` is ours on the
    link (``"upstream"`` when dialling stage i+1). Raises HandshakeRejected (with the listener's
    reason), LinkTimeout, LinkClosed or LinkProtocolError; OSError if nothing listens."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), handshake_timeout)
    link = StageLink(reader, writer, local=local, role=role, fmt=fmt, codec=codec, timeout=timeout)
    link.send(_hello(local, role))
    frame = await link._recv_frame(handshake_timeout)
    if isinstance(frame, Reject):
        raise link._fail(HandshakeRejected(f"neighbour rejected our hello: {frame.reason}", link))
    if not isinstance(frame, HelloOk):
        raise link._fail(LinkProtocolError(f"expected hello_ok, got {type(frame).__name__}", link))
    return link


class StageListener:
    """Accepts neighbours on a TCP port: each connection must open with a valid hello from the
    expected neighbour (stage ``local.stage - 1`` if ``role`` is ``"downstream"``, else
    ``local.stage + 1``), same run digest, chain, round and protocol version. A bad hello is
    answered with ``reject`` + the reason, logged, appended to ``rejected`` and closed; the
    listener keeps accepting. Good links queue up for ``accept``."""

    def __init__(
        self,
        *,
        local: StageIdentity,
        role: str,
        fmt: FrameFormat,
        codec: ActivationCodec,
        timeout: float = 30.0,
        handshake_timeout: float = 10.0,
    ):
        if role not in ("upstream", "downstream"):
            raise ValueError(f"role must be 'upstream' or 'downstream', got {role!r}")
        self.local, self.role, self.fmt, self.codec = local, role, fmt, codec
        self.timeout, self.handshake_timeout = timeout, handshake_timeout
        self.rejected: List[str] = []
        self._queue: "asyncio.Queue[StageLink]" = asyncio.Queue()
        self._server: Optional[asyncio.AbstractServer] = None
        self._handshakes: set = set()

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
        task = asyncio.current_task()
        self._handshakes.add(task)
        try:
            link = StageLink(reader, writer, local=self.local, role=self.role, fmt=self.fmt, codec=self.codec, timeout=self.timeout)
            try:
                frame = await link._recv_frame(self.handshake_timeout)
                check_hello(
                    frame,
                    run_digest=self.local.run_digest,
                    chain_id=self.local.chain_id,
                    stage=link.neighbour_stage,
                    round=self.local.round,
                    role=_opposite(self.role),
                )
            except FrameError as e:  # a well-formed hello from the wrong neighbour
                reason = f"rejected hello: {e}"
                self.rejected.append(reason)
                try:
                    writer.write(encode_frame(Reject(str(e))))
                except Exception:  # pragma: no cover
                    pass
                link._fail(LinkProtocolError(reason, link))
                return
            except LinkError as e:  # garbage, timeout, closed before the hello
                self.rejected.append(f"handshake failed: {e.reason}")
                return
            link.send(HelloOk())
            self._queue.put_nowait(link)
        finally:
            self._handshakes.discard(task)

    async def accept(self, timeout: Optional[float] = None) -> StageLink:
        """The next neighbour that passed the handshake (asyncio.TimeoutError after ``timeout``)."""
        return await asyncio.wait_for(self._queue.get(), timeout)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for task in list(self._handshakes):
            task.cancel()
        while not self._queue.empty():
            await self._queue.get_nowait().close(bye=False)


def run(coro):
    """Run a coroutine on uvloop where installed, else on asyncio's default loop."""
    if uvloop is not None:
        return uvloop.run(coro)
    return asyncio.run(coro)  # pragma: no cover


# --- one inner step ------------------------------------------------------------------------------


def _split(t: torch.Tensor, m: int) -> List[torch.Tensor]:
    if t.shape[0] % m:
        raise ValueError(f"batch of {t.shape[0]} sequences does not split into {m} equal micro-batches")
    return list(t.chunk(m, dim=0))


def _set_lr(trainer: Any) -> None:
    lr = trainer.lr
    for group in trainer.optimizer.param_groups:
        group["lr"] = lr


async def run_inner_step(
    stage: StageModel,
    trainer: Any,
    *,
    T: torch.Tensor,
    micro_batches: int,
    batch: Optional[Tuple[Optional[torch.Tensor], torch.Tensor]] = None,
    upstream: Optional[StageLink] = None,
    downstream: Optional[StageLink] = None,
    constraint: Optional[torch.Tensor] = None,
    step: Optional[int] = None,
) -> Optional[float]:
    """One inner step of this stage of a chain; returns the batch's mean loss on the last stage,
    None elsewhere. Every stage of the chain calls it with the same ``step`` and ``micro_batches``.

    ``trainer``: an ``InnerTrainer`` built on ``stage`` (or anything with its ``optimizer``,
    ``params``, ``lr``, ``spec.grad_clip`` and ``step_count``): the learning-rate schedule,
    AdamW on this stage's parameters only, the step counter. ``T``: the codec's anchor (see the
    module docstring). ``batch``: ``(x, y)`` (B, S) int64 on the first stage (required) and on
    the last (its ``y`` gives the targets; its ``x``, if not None, is checked against the ids
    that arrive: BatchMismatch otherwise); None on middle stages. ``upstream``/``downstream``:
    the links to stages i-1 / i+1 (None at the ends; a single-stage chain has neither).
    ``constraint``: U of the lossless variant (protocol/activations.py): gradients of the output
    projections and of the embedding are projected before the clip and the weights after the
    update; None to train unconstrained. ``step``: the id frames carry (default
    ``trainer.step_count``).

    Raises LinkError subclasses for a failing neighbour (the link is closed, the parameters and
    optimizer state unchanged, the gradients cleared), BatchMismatch, ValueError for bad args."""
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be a positive integer, got {micro_batches!r}")
    if (upstream is None) != stage.is_first or (downstream is None) != stage.is_last:
        raise ValueError(
            f"stage [{stage.start}, {stage.end}) needs {'no' if stage.is_first else 'an'} upstream link and "
            f"{'no' if stage.is_last else 'a'} downstream link"
        )
    for link, role in ((upstream, "downstream"), (downstream, "upstream")):
        if link is not None and link.role != role:
            raise ValueError(f"link {link.name} has role {link.role}, expected {role}")
    M = micro_batches
    step = trainer.step_count if step is None else step
    xs: Sequence[Optional[torch.Tensor]] = [None] * M
    ys: Sequence[Optional[torch.Tensor]] = [None] * M
    if stage.is_first or stage.is_last:
        if batch is None:
            raise ValueError("the first and the last stage need the batch (x, y)")
        x, y = batch
        if stage.is_first and x is None:
            raise ValueError("the first stage needs the inputs x")
        xs = _split(x, M) if x is not None else xs
        ys = _split(y, M)
    for link in (upstream, downstream):
        if link is not None and stage.is_first and xs[0].shape[0] != link.fmt.micro_batch:
            raise ValueError(f"micro-batches of {xs[0].shape[0]} sequences, the link's format says {link.fmt.micro_batch}")

    trainer.optimizer.zero_grad(set_to_none=True)
    stage.train()
    try:
        loss = await _pipeline_pass(stage, T, M, step, xs, ys, upstream, downstream)
    except BaseException:
        trainer.optimizer.zero_grad(set_to_none=True)
        raise

    named = list(stage.named_parameters())
    if constraint is not None:
        project_gradients_(named, constraint)
    _set_lr(trainer)
    torch.nn.utils.clip_grad_norm_(trainer.params, trainer.spec.grad_clip)
    trainer.optimizer.step()
    trainer.step_count += 1
    if constraint is not None:
        constrain_to_subspace_(named, constraint, T if stage.is_first else None)
    for link in (upstream, downstream):
        if link is not None:
            await link.flush()
    return loss


async def _pipeline_pass(
    stage: StageModel,
    T: torch.Tensor,
    M: int,
    step: int,
    xs: Sequence[Optional[torch.Tensor]],
    ys: Sequence[Optional[torch.Tensor]],
    upstream: Optional[StageLink],
    downstream: Optional[StageLink],
) -> Optional[float]:
    """Forward and backward of the M micro-batches; gradients accumulate in the parameters."""
    if stage.is_last:
        total = 0.0
        for mb in range(M):  # one forward, one backward: only one micro-batch's graph alive
            h_in, _, h = await _stage_input(stage, T, step, mb, xs[mb], upstream)
            _, loss = stage.forward_head(stage.forward_blocks(h), ys[mb])
            (loss / M).backward()
            total += loss.item()
            if upstream is not None:
                upstream.send_grads(step, mb, h_in.grad)
        return total / M

    outs: List[Optional[torch.Tensor]] = []
    ins: List[Optional[torch.Tensor]] = []
    for mb in range(M):  # GPipe: every forward first, the graphs of all M micro-batches alive
        h_in, tokens, h = await _stage_input(stage, T, step, mb, xs[mb], upstream)
        out = stage.forward_blocks(h)
        downstream.send_activations(step, mb, tokens, out, T)
        outs.append(out)
        ins.append(h_in)
    for mb in range(M):
        g = await downstream.recv_grads(step, mb)
        outs[mb].backward(g.to(outs[mb].dtype))
        outs[mb] = None
        if upstream is not None:
            upstream.send_grads(step, mb, ins[mb].grad)
        ins[mb] = None
    return None


async def _stage_input(stage, T, step, mb, x, upstream):
    """(leaf input whose .grad goes upstream, or None on the first stage; the micro-batch's token
    ids; the hidden state to run the blocks on)."""
    if upstream is None:
        return None, x, stage.embed_tokens(x)
    tokens, h = await upstream.recv_activations(step, mb, T)
    if x is not None and not torch.equal(tokens, x.to(tokens.dtype)):
        raise BatchMismatch(f"micro-batch {mb} of step {step}: the token ids from stage {upstream.neighbour_stage} are not this stage's batch")
    h_in = h.detach().requires_grad_(True)
    return h_in, tokens, h_in
