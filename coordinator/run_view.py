"""The run as the dashboard shows it: one snapshot built from what the DHT holds, no I/O here.

``build_snapshot`` takes the verified progress records (swarm/records.py ``read_progress``), the
chain assignments and candidates, and returns plain data: the run, its peers, its chains, the
current round and its members. Every string in it that a peer wrote is the peer's own claim, so
the page renders it as text only (coordinator/static/dashboard.js) and the API emits strict JSON
(swarm/jsonout.py): a NaN loss becomes ``null``.

The swarm's round is the one at least two live peers have reached (the only one's with a single
peer), so one peer claiming round 2**62 moves neither the chart nor the "current round".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import median
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

from protocol.dht.records import CHOOSING, Progress
from protocol.round.round_policy import swarm_round  # the same rule the peers use: a round two peers reached

MAX_PEERS_SHOWN = 256  # rows of the peers table (the busiest); the API says how many there were
MAX_TRACKED = 4096  # peers whose running totals the coordinator remembers
MAX_LOSS = 1e6  # a loss outside [0, MAX_LOSS) is not a loss: it counts as unknown


@dataclass
class RunInfo:
    run_id: str
    spec: str  # the spec's digest
    strategy: str
    params: int
    inner_steps: int
    slices: int
    heartbeat_period: float


class Tally:
    """A running total over peers: per peer the largest count it claimed (a peer that leaves keeps
    counting), at least ``floor`` (what a restored history said, for a restarted coordinator)."""

    def __init__(self, floor: int = 0):
        self.by_peer: Dict[str, int] = {}
        self.gone = 0  # the counts of peers forgotten to keep ``by_peer`` bounded
        self.floor = floor

    def see(self, peer: str, value: int) -> None:
        value = max(self.by_peer.pop(peer, 0), value)
        self.by_peer[peer] = value  # the most recently seen last: the oldest are forgotten first
        while len(self.by_peer) > MAX_TRACKED:
            self.gone += self.by_peer.pop(next(iter(self.by_peer)))

    @property
    def total(self) -> int:
        return max(self.floor, self.gone + sum(self.by_peer.values()))


class Totals:
    """Tokens and bytes of the run so far (see ``Tally``)."""

    def __init__(self) -> None:
        self.tokens, self.sent, self.received = Tally(), Tally(), Tally()

    def update(self, views: Sequence[Any]) -> None:
        for v in views:
            p = v.progress
            self.tokens.see(v.peer_id, p.tokens)
            self.sent.see(v.peer_id, p.bytes_sent)
            self.received.see(v.peer_id, p.bytes_received)


def loss_or_nan(x: float) -> float:
    return x if math.isfinite(x) and 0.0 <= x < MAX_LOSS else float("nan")


def median_loss(values: Iterable[float]) -> float:
    """The median of the values that are losses; NaN if none is (a liar moves a median little)."""
    kept = [v for v in (loss_or_nan(x) for x in values) if not math.isnan(v)]
    return float(median(kept)) if kept else float("nan")


def role_of(peer_id: str, p: Progress, assignments: Mapping[str, Any], candidates: Mapping[str, Any]) -> Dict[str, Any]:
    """What a peer trains, for the table: full, slice owner s, chain stage N of chain X."""
    a = assignments.get(peer_id)
    stage = a.chain.stage_of(peer_id) if a is not None else None
    if stage is not None:
        n = len(a.chain.stages)
        return {"kind": "stage", "chain": a.chain.chain_id, "stage": stage.index + 1, "stages": n,
                "text": f"chain stage {stage.index + 1}/{n} of {a.chain.chain_id}"}
    if peer_id in candidates:
        return {"kind": "candidate", "text": "waiting for a chain"}
    if p.part >= 0:
        return {"kind": "slice", "slice": p.part, "text": f"slice owner {p.part}"}
    if p.part == CHOOSING:
        return {"kind": "choosing", "text": "choosing its part"}
    return {"kind": "full", "text": "full"}


def peer_row(v: Any, role: Dict[str, Any], now: float, record_ttl: float) -> Dict[str, Any]:
    p: Progress = v.progress
    return {
        "peer_id": v.peer_id,
        "role": role["text"],
        "role_kind": role["kind"],
        "chain": role.get("chain"),
        "stage": role.get("stage"),
        "slice": role.get("slice"),
        "state": p.state,
        "device": p.device,
        "round": p.round,
        "step": p.step,
        "loss": loss_or_nan(p.loss),
        "val_loss": loss_or_nan(p.val_loss),
        "tokens": p.tokens,
        "tokens_per_s": p.tokens_per_s if math.isfinite(p.tokens_per_s) and p.tokens_per_s >= 0 else None,
        "bytes_sent": p.bytes_sent,
        "bytes_received": p.bytes_received,
        "util": p.util,
        "reach": p.reach,
        "last_seen_s": round(max(0.0, now - (v.expires - record_ttl)), 1),  # a heartbeat stores with a fresh TTL
        "params_hash": p.params_hash,
    }


def chain_rows(assignments: Mapping[str, Any], rows: Mapping[str, Dict[str, Any]]) -> List[Dict[str, Any]]:
    chains: Dict[str, Any] = {}
    for a in assignments.values():
        chains.setdefault(a.chain.chain_id, a)
    out = []
    for cid in sorted(chains):
        a = chains[cid]
        stages = []
        for s in a.chain.stages:
            row = rows.get(s.peer_id)
            stages.append({
                "stage": s.index + 1, "peer_id": s.peer_id, "blocks": [s.start_block, s.end_block],
                "state": row["state"] if row else "absent", "tokens_per_s": row["tokens_per_s"] if row else None,
            })
        out.append({"chain_id": cid, "epoch": a.epoch, "stages": stages})
    return out


def build_snapshot(info: RunInfo, views: Sequence[Any], assignments: Mapping[str, Any], candidates: Mapping[str, Any],
                   now: float, record_ttl: float, totals: Optional[Totals] = None,
                   history: Optional[Dict[str, Any]] = None, wall_time: Optional[float] = None) -> Dict[str, Any]:
    """The dashboard's data: {"run", "peers", "chains", "history"} (see the module doc).

    ``views``: objects with ``peer_id``, ``progress`` and ``expires`` (swarm.records.PeerView);
    records of another spec are counted as ``foreign`` and not shown."""
    ours = [v for v in views if v.progress.spec == info.spec]
    live = [v for v in ours if v.progress.state != "stopped"]
    if totals is not None:
        totals.update(ours)
    rnd = swarm_round([v.progress.round for v in live])
    members = sorted(v.peer_id for v in live if v.progress.round == rnd)
    at_round = [v.progress for v in live if v.progress.round == rnd]
    rows = {v.peer_id: peer_row(v, role_of(v.peer_id, v.progress, assignments, candidates), now, record_ttl) for v in ours}
    shown = sorted(rows.values(), key=lambda r: (r["state"] == "stopped", -(r["tokens_per_s"] or 0.0), r["peer_id"]))
    points = (history or {}).get("points", [])
    best_hist = [pt["val_loss"] for pt in points if pt.get("val_loss") is not None and not math.isnan(pt["val_loss"])]
    val_now = median_loss(p.val_loss for p in at_round)  # a median: one peer's claim cannot set the best
    tps = sum(r["tokens_per_s"] or 0.0 for r in rows.values() if r["state"] != "stopped")
    run = {
        "run_id": info.run_id,
        "spec": info.spec,
        "strategy": info.strategy,
        "params": info.params,
        "inner_steps": info.inner_steps,
        "slices": info.slices,
        "time": wall_time,
        "round": rnd,
        "members": members[:MAX_PEERS_SHOWN],  # bounded like the peers table
        "members_total": len(members),
        "peers": len(live),
        "peers_stopped": len(ours) - len(live),
        "foreign_records": len(views) - len(ours),
        "chains": len({a.chain.chain_id for a in assignments.values()}),
        "candidates": len(candidates),
        "loss": median_loss(p.loss for p in at_round),
        "val_loss": val_now,
        "best_val_loss": min(([] if math.isnan(val_now) else [val_now]) + best_hist, default=float("nan")),
        "tokens_per_s": tps,
        "tokens_total": totals.tokens.total if totals else sum(v.progress.tokens for v in ours),
        "bytes_sent_total": totals.sent.total if totals else sum(v.progress.bytes_sent for v in ours),
        "bytes_received_total": totals.received.total if totals else sum(v.progress.bytes_received for v in ours),
    }
    return {
        "run": run,
        "peers": {"total": len(rows), "shown": min(len(rows), MAX_PEERS_SHOWN), "rows": shown[:MAX_PEERS_SHOWN]},
        "chains": chain_rows(assignments, rows),
        "history": history or {"stride": 1, "points": []},
    }
