"""Checkpoints: safetensors files a peer trusts only after checking them.

A peer killed at any instant restarts from its last complete checkpoint, never from a half-written
file: the new file is written beside the old one, fsynced, and renamed over it; the one it replaces
is kept as ``checkpoint.prev.safetensors`` (rotated by rename too), so a checkpoint found corrupt
at start still leaves the one before it.

What a file on disk says is checked before anything is used: the safetensors header is parsed here,
with every offset, shape and dtype bounded by the file itself (a flipped byte cannot make the reader
allocate much or crash), a sha256 over the tensors (names, dtypes, shapes, bytes) and the metadata,
written in the metadata at save, must match, every floating tensor must be finite and the metadata
must be a JSON object. A file that fails any check is refused with one log line saying why; the
caller goes on to the previous checkpoint or a live peer's state. Temporary files left by a save
that was killed are removed at start (``remove_stale_temp``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, TypeVar

import torch
from safetensors.torch import save as st_save

logger = logging.getLogger("voloco.state")

CHECKPOINT_NAME = "checkpoint.safetensors"
PREVIOUS_NAME = "checkpoint.prev.safetensors"
_TMP_PREFIX, _TMP_SUFFIX = ".checkpoint-", ".tmp"
_META_KEY, _DIGEST_KEY = "voloco", "voloco_sha256"
_MAX_HEADER = 64 << 20  # bytes of safetensors header (JSON) a checkpoint may have
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}

Tensors = Dict[str, torch.Tensor]
T = TypeVar("T")


class CheckpointError(ValueError):
    """A checkpoint file that must not be used: unreadable, altered, non-finite or malformed."""


def params_hash(theta: Mapping[str, torch.Tensor]) -> str:
    """A short sha256 of the parameters (names and fp32 bytes, in name order): equal iff bit-identical."""
    h = hashlib.sha256()
    for name in sorted(theta):
        h.update(name.encode())
        h.update(theta[name].detach().to("cpu").contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def state_digest(shared: Mapping[str, torch.Tensor], table: Mapping[str, int],
                 eligibility: Optional[Mapping[str, int]] = None,
                 evidence: Optional[Mapping[str, Tuple[int, int]]] = None) -> str:
    """A short sha256 of what a downloaded state holds beside θ: the strategy's shared state (DiLoCo's
    outer momentum; names and fp32 bytes, in name order), the lineage's standing table (sender ->
    rounds counted, in sender order), where a round takes at most K its eligibility table, and fresh
    senders' evidence where any has some (protocol/round/standing.py). Every
    member of a lineage holds the same, so peers report it with θ's hash and a newcomer checks a
    served state against both (peer/round/state_sync.py)."""
    h = hashlib.sha256(b"voloco state v1\0")
    for name in sorted(shared):
        _update(h, name.encode())
        _update(h, shared[name].detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    for sender in sorted(table):
        _update(h, sender.encode())
        _update(h, int(table[sender]).to_bytes(8, "little", signed=True))
    if eligibility:  # a round that takes at most K (protocol/round/eligibility.py); empty: the digest as before
        h.update(b"eligibility\0")
        for part in sorted(eligibility):
            _update(h, part.encode())
            _update(h, int(eligibility[part]).to_bytes(8, "little", signed=True))
    if evidence:  # empty: the digest as before
        h.update(b"evidence\0")
        for sender in sorted(evidence):
            _update(h, sender.encode())
            for n in evidence[sender]:
                _update(h, int(n).to_bytes(8, "little", signed=True))
    return h.hexdigest()[:16]


def _update(h, data: bytes) -> None:
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)


def checkpoint_digest(tensors: Mapping[str, torch.Tensor], meta_json: str) -> str:
    """sha256 over the metadata and every tensor's name, dtype, shape and bytes (in name order)."""
    h = hashlib.sha256(b"voloco checkpoint v1\0")
    _update(h, meta_json.encode())
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        _update(h, name.encode())
        _update(h, f"{t.dtype}{tuple(t.shape)}".encode())
        _update(h, t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _first_non_finite(tensors: Mapping[str, torch.Tensor]) -> Optional[str]:
    for name in sorted(tensors):
        t = tensors[name]
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


def save_checkpoint(directory: Path, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> Optional[Path]:
    """Write tensors and a JSON-able ``meta`` atomically, keeping the checkpoint it replaces as the
    previous one; returns the new checkpoint's path. A state with non-finite values is not written
    (logged; the checkpoints on disk stay as they are) and None is returned."""
    cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    bad = _first_non_finite(cpu)
    if bad is not None:
        logger.error(f"not writing a checkpoint in {directory}: tensor {bad} has non-finite values; keeping the last one")
        return None
    meta_json = json.dumps(meta, sort_keys=True)
    data = st_save(cpu, metadata={_META_KEY: meta_json, _DIGEST_KEY: checkpoint_digest(cpu, meta_json)})
    directory.mkdir(parents=True, exist_ok=True)
    target, previous = directory / CHECKPOINT_NAME, directory / PREVIOUS_NAME
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=_TMP_PREFIX, suffix=_TMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        # each rename is atomic: killed between the two, the directory holds the previous checkpoint
        # (and this temp file, removed at the next start), which the loader then falls back to
        if target.exists():
            os.replace(target, previous)
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


def remove_stale_temp(directory: Optional[Path]) -> int:
    """Remove the temporary files of saves that were killed; call at start, before any save."""
    if directory is None or not directory.is_dir():
        return 0
    removed = 0
    for path in directory.glob(f"{_TMP_PREFIX}*{_TMP_SUFFIX}"):
        try:
            path.unlink()
            removed += 1
        except OSError as e:
            logger.warning(f"could not remove the stale temporary file {path}: {e}")
    if removed:
        logger.info(f"removed {removed} temporary file(s) left by an interrupted checkpoint save in {directory}")
    return removed


def _int_list(value: Any, what: str) -> list:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise CheckpointError(f"{what} is not a list of non-negative integers")
    return value


def _parse(data: bytes) -> Tuple[Tensors, Dict[str, str]]:
    """Tensors and string metadata of a safetensors file's bytes, every field checked against the file."""
    if len(data) < 8:
        raise CheckpointError("the file is truncated")
    n = int.from_bytes(data[:8], "little")
    if n > min(len(data) - 8, _MAX_HEADER):
        raise CheckpointError(f"the header length {n} does not fit the file")
    try:
        header = json.loads(data[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"the header is not JSON ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise CheckpointError("the header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError("the header's metadata is not a map of strings")
    body = memoryview(data)[8 + n :]
    tensors: Tensors = {}
    for name, info in header.items():
        if not isinstance(info, dict) or info.get("dtype") not in _DTYPES:
            raise CheckpointError(f"tensor {name!r} has no known dtype")
        dtype = _DTYPES[info["dtype"]]
        shape = _int_list(info.get("shape"), f"the shape of {name!r}")
        offsets = _int_list(info.get("data_offsets"), f"the offsets of {name!r}")
        if len(offsets) != 2 or not offsets[0] <= offsets[1] <= len(body):
            raise CheckpointError(f"tensor {name!r} lies outside the file")
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if offsets[1] - offsets[0] != nbytes:
            raise CheckpointError(f"tensor {name!r} has {offsets[1] - offsets[0]} bytes for shape {shape}")
        raw = bytearray(body[offsets[0] : offsets[1]])
        flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        tensors[name] = flat.reshape(shape)
    return tensors, metadata


def read_checkpoint(path: Path) -> Tuple[Tensors, Dict[str, Any]]:
    """(tensors, metadata) of the checkpoint file at ``path``, verified; CheckpointError if it fails a check."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"cannot be read: {e}") from None
    tensors, metadata = _parse(data)
    del data
    meta_json, digest = metadata.get(_META_KEY), metadata.get(_DIGEST_KEY)
    if meta_json is None or digest is None:
        raise CheckpointError("has no voloco metadata or checksum (not written by this version of voloco)")
    if checkpoint_digest(tensors, meta_json) != digest:
        raise CheckpointError("its checksum does not match its contents (the file was altered or damaged)")
    bad = _first_non_finite(tensors)
    if bad is not None:
        raise CheckpointError(f"tensor {bad} has non-finite values")
    try:
        meta = json.loads(meta_json)
    except (ValueError, RecursionError):
        raise CheckpointError("its metadata is not JSON") from None
    if not isinstance(meta, dict):
        raise CheckpointError("its metadata is not a JSON object")
    return tensors, meta


def checkpoint_paths(directory: Path) -> Tuple[Path, Path]:
    """The newest checkpoint, then the previous one."""
    return directory / CHECKPOINT_NAME, directory / PREVIOUS_NAME


def first_usable(directory: Optional[Path], use: Callable[[Tensors, Dict[str, Any]], T] = lambda t, m: (t, m),
                 log: bool = True) -> Optional[T]:
    """``use(tensors, meta)`` of the newest checkpoint in ``directory`` that passes every check and
    that ``use`` accepts (it raises CheckpointError or ValueError to refuse one); None if there is
    none. Each refused checkpoint is logged in one line: which file, why, what comes next."""
    if directory is None:
        return None
    paths = [p for p in checkpoint_paths(directory) if p.is_file()]
    for i, path in enumerate(paths):
        try:
            return use(*read_checkpoint(path))
        except (CheckpointError, ValueError) as e:
            if log:
                then = f"falling back to {paths[i + 1].name}" if i + 1 < len(paths) else "no older checkpoint left: starting without one"
                logger.warning(f"refusing checkpoint {path}: {e}; {then}")
    return None


def load_checkpoint(directory: Optional[Path]) -> Optional[Tuple[Tensors, Dict[str, Any]]]:
    """(tensors, metadata) of the newest checkpoint in ``directory`` that passes every check, or None."""
    return first_usable(directory)


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
    """The inverse of ``flatten_optimizer_state`` (``rest`` type-checked by the caller); ValueError if a name is malformed."""
    state: Dict[int, Dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith(prefix):
            idx, _, slot = key[len(prefix) :].partition(".")
            if not idx.isdigit() or not slot:
                raise ValueError(f"optimizer tensor {key!r} is not named <param>.<slot>")
            state.setdefault(int(idx), {})[slot] = value
    for idx, scalars in rest["scalars"].items():
        if not idx.isdigit():
            raise ValueError(f"optimizer scalars of {idx!r} are not keyed by a parameter index")
        state.setdefault(int(idx), {}).update(scalars)
    return {"state": state, "param_groups": rest["param_groups"]}
