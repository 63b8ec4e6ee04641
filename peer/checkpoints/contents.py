"""What a peer's checkpoint holds and how a restarted peer resumes from it.

The file itself (safetensors, checksummed, written atomically, the previous one kept) is
peer/checkpoints/files.py's. A checkpoint holds θ and its round, the strategy's shared and local buffers, the
inner optimizer's state and step, the batch stream's position, the slice the peer owns and its
token count: a peer restarted from it goes on exactly where it stopped.

A checkpoint is used only if it passes peer/checkpoints/files.py's checks (checksum, finite values, metadata an
object) and fits this run: its metadata fields have the right types, it names this run spec and it
holds every tensor this peer needs with the right shape. One that does not is refused with one log
line and the previous checkpoint is tried; if none fits, the peer starts afresh and downloads the
swarm's state. Nothing of a refused checkpoint stays loaded (what was loaded is rolled back).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple, TypeVar

import torch

from peer.outer.engine import RoundEngine
from peer.checkpoints.files import (
    CheckpointError, Tensors, first_usable, flatten_optimizer_state, remove_stale_temp,
    save_checkpoint, unflatten_optimizer_state,
)
from protocol.round import eligibility, standing
from protocol.spec import RunSpec

logger = logging.getLogger("voloco.peer")

T = TypeVar("T")

# the metadata fields a checkpoint must have, and their JSON types
_FIELDS = {"round": int, "spec": str, "inner_step": int, "part": int, "stream": dict, "optimizer": dict, "tokens": int}


def check_meta(meta: Dict[str, Any]) -> None:
    """CheckpointError naming the first metadata field that is missing or of the wrong type."""
    for name, kind in _FIELDS.items():
        value = meta.get(name)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise CheckpointError(f"its metadata field {name!r} is {type(value).__name__}, not {kind.__name__}")
        if kind is int and value < (-1 if name == "part" else 0):
            raise CheckpointError(f"its metadata field {name!r} is out of range ({value})")
    try:
        standing.checked(meta.get("standing"))  # optional: checkpoints before standing existed lack it
    except standing.StandingError as e:
        raise CheckpointError(f"its metadata field 'standing': {e}") from None
    try:
        standing.checked_evidence(meta.get("evidence"))  # optional: absent where no fresh sender has pooled scores
    except standing.StandingError as e:
        raise CheckpointError(f"its metadata field 'evidence': {e}") from None
    try:
        eligibility.checked(meta.get("eligibility"))  # optional: absent where rounds take every contribution
    except eligibility.EligibilityError as e:
        raise CheckpointError(f"its metadata field 'eligibility': {e}") from None
    optimizer = meta["optimizer"]
    groups, scalars = optimizer.get("param_groups"), optimizer.get("scalars")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise CheckpointError("its metadata field 'optimizer.param_groups' is not a list of objects")
    if not isinstance(scalars, dict) or not all(isinstance(v, dict) for v in scalars.values()):
        raise CheckpointError("its metadata field 'optimizer.scalars' is not an object of objects")


def _usable(directory: Optional[Path], spec: RunSpec, use: Callable[[Tensors, Dict[str, Any]], T], log: bool = True) -> Optional[T]:
    """``use(tensors, meta)`` of the newest checkpoint of this run spec with well-typed metadata
    that ``use`` accepts (peer/checkpoints/files.py's ``first_usable``)."""

    def checked(tensors: Tensors, meta: Dict[str, Any]) -> T:
        check_meta(meta)
        if meta["spec"] != spec.digest():
            raise CheckpointError(f"it is from another run spec ({meta['spec']})")
        return use(tensors, meta)

    return first_usable(directory, checked, log)


def saved_part(directory: Optional[Path], spec: RunSpec) -> Optional[Any]:
    """The part a checkpoint of this run spec in ``directory`` was trained with, if any."""
    return _usable(directory, spec, lambda tensors, meta: meta["part"], log=False)


def trainer_snapshot(role) -> Dict[str, Any]:
    """A copy of what a checkpoint holds of the role's training (the inner optimizer, its step, the
    batch stream's position), taken now: a checkpoint written later, from another thread, holds
    this moment's state while the inner steps go on."""
    opt_tensors, opt_rest = flatten_optimizer_state(role.trainer.optimizer.state_dict(), "optimizer.")
    return {
        "tensors": {k: v.detach().to("cpu", copy=True) for k, v in opt_tensors.items()},
        "optimizer": copy.deepcopy(opt_rest),
        "inner_step": role.trainer.step_count,
        "stream": copy.deepcopy(role.stream.state_dict()),
    }


def save(directory: Optional[Path], spec: RunSpec, engine: RoundEngine, role, tokens: int,
         trainer: Optional[Dict[str, Any]] = None) -> None:
    """Write a checkpoint of θ, its round, the strategy's buffers and ``trainer`` (a
    ``trainer_snapshot``; None: the role's training state as it is now)."""
    if directory is None:
        return
    save_checkpoint(directory, *collect(spec, engine, role, tokens, trainer))


def collect(spec: RunSpec, engine: RoundEngine, role, tokens: int,
            trainer: Optional[Dict[str, Any]] = None) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """What ``save`` writes, as copies taken now: (tensors, metadata), to write later or elsewhere."""
    trainer = trainer if trainer is not None else trainer_snapshot(role)
    with engine.lock:
        tensors: Dict[str, Any] = {f"theta.{n}": t.clone() for n, t in engine.theta.items()}
        tensors.update({f"shared.{k}": v.clone() for k, v in engine.strategy.shared_state().items()})
        tensors.update({f"local.{k}": v.clone() for k, v in engine.strategy.local_state().items()})
        round_no, table, who_sends, pools = engine.round, dict(engine.standing), dict(engine.eligibility), dict(engine.evidence)
    tensors.update(trainer["tensors"])
    meta = {
        "round": round_no,
        "spec": spec.digest(),
        "inner_step": trainer["inner_step"],
        "part": role.part,
        "stream": trainer["stream"],
        "optimizer": trainer["optimizer"],
        "tokens": tokens,
        "standing": table,  # the lineage's standing table (protocol/round/standing.py); older checkpoints lack it
        "run_spec": spec.to_dict(),  # the whole spec, so `voloco export`/`generate` need nothing else
    }
    if who_sends:  # who sends a payload when a round takes at most K (protocol/round/eligibility.py)
        meta["eligibility"] = who_sends
    if pools:  # fresh senders' pooled scores (protocol/round/standing.py)
        meta["evidence"] = {s: list(e) for s, e in pools.items()}
    return tensors, meta


def _snapshot(strategy, role) -> Callable[[], None]:
    """A function that puts the strategy's buffers, the optimizer and the stream back as they are now."""
    shared = {k: v.clone() for k, v in strategy.shared_state().items()}
    local = {k: v.clone() for k, v in strategy.local_state().items()}
    trainer, stream = copy.deepcopy(role.trainer.state_dict()), dict(role.stream.state_dict())

    def rollback() -> None:
        strategy.load_shared_state(shared)
        strategy.load_local_state(local)
        role.trainer.load_state_dict(trainer)
        role.stream.load_state_dict(stream)

    return rollback


def _check_optimizer(saved: Dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    """ValueError unless ``saved`` has this optimizer's groups, hyper-parameter types and, for each
    parameter, state tensors of its shape (torch checks none of it, and would fail mid-training)."""
    current = optimizer.state_dict()["param_groups"]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(saved["param_groups"]) != len(current):
        raise ValueError(f"{len(saved['param_groups'])} optimizer parameter groups, this optimizer has {len(current)}")
    for got, have in zip(saved["param_groups"], current):
        if set(got) != set(have) or any(_kind(got[k]) != _kind(have[k]) for k in have):
            raise ValueError(f"optimizer parameter group {sorted(got)} does not match this optimizer's {sorted(have)}")
    for idx, slots in saved["state"].items():
        if idx >= len(params):
            raise ValueError(f"optimizer state for parameter {idx} of {len(params)}")
        for slot, value in slots.items():
            if torch.is_tensor(value) and value.dim() and value.shape != params[idx].shape:
                raise ValueError(f"optimizer state {idx}.{slot} has shape {tuple(value.shape)}, not {tuple(params[idx].shape)}")


def _kind(value: Any) -> str:
    """A JSON value's type, numbers as one (a learning rate may be saved as 0 or 0.0)."""
    if isinstance(value, bool) or value is None:
        return type(value).__name__
    return "number" if isinstance(value, (int, float)) else "list" if isinstance(value, (list, tuple)) else type(value).__name__


def restore(directory: Optional[Path], spec: RunSpec, engine: RoundEngine, role) -> Optional[int]:
    """Resume from the newest usable checkpoint in ``directory``; the tokens it had trained, or None if none fits."""
    remove_stale_temp(directory)
    strategy = engine.strategy
    shapes = spec.param_shapes()

    def use(tensors: Tensors, meta: Dict[str, Any]) -> int:
        theta = {}
        for n, shape in shapes.items():
            t = tensors.get(f"theta.{n}")
            if t is None or t.dtype != torch.float32 or tuple(t.shape) != tuple(shape):
                raise CheckpointError(f"it has no float32 tensor theta.{n} of shape {tuple(shape)}")
            theta[n] = t
        table = standing.checked(meta.get("standing"))  # valid: check_meta read it
        who_sends = eligibility.checked(meta.get("eligibility"))
        pools = standing.checked_evidence(meta.get("evidence"))
        rollback = _snapshot(strategy, role)
        try:
            strategy.load_shared_state({k[7:]: v for k, v in tensors.items() if k.startswith("shared.")})
            strategy.load_local_state({k[6:]: v for k, v in tensors.items() if k.startswith("local.")})
            optimizer = unflatten_optimizer_state(tensors, meta["optimizer"], "optimizer.")
            _check_optimizer(optimizer, role.trainer.optimizer)
            role.trainer.load_state_dict({"step": meta["inner_step"], "optimizer": optimizer})
            role.stream.load_state_dict(meta["stream"])
        except (KeyError, ValueError, TypeError, IndexError, RuntimeError) as e:
            rollback()
            raise CheckpointError(f"it does not fit this run ({type(e).__name__}: {e})") from None
        engine.install(theta, meta["round"], standing=table, eligibility=who_sends, evidence=pools)
        return meta["tokens"]

    tokens = _usable(directory, spec, use)
    if tokens is None:
        return None
    logger.info(f"resumed from the checkpoint of round {engine.round} in {directory}")
    return tokens
