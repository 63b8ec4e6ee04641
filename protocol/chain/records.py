"""Chain records: what peers and the coordinator publish about pipeline chains (protocol/chain/stages.py).

A peer too small for a full replica publishes a ``CandidateRecord`` under ``chain_candidates_key``;
the coordinator publishes one ``ChainAssignment`` per chain under ``chains_key``, with an ``epoch``
that grows at every re-formation so that a newer assignment supersedes an older one that names the
same peer (``latest_assignments``). ``parse_candidate`` and ``parse_assignment`` validate a record
from the network and raise ``ChainError`` on anything unexpected.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

import msgpack

from protocol import PROTOCOL_VERSION
from protocol.wire.bounded_unpack import bounded_unpack
from protocol.chain.stages import Candidate, Chain, make_chain
from protocol.chain.endpoints import MAX_ENDPOINTS, SEPARATOR, EndpointError, split_endpoints
from protocol.errors import ProtocolError
from protocol.dht.keys import CANDIDATES_FIELD, CHAINS_FIELD
from protocol.spec import RunSpec

__all__ = [
    "ChainError",
    "CandidateRecord",
    "ChainAssignment",
    "CANDIDATE_STATES",
    "parse_candidate",
    "parse_assignment",
    "latest_assignments",
    "chains_key",
    "chain_candidates_key",
    "ASSIGNMENT_TTL",
]

MAX_STAGES = 64  # the most stages an assignment record may name
MAX_PEER_ID = 128  # characters of a peer id
MAX_RECORD_BYTES = 1 << 14
CANDIDATE_STATES = ("waiting", "assigned", "leaving")
ASSIGNMENT_TTL = 60.0  # seconds an assignment record lives; the coordinator refreshes live chains


class ChainError(ProtocolError):
    """A chain candidate or assignment record that does not follow the protocol."""


def chains_key(run_id: str) -> str:
    """Chain assignments, one subkey per chain (owner marker + chain id), signed by the run's key."""
    return f"{run_id}_{CHAINS_FIELD}"


def chain_candidates_key(run_id: str) -> str:
    """Chain candidate records, one subkey per peer (its owner marker)."""
    return f"{run_id}_{CANDIDATES_FIELD}"


@dataclass(frozen=True)
class CandidateRecord:
    """What a peer too small for a full replica publishes under ``chain_candidates_key``."""

    spec: str  # the run-spec digest it trains with
    capacity: int  # bytes it can give to training
    bandwidth: float  # Mbit/s it measured or was told
    state: str  # one of CANDIDATE_STATES
    endpoint: str = ""  # "host:port[,host:port...]" of its stage listener (protocol/chain/endpoints.py)

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
_ENDPOINT = re.compile(r"(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]{1,253}):(\d{1,5})")  # fullmatch: "$" passes a "\n"
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
    items = endpoint.split(SEPARATOR) if endpoint else []
    if any(not _ENDPOINT.fullmatch(e) for e in items) or not _dialable(endpoint):  # (_dialable counts them too)
        raise ChainError(f"chain candidate endpoint must be host:port (up to {MAX_ENDPOINTS}, comma-separated), "
                         f"got {endpoint!r:.80}")
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


def _dialable(endpoint: str) -> bool:
    """Whether every host of ``endpoint`` is one a socket can dial (a DNS label over 63 characters
    passed the pattern above and made the stage that dialed it raise)."""
    try:
        split_endpoints(endpoint)
    except EndpointError:
        return False
    return True


def _as_map(value: Any, keys: set, what: str) -> Dict[str, Any]:
    if isinstance(value, (bytes, bytearray)):
        if len(value) > MAX_RECORD_BYTES:
            raise ChainError(f"{what} record of {len(value)} bytes is too large")
        n = len(value)
        value = bounded_unpack(bytes(value), ChainError, f"{what} record", max_array_len=n, max_map_len=n)
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
