"""A chain replica simulated in one process, as bench/chains.py runs it beside full replicas: its
members (one per stage, each with its round engine), the model both stages train, and one inner step
or evaluation through the compressed stage boundary."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from peer.outer.engine import RoundEngine
from peer.training.data import TrainStream
from peer.training.inner import InnerTrainer
from protocol.chain.activations import compressed_boundary
from protocol.chain.subspace_constraint import constrain_to_subspace_, project_gradients_

Tensors = Dict[str, torch.Tensor]


@dataclass
class Member:
    """One peer of the exchange: a full replica, or one stage of a chain, with its round engine
    (peer/outer/engine.py: its θ and strategy, as on a live peer)."""

    sender: str
    engine: RoundEngine


@dataclass
class Replica:
    name: str
    model: torch.nn.Module
    trainer: InnerTrainer
    stream: TrainStream
    members: List[Member]
    chain: bool
    cut: int = 0  # the stage boundary: blocks [0, cut) | [cut, n_layers)
    codec: Any = None
    U: Optional[torch.Tensor] = None  # the constraint (k < d)
    groups: List[List[torch.nn.Parameter]] = field(default_factory=list)  # per-stage clip groups
    T: Optional[torch.Tensor] = None
    start: Optional[Tensors] = None


def chain_forward(model, x, y, codec, T, cut):
    h = model.forward_blocks(model.embed_tokens(x), 0, cut)
    h = compressed_boundary(h, x, T, codec)
    return model.forward_head(model.forward_blocks(h, cut, None), y)


def chain_step(rep: Replica, x: torch.Tensor, y: torch.Tensor, micro_batches: int) -> float:
    """``peer.chain.gpipe.run_inner_step`` of both stages, in one process (tests/chain/test_pipeline.py's
    reference, which it checks against the TCP chain)."""
    trainer, model = rep.trainer, rep.model
    trainer.optimizer.zero_grad(set_to_none=True)
    model.train()
    total = 0.0
    for xm, ym in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
        _, loss = chain_forward(model, xm, ym, rep.codec, rep.T, rep.cut)
        (loss / micro_batches).backward()
        total += loss.item()
    named = list(model.named_parameters())
    project = (lambda: project_gradients_(named, rep.U)) if rep.U is not None else None
    constrain = (lambda: constrain_to_subspace_(named, rep.U, rep.T)) if rep.U is not None else None
    trainer.apply_gradients(project, constrain, clip_groups=rep.groups)
    return total / micro_batches


@torch.no_grad()
def chain_evaluate(model, batches, codec, T, cut) -> float:
    """Validation loss as the chain computes it (through the compressed boundary)."""
    model.eval()
    total, count = 0.0, 0
    for x, y in batches:
        _, loss = chain_forward(model, x, y, codec, T, cut)
        total += loss.item() * y.numel()
        count += y.numel()
    model.train()
    return total / count


def copy_theta(theta: Tensors) -> Tensors:
    return {n: t.clone() for n, t in theta.items()}


def load(model, theta: Tensors) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(theta[name])
