"""Partial parameter updates: which tensors each slice owns, and which slice a joining peer takes.

Part ``-1`` is a full replica (every tensor). Part ``s`` in ``[0, slices)`` owns the shared
tensors (embeddings, norms, head, and attention unless it is sliced) plus slice ``s`` of every
sliced projection. The union of the parts covers every tensor; shared tensors belong to all.
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, Mapping, Sequence, Tuple

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


def balanced_steps(carriers: Mapping[str, int], slices: int) -> Dict[str, float]:
    """The outer step's multiple for each sliced tensor of a round (``partial.balance_steps``), from
    ``carriers``: tensor name -> how many of the round's counted contributions carry it. A slice that
    fewer contributions carry than the round's most-carried tensor steps √(most / its) times as far,
    at most √``slices``: with S slices among R owners a slice's average comes from R / S updates, whose
    sparse union moves fewer of its coordinates than R updates move of a shared tensor, and √S
    measured best of the multiples tried at S = 4 (bench/RESULTS.md, "Slices' outer step by their
    carriers"). A slice one contribution alone carries steps 1: no median clips a lone update, and
    none amplifies it. Shared tensors, and slices carried as often as the most-carried tensor, step 1
    (absent). A plain function of counts every member holds alike, so every member steps alike
    (tests/training/test_partial.py)."""
    most = max(carriers.values(), default=0)
    cap = math.sqrt(max(1, slices))
    return {n: min(cap, math.sqrt(most / c)) for n, c in sorted(carriers.items())
            if 2 <= c < most and slice_of(n) != FULL}


__all__: List[str] = ["FULL", "slice_of", "owned_shapes", "part_layouts", "choose_part", "describe", "balanced_steps"]
