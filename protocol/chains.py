"""Pipeline chains: peers too small for a full replica, grouped so that together they train one.

A chain is an ordered list of stages, one peer each; stage ``i`` owns a contiguous range of
blocks, the first stage also the embedding and the last the final norm and head
(``stage_shapes``), so the stages of a chain own every tensor of the model exactly once. A chain
counts as one replica in the outer loop.

``form_chains`` is deterministic: the coordinator (or any peer, to check it) gets the same chains
from the same candidates. Its priorities, in order:

1. as many chains as possible (each is a replica);
2. then as few stages as possible (each stage boundary is a network hop);
3. blocks split in proportion to capacity, and never more than a member's memory holds
   (protocol/capacity.py); every stage gets at least one block.

Candidates that end up in no chain wait (for the next formation, or to replace a member that
leaves). Records: a peer publishes a ``CandidateRecord``; the coordinator publishes one
``ChainAssignment`` per chain, with an ``epoch`` that grows at every re-formation so that a newer
assignment supersedes an older one that names the same peer (``latest_assignments``).
"""

from __future__ import annotations

import hashlib
import heapq
import math
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import msgpack

from protocol import PROTOCOL_VERSION
from protocol.capacity import first_block_bytes, layer_bytes, replica_bytes
from protocol.errors import ProtocolError
from protocol.layout import in_block_range
from protocol.spec import RunSpec

MAX_STAGES = 64  # the most stages an assignment record may name
MAX_PEER_ID = 128  # characters of a peer id
MAX_RECORD_BYTES = 1 << 14
CANDIDATE_STATES = ("waiting", "assigned", "leaving")


class ChainError(ProtocolError):
    """A chain candidate or assignment record that does not follow the protocol."""


def chains_key(run_id: str) -> str:
    """Chain assignments, one subkey per chain id (published by the coordinator)."""
    return f"{run_id}_chains"


def chain_candidates_key(run_id: str) -> str:
    """Chain candidate records, one subkey per peer id."""
    return f"{run_id}_chain_candidates"


# --- the shapes --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    peer_id: str
    capacity_bytes: int  # memory this peer can give to training (see protocol/capacity.py)
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


# --- formation ---------------------------------------------------------------------------------


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
    at once (default the run's batch size, see protocol/capacity.py)."""
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


# --- records -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CandidateRecord:
    """What a peer too small for a full replica publishes under ``chain_candidates_key``."""

    spec: str  # the run-spec digest it trains with
    capacity: int  # bytes it can give to training
    bandwidth: float  # Mbit/s it measured or was told
    state: str  # one of CANDIDATE_STATES
    endpoint: str = ""  # "host:port" of its stage listener, where the previous stage connects

    def to_dict(self) -> Dict[str, Any]:
        return {
            "v": PROTOCOL_VERSION, "spec": self.spec, "capacity": self.capacity,
            "bandwidth": self.bandwidth, "state": self.state, "endpoint": self.endpoint,
        }

    def to_bytes(self) -> bytes:
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    def candidate(self, peer_id: str) -> Candidate:
        return Candidate(peer_id, self.capacity, self.bandwidth)


@dataclass(frozen=True)
class ChainAssignment:
    """What the coordinator publishes for one chain under ``chains_key``; a higher ``epoch``
    supersedes any older assignment of the same peers."""

    spec: str
    epoch: int
    chain: Chain

    def to_dict(self) -> Dict[str, Any]:
        return {
            "v": PROTOCOL_VERSION,
            "spec": self.spec,
            "epoch": self.epoch,
            "chain": self.chain.chain_id,
            "stages": [[p, s, e] for p, s, e in self.chain.ranges()],
        }

    def to_bytes(self) -> bytes:
        return msgpack.packb(self.to_dict(), use_bin_type=True)


_CANDIDATE_KEYS = {"v", "spec", "capacity", "bandwidth", "state", "endpoint"}
_ENDPOINT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]{1,253}):(\d{1,5})$")
_ASSIGNMENT_KEYS = {"v", "spec", "epoch", "chain", "stages"}


def parse_candidate(value: Any, spec: Optional[RunSpec] = None) -> CandidateRecord:
    """Validate a candidate record (a map or its msgpack bytes); ChainError on anything unexpected.
    With ``spec``, a record for another run digest is rejected too."""
    rec = _as_map(value, _CANDIDATE_KEYS, "chain candidate")
    _version(rec, "chain candidate")
    digest = _short_str(rec["spec"], "chain candidate spec", 64)
    if spec is not None and digest != spec.digest():
        raise ChainError(f"chain candidate is for run spec {digest!r}, not {spec.digest()!r}")
    capacity = _int(rec["capacity"], "chain candidate capacity", 1, 1 << 62)
    bandwidth = rec["bandwidth"]
    if isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)):
        raise ChainError("chain candidate bandwidth must be a number")
    if not (math.isfinite(bandwidth) and 0 < bandwidth <= 1e9):
        raise ChainError(f"chain candidate bandwidth must be a positive finite Mbit/s, got {bandwidth!r}")
    state = rec["state"]
    if state not in CANDIDATE_STATES:
        raise ChainError(f"chain candidate state must be one of {CANDIDATE_STATES}, got {state!r}")
    endpoint = _short_str(rec["endpoint"], "chain candidate endpoint", 270) if rec["endpoint"] else ""
    if endpoint and (not _ENDPOINT.match(endpoint) or not 0 < int(endpoint.rsplit(":", 1)[1]) < 65536):
        raise ChainError(f"chain candidate endpoint must be host:port, got {endpoint!r}")
    return CandidateRecord(digest, capacity, float(bandwidth), state, endpoint)


def parse_assignment(value: Any, spec: RunSpec) -> ChainAssignment:
    """Validate a chain assignment (a map or its msgpack bytes) against the run: the stages must
    cover blocks [0, n_layers) contiguously, one distinct peer each, and the chain id must be the
    one derived from them. ChainError on anything unexpected."""
    rec = _as_map(value, _ASSIGNMENT_KEYS, "chain assignment")
    _version(rec, "chain assignment")
    digest = _short_str(rec["spec"], "chain assignment spec", 64)
    if digest != spec.digest():
        raise ChainError(f"chain assignment is for run spec {digest!r}, not {spec.digest()!r}")
    epoch = _int(rec["epoch"], "chain assignment epoch", 0, 1 << 62)
    chain_id = _short_str(rec["chain"], "chain assignment chain id", 64)
    stages = rec["stages"]
    n_layers = spec.model.n_layers
    if not isinstance(stages, list) or not 1 <= len(stages) <= min(MAX_STAGES, n_layers):
        raise ChainError(f"chain assignment stages must be a list of 1 to {min(MAX_STAGES, n_layers)} entries")
    ranges: List[Tuple[str, int, int]] = []
    expected_start = 0
    for i, entry in enumerate(stages):
        if not (isinstance(entry, list) and len(entry) == 3):
            raise ChainError(f"chain assignment stage {i} must be [peer id, start block, end block]")
        peer = _short_str(entry[0], f"chain assignment stage {i} peer id", MAX_PEER_ID)
        start = _int(entry[1], f"chain assignment stage {i} start block", 0, n_layers - 1)
        end = _int(entry[2], f"chain assignment stage {i} end block", 1, n_layers)
        if start != expected_start or end <= start:
            raise ChainError(
                f"chain assignment stage {i} covers [{start}, {end}); expected a non-empty range starting at {expected_start}"
            )
        ranges.append((peer, start, end))
        expected_start = end
    if expected_start != n_layers:
        raise ChainError(f"chain assignment stages end at block {expected_start}, not at n_layers={n_layers}")
    peers = [p for p, _, _ in ranges]
    if len(set(peers)) != len(peers):
        raise ChainError("chain assignment names a peer in more than one stage")
    chain = make_chain(ranges)
    if chain.chain_id != chain_id:
        raise ChainError(f"chain assignment id {chain_id!r} does not match its stages ({chain.chain_id!r})")
    return ChainAssignment(digest, epoch, chain)


def latest_assignments(assignments: Iterable[ChainAssignment]) -> Dict[str, ChainAssignment]:
    """Per peer id, the assignment that holds for it: the highest epoch (ties: the lowest chain
    id, so every reader picks the same one). An older chain any of whose members was reassigned
    since is stale as a whole and maps no peer."""
    ranked = sorted(assignments, key=lambda a: (-a.epoch, a.chain.chain_id))
    out: Dict[str, ChainAssignment] = {}
    for a in ranked:
        if any(p in out for p in a.chain.members):
            continue
        for p in a.chain.members:
            out[p] = a
    return out


def _as_map(value: Any, keys: set, what: str) -> Dict[str, Any]:
    if isinstance(value, (bytes, bytearray)):
        if len(value) > MAX_RECORD_BYTES:
            raise ChainError(f"{what} record of {len(value)} bytes is too large")
        n = len(value)
        try:
            value = msgpack.unpackb(
                bytes(value), raw=False, strict_map_key=True, max_str_len=n, max_bin_len=n, max_array_len=n,
                max_map_len=n, max_ext_len=0,
            )
        except Exception as e:  # msgpack raises several unrelated types
            raise ChainError(f"{what} record is not valid msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(value, dict):
        raise ChainError(f"{what} record must be a map, got {type(value).__name__}")
    if set(value) != keys:
        got = sorted(map(str, value))
        raise ChainError(f"{what} record must have exactly the fields {sorted(keys)}, got {got}")
    return value


def _version(rec: Mapping[str, Any], what: str) -> None:
    v = rec["v"]
    if type(v) is not int or v != PROTOCOL_VERSION:
        raise ChainError(f"{what} protocol version {v!r} is not {PROTOCOL_VERSION}")


def _int(v: Any, what: str, lo: int, hi: int) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise ChainError(f"{what} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _short_str(v: Any, what: str, limit: int) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= limit:
        raise ChainError(f"{what} must be a non-empty string of at most {limit} characters")
    return v


__all__ = [
    "Candidate",
    "Stage",
    "Chain",
    "ChainError",
    "CandidateRecord",
    "ChainAssignment",
    "CANDIDATE_STATES",
    "chain_id_for",
    "make_chain",
    "stage_shapes",
    "plan_chain",
    "form_chains",
    "parse_candidate",
    "parse_assignment",
    "latest_assignments",
    "chains_key",
    "chain_candidates_key",
]
