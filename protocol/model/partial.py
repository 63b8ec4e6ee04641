"""Partial parameter updates: which tensors each slice owns, and which slice a joining peer takes.

Part ``-1`` is a full replica (every tensor). Part ``s`` in ``[0, slices)`` owns the shared
tensors (embeddings, norms, head, and attention unless it is sliced) plus slice ``s`` of every
sliced projection. The union of the parts covers every tensor; shared tensors belong to all.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Sequence, Tuple

from protocol.model.layout import parse_name
from protocol.spec import RunSpec

FULL = -1


def slice_of(name: str) -> int:
    """The slice a tensor belongs to, or FULL for a tensor every part trains."""
    parts = parse_name(name)
    return FULL if parts is None or parts.slice is None else parts.slice


def owned_shapes(spec: RunSpec, part: int) -> Dict[str, Tuple[int, ...]]:
    """The tensors (with shapes, in the run's order) that ``part`` trains and sends."""
    if part != FULL and not 0 <= part < spec.partial.slices:
        raise ValueError(f"part {part} is outside the run's {spec.partial.slices} slices")
    return {n: t.shape for n, t in spec.layout().items() if part == FULL or t.slice in (None, part)}


def part_layouts(spec: RunSpec) -> Dict[int, Dict[str, Tuple[int, ...]]]:
    """Every layout a payload of this run may have: per slice, or the full model."""
    parts = [FULL] + (list(range(spec.partial.slices)) if spec.partial.slices > 1 else [])
    return {p: owned_shapes(spec, p) for p in parts}


def choose_part(slices: int, owners: Iterable[int], waiting: Sequence[str], me: str) -> int:
    """The slice this peer should own.

    ``owners``: the slices of the live peers that already chose one; ``waiting``: the ids of the
    live peers still choosing, this one included. Those are served in id order, each taking the
    slice with the fewest owners (ties: the lowest index), so peers that start together spread
    out, and a slice whose owners all left is the first one taken.
    """
    if slices <= 1:
        return FULL
    count: Dict[int, int] = {s: 0 for s in range(slices)}
    for part in owners:
        if part in count:
            count[part] += 1
    for peer in sorted(set(waiting) | {me}):
        part = min(count, key=lambda s: (count[s], s))
        if peer == me:
            return part
        count[part] += 1
    raise AssertionError("unreachable")


def describe(spec: RunSpec, part: int) -> str:
    if part == FULL:
        return "the full model"
    what = "MLP neurons and attention heads" if spec.partial.attention else "MLP neurons"
    return f"slice {part} of {spec.partial.slices} ({what})"


__all__: List[str] = ["FULL", "slice_of", "owned_shapes", "part_layouts", "choose_part", "describe"]
