"""What a peer's checkpoint holds and how a restarted peer resumes from it.

The file itself (safetensors, written atomically) is peer/state.py's. A checkpoint holds θ and its
round, the strategy's shared and local buffers, the inner optimizer's state and step, the batch
stream's position, the slice the peer owns and its token count: a peer restarted from it goes on
exactly where it stopped. A checkpoint of another run spec, or one that does not fit, is ignored
with a warning (the peer then starts afresh and downloads the swarm's state).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, Optional

from peer.round_engine import RoundEngine
from peer.state import flatten_optimizer_state, load_checkpoint, save_checkpoint, unflatten_optimizer_state
from protocol.spec import RunSpec

logger = logging.getLogger("voloco.peer")


def saved_part(directory: Optional[Path], spec: RunSpec) -> Optional[Any]:
    """The part a checkpoint of this run spec in ``directory`` was trained with, if any."""
    found = load_checkpoint(directory) if directory is not None else None
    if found is None or found[1].get("spec") != spec.digest():
        return None
    return found[1].get("part")


def save(directory: Optional[Path], spec: RunSpec, engine: RoundEngine, role, tokens: int) -> None:
    if directory is None:
        return
    opt_tensors, opt_rest = flatten_optimizer_state(role.trainer.optimizer.state_dict(), "optimizer.")
    with engine.lock:
        tensors: Dict[str, Any] = {f"theta.{n}": t for n, t in engine.theta.items()}
        tensors.update({f"shared.{k}": v for k, v in engine.strategy.shared_state().items()})
        tensors.update({f"local.{k}": v for k, v in engine.strategy.local_state().items()})
        round_no = engine.round
    tensors.update(opt_tensors)
    meta = {
        "round": round_no,
        "spec": spec.digest(),
        "inner_step": role.trainer.step_count,
        "part": role.part,
        "stream": role.stream.state_dict(),
        "optimizer": opt_rest,
        "tokens": tokens,
    }
    save_checkpoint(directory, tensors, meta)


def restore(directory: Optional[Path], spec: RunSpec, engine: RoundEngine, role) -> Optional[int]:
    """Resume from the checkpoint in ``directory``; the tokens it had trained, or None if none fits."""
    found = load_checkpoint(directory) if directory is not None else None
    if found is None:
        return None
    tensors, meta = found
    if meta.get("spec") != spec.digest():
        logger.warning(f"checkpoint in {directory} is from another run spec; starting afresh")
        return None
    strategy = engine.strategy
    try:
        theta = {n: tensors[f"theta.{n}"] for n in spec.param_shapes()}
        shared = {k[7:]: v for k, v in tensors.items() if k.startswith("shared.")}
        strategy.load_shared_state(shared)
        strategy.load_local_state({k[6:]: v for k, v in tensors.items() if k.startswith("local.")})
        role.trainer.load_state_dict(
            {"step": meta["inner_step"], "optimizer": unflatten_optimizer_state(tensors, meta["optimizer"], "optimizer.")}
        )
        role.stream.load_state_dict(meta["stream"])
    except (KeyError, ValueError) as e:
        logger.warning(f"checkpoint in {directory} does not fit this run ({e}); starting afresh")
        return None
    engine.install(theta, int(meta["round"]))
    logger.info(f"resumed from the checkpoint of round {engine.round} in {directory}")
    return int(meta.get("tokens", 0))
