"""The GPipe schedule of one inner step of a chain stage, over its links to its neighbours.

A chain (docs/chains.md) is one replica cut into stages, one low-resource peer each;
stage ``i`` is a ``peer.training.model.Model`` built with ``blocks=(start, end)``: blocks ``[start, end)``,
stage 0 also the embedding and the last stage the final norm and head. Every stage calls
``run_inner_step`` with the same ``step``::

    stage 0        for mb in 0..M-1: h = embed(x_mb); out_mb = blocks(h); send c = enc(out_mb)
    stage 0<i<S-1  for mb: h = dec(c); out_mb = blocks(h); send enc(out_mb)
                   for mb: g = dec(grads); out_mb.backward(g); send enc(h.grad) upstream
    stage S-1      for mb: h = dec(c); loss_mb = head(blocks(h), y_mb) / M; backward;
                   send enc(h.grad) upstream                    (one-forward-one-backward)
    stage 0        for mb: g = dec(grads); out_mb.backward(g)
    every stage    InnerTrainer.apply_gradients: clip its own gradients, optimizer step

Micro-batches are processed in order 0..M-1 at every stage, forward and backward, so each
stage accumulates its parameter gradients in the same order as one process running the M
micro-batches one after another (what ``tests/chain/test_pipeline.py`` compares against). The loss of
a micro-batch is scaled by 1/M: the sum of the gradients is the gradient of the whole batch's
mean loss (micro-batches have equal sizes). The update is the ordinary inner trainer's
(``InnerTrainer.apply_gradients``), made only after all M micro-batches went through: a step
that fails half-way (any ``StageError``: a neighbour that dies, stalls or sends what this stage
cannot use, non-finite gradients) leaves the parameters and the optimizer state untouched.

Gradient clipping is per stage: each stage clips the norm of its own gradients to
``inner.grad_clip``. Global-norm clipping (what ``InnerTrainer`` does for a full replica) would
need every stage to know the norm of the whole model's gradient, i.e. one more exchange per step
(the sums of squares travel down the chain and the total back up, or an all-reduce), and the
frame protocol has no frame for it today. Per-stage clipping bounds the global norm by
``grad_clip * sqrt(S)``; with the usual clip of 1.0 it is rarely active after warm-up anyway.

Targets: an ``activations`` frame carries the token ids of x only (``protocol.chain.frames`` has no
field for y), so the last stage takes the batch from its caller (a chain's stages draw the same
batch stream) and checks that the ids it receives are its own x (``BatchMismatch``).

Devices: the stage computes where its parameters are (a CUDA stage's forward under the trainer's
bf16 autocast, as a full peer's); the batch and T are moved there, frames leave as CPU bytes and
arrive decoded on the stage's device, so the stages of one chain may sit on different devices.

T (the embedding at the last outer step, the codec's anchor) is an argument: both ends of a link
must use the same bits of it, so the caller refreshes it after every outer step on every stage,
including stages that do not own the embedding. Frames carry the step number
(``trainer.step_count``, which keeps growing across rounds), and a frame of another step is
refused; a link's hello pins the round (open new links for a new round to re-check it).

Early close: the first stage may end a round before H steps (``close_round``: a ``close`` frame where
the next step's activations would go); each later stage's ``run_inner_step`` then raises RoundClosed
before computing anything, after passing the frame on, so every stage takes the same steps.
"""

from __future__ import annotations

import functools
from typing import List, Optional, Sequence, Tuple

import torch

from peer.training.inner import InnerTrainer, autocast_to
from peer.training.model import Model
from peer.chain.errors import NonFiniteGradients, RoundClosed
from peer.chain.links import StageLink
from protocol.chain.subspace_constraint import constrain_to_subspace_, project_gradients_

__all__ = ["run_inner_step", "close_round"]


def _split(t: torch.Tensor, m: int) -> List[torch.Tensor]:
    if t.shape[0] % m:
        raise ValueError(f"batch of {t.shape[0]} sequences does not split into {m} equal micro-batches")
    return list(t.chunk(m, dim=0))


def _check_args(stage: Model, T: torch.Tensor, upstream: Optional[StageLink], downstream: Optional[StageLink]) -> None:
    """ValueError for arguments of this stage's own making, before anything is received: what
    fails after this check is what a neighbour sent."""
    if (upstream is None) != stage.is_first or (downstream is None) != stage.is_last:
        raise ValueError(
            f"stage [{stage.start}, {stage.end}) needs {'no' if stage.is_first else 'an'} upstream link and "
            f"{'no' if stage.is_last else 'a'} downstream link"
        )
    spec = stage.spec
    if T.ndim != 2 or tuple(T.shape) != (spec.vocab_size, spec.d_model):
        raise ValueError(f"T must be the embedding's shape {(spec.vocab_size, spec.d_model)}, got {tuple(T.shape)}")
    for link, role in ((upstream, "downstream"), (downstream, "upstream")):
        if link is not None and link.role != role:
            raise ValueError(f"link {link.name} has role {link.role}, expected {role}")
        if link is not None and (link.fmt.d_model, link.fmt.seq_len) != (spec.d_model, spec.seq_len):
            raise ValueError(f"link {link.name} carries (seq {link.fmt.seq_len}, d {link.fmt.d_model}), the model has (seq {spec.seq_len}, d {spec.d_model})")


async def run_inner_step(
    stage: Model,
    trainer: InnerTrainer,
    *,
    T: torch.Tensor,
    micro_batches: int,
    batch: Optional[Tuple[Optional[torch.Tensor], torch.Tensor]] = None,
    upstream: Optional[StageLink] = None,
    downstream: Optional[StageLink] = None,
    constraint: Optional[torch.Tensor] = None,
    step: Optional[int] = None,
    close_from: int = 0,
) -> Optional[float]:
    """One inner step of this stage of a chain; returns the batch's mean loss on the last stage,
    None elsewhere. Every stage of the chain calls it with the same ``step`` and ``micro_batches``.

    ``stage``: a ``Model`` with a block range. ``trainer``: the ``InnerTrainer`` built on it (the
    learning-rate schedule, AdamW on this stage's parameters only, the step counter). ``T``: the
    codec's anchor (see the module docstring). ``batch``: ``(x, y)`` (B, S) int64 on the first
    stage (required) and on the last (its ``y`` gives the targets; its ``x``, if not None, is
    checked against the ids that arrive: BatchMismatch otherwise); None on middle stages.
    ``upstream``/``downstream``: the links to stages i-1 / i+1 (None at the ends; a single-stage
    chain has neither). ``constraint``: U of the lossless variant (protocol/chain/subspace_constraint.py):
    gradients of the output projections and of the embedding are projected before the clip and
    the weights after the update; None to train unconstrained. ``step``: the id frames carry
    (default ``trainer.step_count``). ``close_from``: the first step the previous stage may close the
    round before (the round's floor of steps); a close under it is a LinkProtocolError.

    Raises a ``StageError`` (a ``LinkError`` subclass for anything about a neighbour: the link is
    closed) with the parameters and optimizer state unchanged and the gradients cleared;
    RoundClosed, after passing it downstream, where the first stage closed the round before
    ``step``; ValueError for bad arguments of the caller."""
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be a positive integer, got {micro_batches!r}")
    _check_args(stage, T, upstream, downstream)
    M = micro_batches
    step = trainer.step_count if step is None else step
    device = next(stage.parameters()).device
    T = T.to(device)
    constraint = None if constraint is None else constraint.to(device)
    xs: Sequence[Optional[torch.Tensor]] = [None] * M
    ys: Sequence[Optional[torch.Tensor]] = [None] * M
    xs_host: Sequence[Optional[torch.Tensor]] = [None] * M
    if stage.is_first or stage.is_last:
        if batch is None:
            raise ValueError("the first and the last stage need the batch (x, y)")
        x, y = batch
        if stage.is_first and x is None:
            raise ValueError("the first stage needs the inputs x")
        if x is not None:  # the ids stay on the CPU too: the frames carry them, the last stage checks them
            xs_host = _split(x.to("cpu"), M)
            xs = [t.to(device) for t in xs_host]
        ys = _split(y.to(device), M)
    for link in (upstream, downstream):
        for t in (xs[0], ys[0]):
            if link is not None and t is not None and tuple(t.shape) != (link.fmt.micro_batch, link.fmt.seq_len):
                raise ValueError(f"micro-batches of shape {tuple(t.shape)}, the link's format says {(link.fmt.micro_batch, link.fmt.seq_len)}")

    named = list(stage.named_parameters())

    def before_clip() -> None:
        if constraint is not None:
            project_gradients_(named, constraint)
        grads = [(n, p.grad) for n, p in named if p.grad is not None]
        if not grads:
            return
        finite = torch.stack([torch.isfinite(g).all() for _, g in grads])  # one device sync, not one per tensor
        if not bool(finite.all()):
            bad = [n for (n, _), ok in zip(grads, finite.tolist()) if not ok]
            raise NonFiniteGradients(f"step {step}: gradients of {len(bad)} tensors are not finite ({bad[0]}, ...)")

    def after_step() -> None:
        if constraint is not None:
            constrain_to_subspace_(named, constraint, T if stage.is_first else None)

    trainer.optimizer.zero_grad(set_to_none=True)
    stage.train()
    try:
        loss = await _pipeline_pass(stage, _autocast(trainer, device), T, M, step, xs, ys, upstream, downstream, close_from,
                                    xs_host)
        trainer.apply_gradients(before_clip, after_step)
    except RoundClosed as closed:  # before anything of the step was computed: pass it on down the chain
        trainer.optimizer.zero_grad(set_to_none=True)
        await close_round(downstream, closed.step)
        raise
    except BaseException:
        trainer.optimizer.zero_grad(set_to_none=True)
        raise
    for link in (upstream, downstream):
        if link is not None:
            await link.flush()
    return loss


async def close_round(downstream: Optional[StageLink], step: int) -> None:
    """End the chain's round before ``step``: the first stage calls it when it closes its round
    early (peer/round/early_close.py), every later stage when that ``close`` reaches it, so all
    stages take the same number of steps."""
    if downstream is not None:
        downstream.send_close(step)
        await downstream.flush()


def _autocast(trainer: InnerTrainer, device: torch.device):
    """What the stage's forward passes run under: the trainer's bf16 autocast where its precision
    says so (a CUDA stage with inner.precision "auto"), else nothing."""
    return functools.partial(autocast_to, device.type, trainer.autocast_dtype)


async def _pipeline_pass(
    stage: Model,
    autocast,
    T: torch.Tensor,
    M: int,
    step: int,
    xs: Sequence[Optional[torch.Tensor]],
    ys: Sequence[Optional[torch.Tensor]],
    upstream: Optional[StageLink],
    downstream: Optional[StageLink],
    close_from: int = 0,
    xs_host: Optional[Sequence[Optional[torch.Tensor]]] = None,
) -> Optional[float]:
    """Forward and backward of the M micro-batches; gradients accumulate in the parameters. ``xs_host``:
    the ids of ``xs`` on the CPU (what frames carry and the last stage compares), if ``xs`` are on a GPU."""
    xs_host = xs_host if xs_host is not None else xs
    if stage.is_last:
        total = 0.0
        for mb in range(M):  # one forward, one backward: only one micro-batch's graph alive
            h_in, _, h = await _stage_input(stage, autocast, T, step, mb, xs[mb], upstream, close_from, xs_host[mb])
            with autocast():
                _, loss = stage.forward_head(stage.forward_blocks(h), ys[mb])
            (loss / M).backward()
            total += loss.item()
            if upstream is not None:
                upstream.send_grads(step, mb, h_in.grad)
        return total / M

    outs: List[Optional[torch.Tensor]] = []
    ins: List[Optional[torch.Tensor]] = []
    for mb in range(M):  # GPipe: every forward first, the graphs of all M micro-batches alive
        h_in, tokens, h = await _stage_input(stage, autocast, T, step, mb, xs[mb], upstream, close_from, xs_host[mb])
        with autocast():
            out = stage.forward_blocks(h)
        downstream.send_activations(step, mb, tokens, out, T)
        outs.append(out)
        ins.append(h_in)
    for mb in range(M):
        g = await downstream.recv_grads(step, mb, outs[mb].device)
        outs[mb].backward(g.to(outs[mb].dtype))
        outs[mb] = None
        if upstream is not None:
            upstream.send_grads(step, mb, ins[mb].grad)
        ins[mb] = None
    return None


async def _stage_input(stage: Model, autocast, T: torch.Tensor, step: int, mb: int, x: Optional[torch.Tensor],
                       upstream: Optional[StageLink], close_from: int = 0, x_host: Optional[torch.Tensor] = None):
    """(leaf input whose .grad goes upstream, or None on the first stage; the micro-batch's token
    ids, on the CPU; the hidden state to run the blocks on). ``x_host``: ``x`` on the CPU, where ``x``
    is on a GPU (no copy back per micro-batch)."""
    x_host = x if x_host is None else x_host
    if upstream is None:
        with autocast():
            return None, x_host, stage.embed_tokens(x)
    tokens, h = await upstream.recv_activations(step, mb, T, expect_tokens=x_host, close_from=close_from)
    h_in = h.detach().requires_grad_(True)
    return h_in, tokens, h_in
