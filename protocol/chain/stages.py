"""Pipeline chains: peers too small for a full replica, grouped so that together they train one.

A chain is an ordered list of stages, one peer each; stage ``i`` owns a contiguous range of
blocks, the first stage also the embedding and the last the final norm and head
(``stage_shapes``), so the stages of a chain own every tensor of the model exactly once. A chain
counts as one replica in the outer loop.

This module holds what a chain is: the candidate peers, the stages, the chain and its id, and the
tensors a stage owns. How candidates are grouped into chains: protocol/chain/formation.py; the
records peers and the coordinator publish about them: protocol/chain/records.py.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import msgpack

from protocol.model.layout import in_block_range
from protocol.spec import RunSpec


@dataclass(frozen=True)
class Candidate:
    peer_id: str
    capacity_bytes: int  # memory this peer can give to training (see protocol/model/capacity.py)
    bandwidth_mbps: float


@dataclass(frozen=True)
class Stage:
    peer_id: str
    index: int
    start_block: int
    end_block: int  # exclusive

    @property
    def blocks(self) -> int:
        return self.end_block - self.start_block


@dataclass
class Chain:
    chain_id: str
    stages: List[Stage] = field(default_factory=list)

    @property
    def members(self) -> List[str]:
        return [s.peer_id for s in self.stages]

    def stage_of(self, peer_id: str) -> Optional[Stage]:
        return next((s for s in self.stages if s.peer_id == peer_id), None)

    def ranges(self) -> List[Tuple[str, int, int]]:
        return [(s.peer_id, s.start_block, s.end_block) for s in self.stages]


def chain_id_for(ranges: Sequence[Tuple[str, int, int]]) -> str:
    """A stable id from the members and their block ranges, in stage order."""
    packed = msgpack.packb([[p, s, e] for p, s, e in ranges], use_bin_type=True)
    return "ch-" + hashlib.sha256(packed).hexdigest()[:16]


def make_chain(ranges: Sequence[Tuple[str, int, int]]) -> Chain:
    stages = [Stage(p, i, s, e) for i, (p, s, e) in enumerate(ranges)]
    return Chain(chain_id_for(ranges), stages)


def stage_shapes(spec: RunSpec, start_block: int, end_block: int) -> Dict[str, Tuple[int, ...]]:
    """The tensors a stage owns, in the run's parameter order: the embedding if it starts at
    block 0, its blocks, and the final norm and head if it ends at the last block."""
    n_layers = spec.model.n_layers
    if not 0 <= start_block < end_block <= n_layers:
        raise ValueError(f"block range [{start_block}, {end_block}) is not a non-empty part of [0, {n_layers})")
    return {n: t.shape for n, t in spec.layout().items() if in_block_range(t, start_block, end_block, n_layers)}


__all__ = [
    "Candidate",
    "Stage",
    "Chain",
    "chain_id_for",
    "make_chain",
    "stage_shapes",
]
