"""The run's records in the DHT, read and written: the run spec, progress, chain candidates and assignments.

``protocol/`` defines their keys and schemas; this module does the DHT I/O. Malformed records
(anyone can write to the DHT) are skipped, never raised.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import hivemind
from hivemind.utils import get_dht_time

from protocol.chain_records import (
    CandidateRecord,
    ChainAssignment,
    chain_candidates_key,
    chains_key,
    latest_assignments,
    parse_assignment,
    parse_candidate,
)
from protocol.errors import ProtocolError, SpecError
from protocol.keys import RUNS_KEY, peers_key
from protocol.records import Progress, parse_progress
from protocol.spec import RunSpec
from swarm.console import UsageError

logger = logging.getLogger("voloco.swarm")


def publish_run(dht: hivemind.DHT, spec: RunSpec, ttl: float) -> bool:
    """Announce a run under the well-known runs key (subkey: run id)."""
    return bool(dht.store(RUNS_KEY, spec.to_bytes(), expiration_time=get_dht_time() + ttl, subkey=spec.run_id))


def fetch_spec(dht: hivemind.DHT, run_id: Optional[str] = None, timeout: float = 30.0) -> RunSpec:
    """The spec of the run to join: ``run_id``'s, or the only one published."""
    deadline = time.monotonic() + timeout
    while True:
        found = dht.get(RUNS_KEY, latest=True)
        runs: Dict[str, RunSpec] = {}
        errors = []
        if found is not None and isinstance(found.value, dict):
            for key, item in found.value.items():
                try:
                    spec = RunSpec.from_bytes(item.value)
                except SpecError as e:
                    errors.append(f"{key}: {e}")
                    continue
                runs[spec.run_id] = spec
        if run_id is not None and run_id in runs:
            return runs[run_id]
        if run_id is None and len(runs) == 1:
            return next(iter(runs.values()))
        if run_id is None and len(runs) > 1:
            raise UsageError(f"the DHT holds several runs ({', '.join(sorted(runs))}): choose one with --run")
        if time.monotonic() > deadline:
            what = f"run {run_id!r}" if run_id else "any run"
            extra = f" (unreadable records: {'; '.join(errors)})" if errors else ""
            raise UsageError(
                f"joined the DHT but found no spec of {what} in {timeout:.0f} s{extra}: is the coordinator of that run up?"
            )
        time.sleep(1.0)


@dataclass
class PeerView:
    peer_id: str
    progress: Progress
    expires: float


def read_progress(dht: hivemind.DHT, run_id: str) -> List[PeerView]:
    """Every live peer's last progress record; malformed records are skipped."""
    found = dht.get(peers_key(run_id), latest=True)
    out: List[PeerView] = []
    if found is None or not isinstance(found.value, dict):
        return out
    for key, item in found.value.items():
        try:
            progress = parse_progress(item.value)
        except ProtocolError as e:
            logger.debug(f"skipping a malformed progress record under {key!r}: {e}")
            continue
        out.append(PeerView(peer_id=str(key), progress=progress, expires=item.expiration_time))
    return out


def publish_progress(dht: hivemind.DHT, run_id: str, peer_id: str, progress: Progress, ttl: float) -> None:
    dht.store(
        peers_key(run_id), progress.to_dict(), expiration_time=get_dht_time() + ttl, subkey=peer_id, return_future=True
    )


# ---- chains: candidates (peers) and assignments (coordinator) -------------------------------------
def publish_candidate(dht: hivemind.DHT, run_id: str, peer_id: str, record: CandidateRecord, ttl: float) -> None:
    dht.store(chain_candidates_key(run_id), record.to_dict(), expiration_time=get_dht_time() + ttl, subkey=peer_id,
              return_future=True)


def read_candidates(dht: hivemind.DHT, spec: RunSpec) -> Dict[str, CandidateRecord]:
    """Live chain candidates of this run, by peer id; malformed records are skipped."""
    found = dht.get(chain_candidates_key(spec.run_id), latest=True)
    out: Dict[str, CandidateRecord] = {}
    if found is None or not isinstance(found.value, dict):
        return out
    for key, item in found.value.items():
        try:
            out[str(key)] = parse_candidate(item.value, spec)
        except ProtocolError as e:
            logger.debug(f"skipping a malformed chain candidate {key!r}: {e}")
    return out


def publish_assignment(dht: hivemind.DHT, spec: RunSpec, assignment: ChainAssignment, ttl: float) -> None:
    dht.store(chains_key(spec.run_id), assignment.to_dict(), expiration_time=get_dht_time() + ttl,
              subkey=assignment.chain.chain_id, return_future=True)


def read_assignments(dht: hivemind.DHT, spec: RunSpec) -> Dict[str, ChainAssignment]:
    """Per peer id, the chain assignment that holds for it (a newer epoch supersedes older chains)."""
    found = dht.get(chains_key(spec.run_id), latest=True)
    parsed: List[ChainAssignment] = []
    if found is not None and isinstance(found.value, dict):
        for key, item in found.value.items():
            try:
                parsed.append(parse_assignment(item.value, spec))
            except ProtocolError as e:
                logger.debug(f"skipping a malformed chain assignment {key!r}: {e}")
    return latest_assignments(parsed)
