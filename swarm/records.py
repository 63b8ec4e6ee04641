"""The run's records in the DHT, read and written: the run spec, progress, chain candidates and assignments,
the loss history.

``protocol/`` defines their keys, envelopes and schemas; this module does the DHT I/O. Every record
is written under its writer's owned subkey and signed by its DHT node (swarm/dht/validators.py). A
reader keeps only records whose envelope names the peer id of the key that signed them, that prove
the join token in a private run, that expire no further ahead than their writer's TTL allows, and
whose body parses; the rest are skipped (logged at debug), never raised. Views are keyed by the
peer id inside the signed envelope, so one key never speaks for another peer. Chain assignments
count only when signed by the key of the run's spec; the spec itself, only when signed by the
``--run-key`` the person gave (swarm/access/identity.py holds what each node trusts).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set, Tuple

import hivemind
from hivemind.utils import get_dht_time

from protocol.chain.records import (
    ASSIGNMENT_TTL,
    CandidateRecord,
    ChainAssignment,
    chain_candidates_key,
    chains_key,
    latest_assignments,
    parse_assignment,
    parse_candidate,
)
from protocol.errors import ProtocolError, SpecError
from protocol.dht.history import HISTORY_TTL, HistoryRecord, history_key, parse_history
from protocol.dht.keys import RUNS_KEY, key_fingerprint, owned_subkey, peers_key
from protocol.dht.records import (
    MAX_RECORD_TTL,
    SPEC_TTL,
    Progress,
    RecordError,
    encode_body,
    expires_too_late,
    parse_progress,
    peer_record_ttl,
    record_mac,
    seal,
)
from protocol.spec import RunSpec
from swarm.console import UsageError
from swarm.access.identity import NodeTrust, trust_of
from swarm.dht.lean_store import store_lean
from swarm.dht.replica_reads import NEAREST_BEAM, replica_get, search_args
from swarm.dht.validators import check_owned, key_id, run_schema

logger = logging.getLogger("voloco.swarm")


@dataclass(frozen=True)
class Entry:
    """One owned record that passed every check but its body's own parsing."""

    owner: bytes  # the signer's public key
    name: str  # what follows the owner marker in the subkey
    peer: str  # the peer id it speaks for (derived from ``owner``)
    body: bytes
    expiration: float


def verified_entries(key: str, found: Any, token_key: Optional[bytes], ttl: float) -> List[Entry]:
    """The owned records of a ``dht.get(key, latest=True)`` result that hold (see the module doc)."""
    if found is None or not isinstance(found.value, dict):
        return []
    kid, now = key_id(key), get_dht_time()
    out = []
    for subkey, item in found.value.items():
        try:
            if expires_too_late(item.expiration_time, now, ttl):
                raise RecordError(f"expires {item.expiration_time - now:.0f} s ahead, beyond its writer's TTL of {ttl:.0f} s")
            owner, name, peer, body = check_owned(kid, subkey, item.value, token_key)
        except RecordError as e:
            logger.debug(f"skipping a record under {key!r}: {e}")
            continue
        out.append(Entry(owner, name, peer, body, item.expiration_time))
    return out


# Reads of the run's keys that a replica of them serves from its own storage: swarm/dht/replica_reads.py.


# Stores search toward the key's shadow (swarm/dht/lean_store.py) instead of fetching the key's value from
# every node on the way; bench/wire_bytes.py --ops turns this off for its baseline.
LEAN_STORES = True


def _read(dht: hivemind.DHT, key: str, ttl: float, beam_size: Optional[int] = None, replica_ok: bool = False) -> List[Entry]:
    """The verified records under ``key``; ``replica_ok``: from this node's own storage while it is a
    replica of the key (swarm/dht/replica_reads.py)."""
    trust = trust_of(dht)
    if replica_ok and getattr(dht, "run_coroutine", None) is not None:  # (a stand-in DHT may not run coroutines)
        found = replica_get(dht, key, ttl, beam_size)
    else:
        found = dht.get(key, latest=True, **search_args(beam_size))
    return verified_entries(key, found, trust.token_key, ttl)


def _per_peer(entries: List[Entry], key: str) -> Dict[str, Entry]:
    """One record per peer (subkey: its bare owner marker); a peer named twice counts for none."""
    out: Dict[str, Entry] = {}
    twice: Set[str] = set()
    for e in entries:
        if e.name:
            logger.debug(f"skipping a record under {key!r} with a named subkey {e.name!r}")
        elif e.peer in out:
            twice.add(e.peer)
        else:
            out[e.peer] = e
    for peer in twice:
        logger.debug(f"skipping every record of {peer} under {key!r}: it appears more than once")
        del out[peer]
    return out


def _store(dht: hivemind.DHT, key: str, body: bytes, ttl: float, name: str = "", wait: bool = False,
           beam_size: Optional[int] = None):
    """Write ``body`` under this node's owned subkey: the DHT node signs it (RSASignatureValidator). A
    real DHT stores it without fetching the key's value on the way (swarm/dht/lean_store.py)."""
    trust = trust_of(dht)
    me = trust.identity
    subkey = owned_subkey(me.public_key, name)
    mac = record_mac(trust.token_key, key_id(key), subkey, me.peer_id, body) if trust.token_key is not None else b""
    value, expiration = seal(me.peer_id, body, mac), get_dht_time() + ttl
    if LEAN_STORES and getattr(dht, "run_coroutine", None) is not None:  # (a stand-in DHT may not run coroutines)
        return store_lean(dht, key, subkey, value, expiration, beam_size=beam_size, wait=wait)
    return dht.store(key, value, expiration_time=expiration, subkey=subkey, return_future=not wait,
                     **search_args(beam_size))


def _check_self(dht: hivemind.DHT, peer_id: str) -> None:
    if peer_id != trust_of(dht).identity.peer_id:
        raise ValueError(f"a node can only write its own records, not those of {peer_id}")


def _accept(trust: NodeTrust, dht: hivemind.DHT, spec: RunSpec, owner: bytes) -> None:
    if spec.run_id not in trust.specs:
        dht.add_validators([run_schema(spec.run_id)])
    trust.owners[spec.run_id], trust.specs[spec.run_id] = owner, spec


# ---- the run spec (coordinator) ------------------------------------------------------------------
def publish_run(dht: hivemind.DHT, spec: RunSpec, ttl: float = SPEC_TTL) -> bool:
    """Announce a run under the well-known runs key, signed by this node's key: the run's key."""
    trust = trust_of(dht)
    if spec.run_id not in trust.specs:
        _accept(trust, dht, spec, trust.identity.public_key)
    return bool(_store(dht, RUNS_KEY, spec.to_bytes(), ttl, name=spec.run_id, wait=True))


_warned: Set[Tuple[str, str, str]] = set()


def _warn_once(kind: str, fingerprint: str, digest: str, message: str) -> None:
    if (kind, fingerprint, digest) not in _warned:
        _warned.add((kind, fingerprint, digest))
        logger.warning(message)


def _published_specs(dht: hivemind.DHT, run_key: Optional[str], errors: List[str]) -> Dict[str, Dict[bytes, RunSpec]]:
    """run id -> {signer's key: spec} of every readable spec record (only the run key's with ``run_key``)."""
    runs: Dict[str, Dict[bytes, RunSpec]] = {}
    for e in _read(dht, RUNS_KEY, SPEC_TTL):
        fingerprint = key_fingerprint(e.owner)
        try:
            spec = RunSpec.from_bytes(e.body)
        except SpecError as err:
            errors.append(f"{fingerprint[:8]}: {err}")
            continue
        if spec.run_id != e.name:
            errors.append(f"{fingerprint[:8]}: spec of run {spec.run_id!r} filed as {e.name!r}")
            continue
        if run_key is not None and fingerprint != run_key:
            _warn_once("forged", fingerprint, spec.digest(), (
                f"ignoring a run spec of run {spec.run_id!r} (spec {spec.digest()}, inner lr {spec.inner.lr:g}, corpus "
                f"{spec.data.corpus!r}) signed by key {fingerprint}: it is not the run key {run_key} given with --run-key"
            ))
            continue
        runs.setdefault(spec.run_id, {})[e.owner] = spec
    return runs


def fetch_spec(
    dht: hivemind.DHT, run_id: Optional[str] = None, timeout: float = 30.0, run_key: Optional[str] = None
) -> RunSpec:
    """The spec of the run to join: ``run_id``'s, or the only one published; with a run key (this
    argument, else the node's ``--run-key``), only a spec signed by that key counts."""
    trust = trust_of(dht)
    run_key = run_key or trust.run_key
    deadline = time.monotonic() + timeout
    while True:
        errors: List[str] = []
        runs = _published_specs(dht, run_key, errors)
        if run_id is not None:
            runs = {run_id: runs[run_id]} if run_id in runs else {}
        if len(runs) > 1:
            raise UsageError(f"the DHT holds several runs ({', '.join(sorted(runs))}): choose one with --run")
        if len(runs) == 1:
            (rid, by_owner), = runs.items()
            if len(by_owner) > 1:
                keys = ", ".join(sorted(key_fingerprint(k) for k in by_owner))
                raise UsageError(
                    f"run {rid!r} is published by {len(by_owner)} different keys ({keys}): pass the --run-key "
                    f"the coordinator printed to tell the real spec from the others"
                )
            (owner, spec), = by_owner.items()
            if run_key is None:
                fingerprint = key_fingerprint(owner)
                _warn_once("unauthenticated", fingerprint, spec.digest(), (
                    f"the run spec is unauthenticated: accepting run {rid!r} signed by key {fingerprint} without a "
                    f"--run-key; any DHT node could have published it (pass --run-key as the coordinator printed it)"
                ))
            _accept(trust, dht, spec, owner)
            return spec
        if time.monotonic() > deadline:
            what = f"run {run_id!r}" if run_id else "any run"
            signed = f" signed by run key {run_key}" if run_key else ""
            extra = f" (unreadable records: {'; '.join(errors)})" if errors else ""
            private = "" if trust.token_key is not None else " and, for a private run, was it given a --join-token?"
            raise UsageError(
                f"joined the DHT but found no spec of {what}{signed} in {timeout:.0f} s{extra}: is the coordinator of "
                f"that run up{private}"
            )
        time.sleep(1.0)


# ---- progress (peers) -----------------------------------------------------------------------------
@dataclass
class PeerView:
    peer_id: str
    progress: Progress
    expires: float


def _peer_ttl(dht: hivemind.DHT, run_id: str) -> float:
    spec = trust_of(dht).specs.get(run_id)
    return peer_record_ttl(spec.swarm.heartbeat_period) if spec is not None else MAX_RECORD_TTL


def read_progress(dht: hivemind.DHT, run_id: str) -> List[PeerView]:
    """Every live peer's last progress record, by the peer id it is bound to; the rest is skipped."""
    key = peers_key(run_id)
    out: List[PeerView] = []
    for peer, e in _per_peer(_read(dht, key, _peer_ttl(dht, run_id), beam_size=NEAREST_BEAM, replica_ok=True), key).items():
        try:
            progress = parse_progress(e.body)
        except ProtocolError as err:
            logger.debug(f"skipping a malformed progress record of {peer}: {err}")
            continue
        out.append(PeerView(peer_id=peer, progress=progress, expires=e.expiration))
    return out


def publish_progress(dht: hivemind.DHT, run_id: str, peer_id: str, progress: Progress, ttl: float):
    """Store this node's progress record; returns the store's future (True once stored)."""
    _check_self(dht, peer_id)
    return _store(dht, peers_key(run_id), encode_body(progress.to_wire()), ttl, beam_size=NEAREST_BEAM)


# ---- chains: candidates (peers) and assignments (coordinator) -------------------------------------
def publish_candidate(dht: hivemind.DHT, run_id: str, peer_id: str, record: CandidateRecord, ttl: float):
    _check_self(dht, peer_id)
    return _store(dht, chain_candidates_key(run_id), record.to_bytes(), ttl)


def read_candidates(dht: hivemind.DHT, spec: RunSpec) -> Dict[str, CandidateRecord]:
    """Live chain candidates of this run, by peer id; malformed records are skipped."""
    key = chain_candidates_key(spec.run_id)
    out: Dict[str, CandidateRecord] = {}
    ttl = peer_record_ttl(spec.swarm.heartbeat_period)
    for peer, e in _per_peer(_read(dht, key, ttl, beam_size=NEAREST_BEAM, replica_ok=True), key).items():
        try:
            out[peer] = parse_candidate(e.body, spec)
        except ProtocolError as err:
            logger.debug(f"skipping a malformed chain candidate of {peer}: {err}")
    return out


def publish_assignment(dht: hivemind.DHT, spec: RunSpec, assignment: ChainAssignment, ttl: float = ASSIGNMENT_TTL):
    return _store(dht, chains_key(spec.run_id), assignment.to_bytes(), ttl, name=assignment.chain.chain_id)


def read_assignments(dht: hivemind.DHT, spec: RunSpec) -> Dict[str, ChainAssignment]:
    """Per peer id, the chain assignment that holds for it (a newer epoch supersedes older chains).
    Only assignments signed by the key that signed the run's spec count."""
    owner = trust_of(dht).owners.get(spec.run_id)
    parsed: List[ChainAssignment] = []
    for e in _read(dht, chains_key(spec.run_id), ASSIGNMENT_TTL, beam_size=NEAREST_BEAM, replica_ok=True):
        if e.owner != owner:
            logger.debug(f"skipping a chain assignment {e.name!r} signed by {e.peer}, not by the run's key")
            continue
        try:
            a = parse_assignment(e.body, spec)
        except ProtocolError as err:
            logger.debug(f"skipping a malformed chain assignment {e.name!r}: {err}")
            continue
        if a.chain.chain_id != e.name:
            logger.debug(f"skipping chain assignment {a.chain.chain_id!r} filed as {e.name!r}")
            continue
        parsed.append(a)
    return latest_assignments(parsed)


# ---- the loss history (coordinator) ---------------------------------------------------------------
def publish_history(dht: hivemind.DHT, spec: RunSpec, record: HistoryRecord, ttl: float = HISTORY_TTL):
    """Store the dashboard's loss history, signed by this node's key (the run's key); returns the store's future."""
    return _store(dht, history_key(spec.run_id), record.to_bytes(), ttl)


def read_history(dht: hivemind.DHT, spec: RunSpec) -> Optional[HistoryRecord]:
    """The loss history of this run's spec, if the run's key stored one that parses; else None."""
    owner = trust_of(dht).owners.get(spec.run_id)
    for e in _read(dht, history_key(spec.run_id), HISTORY_TTL):
        if e.owner != owner or e.name:
            logger.debug(f"skipping a loss history signed by {e.peer}, not by the run's key")
            continue
        try:
            record = parse_history(e.body)
        except ProtocolError as err:
            logger.debug(f"skipping a malformed loss history: {err}")
            continue
        if record.spec == spec.digest():
            return record
    return None
