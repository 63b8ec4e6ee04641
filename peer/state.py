"""Checkpoints: one safetensors file per peer, replaced atomically.

A peer killed at any instant restarts from its last complete checkpoint, never from a half-written
file: the new file is written beside the old one, fsynced, and renamed over it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as st_save

logger = logging.getLogger("voloco.state")

CHECKPOINT_NAME = "checkpoint.safetensors"


def params_hash(theta: Mapping[str, torch.Tensor]) -> str:
    """A short sha256 of the parameters (names and fp32 bytes, in name order): equal iff bit-identical."""
    h = hashlib.sha256()
    for name in sorted(theta):
        h.update(name.encode())
        h.update(theta[name].detach().to("cpu").contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def save_checkpoint(directory: Path, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> Path:
    """Write tensors and a JSON-able ``meta`` atomically; returns the checkpoint's path."""
    directory.mkdir(parents=True, exist_ok=True)
    data = st_save(
        {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
        metadata={"voloco": json.dumps(meta, sort_keys=True)},
    )
    target = directory / CHECKPOINT_NAME
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".checkpoint-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return target


def load_checkpoint(directory: Path) -> Optional[Tuple[Dict[str, torch.Tensor], Dict[str, Any]]]:
    """The last complete checkpoint in ``directory``, or None if there is none or it is unreadable."""
    path = directory / CHECKPOINT_NAME
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})["voloco"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, KeyError, ValueError) as e:
        logger.warning(f"ignoring unreadable checkpoint {path}: {e}")
        return None
    return tensors, meta


def flatten_optimizer_state(state: Mapping[str, Any], prefix: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Split a torch optimizer state_dict into tensors (for safetensors) and JSON-able rest."""
    tensors: Dict[str, torch.Tensor] = {}
    per_param: Dict[str, Dict[str, Any]] = {}
    for idx, slots in state["state"].items():
        scalars = {}
        for k, v in slots.items():
            if isinstance(v, torch.Tensor):
                tensors[f"{prefix}{idx}.{k}"] = v
            else:
                scalars[k] = v
        per_param[str(idx)] = scalars
    return tensors, {"param_groups": state["param_groups"], "scalars": per_param}


def unflatten_optimizer_state(tensors: Mapping[str, torch.Tensor], rest: Mapping[str, Any], prefix: str) -> Dict[str, Any]:
    state: Dict[int, Dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith(prefix):
            idx, slot = key[len(prefix) :].split(".", 1)
            state.setdefault(int(idx), {})[slot] = value
    for idx, scalars in rest["scalars"].items():
        state.setdefault(int(idx), {}).update(scalars)
    return {"state": state, "param_groups": rest["param_groups"]}
