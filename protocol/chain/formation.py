"""Chain formation: grouping candidate peers into pipeline chains (protocol/chain/stages.py) that each
train the whole model.

``form_chains`` is deterministic: the coordinator (or any peer, to check it) gets the same chains
from the same candidates. Its priorities, in order:

1. as many chains as possible (each is a replica);
2. then as few stages as possible (each stage boundary is a network hop);
3. blocks split in proportion to capacity, and never more than a member's memory holds
   (protocol/model/capacity.py); every stage gets at least one block.

Candidates that end up in no chain wait (for the next formation, or to replace a member that
leaves).
"""

from __future__ import annotations

import heapq
from typing import Iterable, List, Optional, Sequence, Tuple

from protocol.model.capacity import first_block_bytes, layer_bytes, replica_bytes
from protocol.chain.stages import Candidate, Chain, make_chain
from protocol.spec import RunSpec

__all__ = ["plan_chain", "form_chains"]


class _Costs:
    """The capacity figures formation needs, computed once per (spec, micro_batch)."""

    def __init__(self, spec: RunSpec, micro_batch: Optional[int]):
        self.n_layers = spec.model.n_layers
        self.per_block = layer_bytes(spec, micro_batch)
        # a stage of one block in each role; every further block adds exactly per_block
        self.one = {
            (embed, head): first_block_bytes(spec, embed=embed, head=head, micro_batch=micro_batch)
            for embed in (False, True)
            for head in (False, True)
        }
        self.replica = replica_bytes(spec, micro_batch=micro_batch)

    def max_blocks(self, capacity: int, embed: bool, head: bool) -> int:
        one = self.one[(embed, head)]
        if capacity < one:
            return 0
        return min(self.n_layers, 1 + (capacity - one) // self.per_block)


def _order(members: Sequence[Candidate]) -> List[Candidate]:
    """Stage order: the largest member holds the head (the heaviest end: its logits), the second
    largest the embedding, the others sit in between, largest first; ties by peer id."""
    by_size = sorted(members, key=_size_key)
    if len(by_size) == 1:
        return by_size
    return [by_size[1]] + by_size[2:] + [by_size[0]]


def _size_key(c: Candidate) -> Tuple[int, str]:
    return (-c.capacity_bytes, c.peer_id)


def _bounds(costs: _Costs, ordered: Sequence[Candidate]) -> List[int]:
    last = len(ordered) - 1
    return [costs.max_blocks(c.capacity_bytes, i == 0, i == last) for i, c in enumerate(ordered)]


def _feasible(costs: _Costs, members: Sequence[Candidate]) -> bool:
    if not members or len(members) > costs.n_layers:
        return False
    bounds = _bounds(costs, _order(members))
    return min(bounds) >= 1 and sum(bounds) >= costs.n_layers


def plan_chain(spec: RunSpec, members: Sequence[Candidate], micro_batch: Optional[int] = None) -> Optional[Chain]:
    """The chain these members form (stage order and block ranges), or None if they cannot cover
    the model: some member cannot hold one block in its place, or all together not every block."""
    return _plan(_Costs(spec, micro_batch), members)


def _plan(costs: _Costs, members: Sequence[Candidate]) -> Optional[Chain]:
    if not _feasible(costs, members):
        return None
    ordered = _order(members)
    bounds = _bounds(costs, ordered)
    # Sainte-Lague apportionment of the blocks by capacity, every stage at least one block and at
    # most what its memory holds; ties go to the earlier stage.
    blocks = [1] * len(ordered)
    for _ in range(costs.n_layers - len(ordered)):
        open_ = [i for i in range(len(ordered)) if blocks[i] < bounds[i]]
        best = max(open_, key=lambda i: (ordered[i].capacity_bytes / (blocks[i] + 0.5), -i))
        blocks[best] += 1
    ranges, start = [], 0
    for c, b in zip(ordered, blocks):
        ranges.append((c.peer_id, start, start + b))
        start += b
    return make_chain(ranges)


def form_chains(
    spec: RunSpec,
    candidates: Iterable[Candidate],
    max_stages: int = 8,
    micro_batch: Optional[int] = None,
) -> Tuple[List[Chain], List[str]]:
    """Group ``candidates`` into chains that each train the whole model; returns the chains and
    the ids of the candidates that wait. ``micro_batch``: sequences whose activations a stage holds
    at once (default the run's batch size, see protocol/model/capacity.py)."""
    pool = _check_candidates(candidates)
    if isinstance(max_stages, bool) or not isinstance(max_stages, int) or max_stages < 1:
        raise ValueError(f"max_stages must be a positive integer, got {max_stages!r}")
    costs = _Costs(spec, micro_batch)
    max_stages = min(max_stages, costs.n_layers)
    ordered = sorted(pool, key=_size_key)
    # a peer that cannot hold one block even in the middle of a chain can never be placed
    usable = [c for c in ordered if costs.max_blocks(c.capacity_bytes, False, False) >= 1]

    attempts = [_sequential(costs, usable, max_stages)]
    # the sum of a chain's stage bytes is at least a full replica's, which bounds the chain count
    upper = min(len(usable), sum(c.capacity_bytes for c in usable) // costs.replica)
    # fewer chains are easier to fill: search the largest k that succeeds
    lo, hi, found = 1, upper, None
    while lo <= hi:
        k = (lo + hi) // 2
        groups = _balanced(costs, usable, k, max_stages)
        if groups is not None:
            lo, found = k + 1, groups
        else:
            hi = k - 1
    if found is not None:
        attempts.append(found)
    best = min(attempts, key=lambda groups: (-len(groups), sum(map(len, groups))))
    chains = [_plan(costs, g) for g in best]
    assert all(c is not None for c in chains), "formation returned a group that cannot cover the model"
    placed = {c.peer_id for g in best for c in g}
    waiting = [c.peer_id for c in ordered if c.peer_id not in placed]
    return chains, waiting


def _sequential(costs: _Costs, pool: Sequence[Candidate], max_stages: int) -> List[List[Candidate]]:
    """One chain at a time: the largest free peer, then the smallest peer that completes the
    chain if there is one (big peers stay free for later chains), else the largest."""
    free = list(pool)
    groups: List[List[Candidate]] = []
    while free:
        group, rest = [free[0]], free[1:]
        while not _feasible(costs, group):
            # whether a peer completes the group only grows with its capacity (every stage
            # rank gets at least as much memory), so the completing peers are a prefix of rest
            last = _last_true(len(rest), lambda i: _feasible(costs, group + [rest[i]])) if len(group) < max_stages else -1
            if last >= 0:
                pick = last
            elif rest and len(group) < max_stages - 1:
                pick = 0
            else:
                return groups
            group.append(rest.pop(pick))
        groups.append(group)
        free = rest
    return groups


def _last_true(n: int, pred) -> int:
    """The last index of a true prefix of pred over range(n), or -1 (pred: true then false)."""
    lo, hi = 0, n  # answer + 1 lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if pred(mid):
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


def _balanced(costs: _Costs, pool: Sequence[Candidate], k: int, max_stages: int) -> Optional[List[List[Candidate]]]:
    """Exactly ``k`` chains filled in parallel: each peer, largest first, joins the open chain with
    the least capacity so far (the k largest peers head the chains); a chain closes once it covers
    the model. None if some chain is left open."""
    groups: List[List[Candidate]] = [[] for _ in range(k)]
    heap = [(0, i) for i in range(k)]  # (capacity so far, chain) of the open chains
    for c in pool:
        if not heap:
            break
        skipped = []
        while heap:
            total, i = heapq.heappop(heap)
            completes = _feasible(costs, groups[i] + [c])
            if completes or len(groups[i]) < max_stages - 1:
                groups[i].append(c)
                if not completes:
                    heapq.heappush(heap, (total + c.capacity_bytes, i))
                break
            skipped.append((total, i))  # full of stages: only a completing peer may join it
        for item in skipped:
            heapq.heappush(heap, item)
    return None if heap else groups


def _check_candidates(candidates: Iterable[Candidate]) -> List[Candidate]:
    pool = list(candidates)
    seen = set()
    for c in pool:
        if not isinstance(c, Candidate):
            raise TypeError(f"expected Candidate, got {type(c).__name__}")
        if not isinstance(c.peer_id, str) or not c.peer_id:
            raise ValueError(f"candidate peer id must be a non-empty string, got {c.peer_id!r}")
        if isinstance(c.capacity_bytes, bool) or not isinstance(c.capacity_bytes, int):
            raise ValueError(f"candidate {c.peer_id!r}: capacity_bytes must be an integer")
        if c.peer_id in seen:
            raise ValueError(f"candidate {c.peer_id!r} appears twice")
        seen.add(c.peer_id)
    return pool
