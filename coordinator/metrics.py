"""Prometheus metrics of a run, from the dashboard's snapshot (coordinator/run_view.py).

A custom collector on a registry of its own: every scrape renders the latest snapshot, so a peer
that left has no stale series, and the per-peer series are bounded to ``MAX_PEER_SERIES`` peers
(the busiest). Label values that peers wrote (device, state) are escaped by prometheus_client.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, Optional

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

MAX_PEER_SERIES = 64

_RUN_GAUGES = (
    ("voloco_peers", "live peers of the run", "peers"),
    ("voloco_round", "the round at least two live peers have reached", "round"),
    ("voloco_chains", "pipeline chains assigned", "chains"),
    ("voloco_tokens_per_second", "tokens per second, all live peers", "tokens_per_s"),
    ("voloco_val_loss", "median validation loss of the peers at the current round (nats per byte)", "val_loss"),
    ("voloco_best_val_loss", "best validation loss seen (nats per byte)", "best_val_loss"),
)
_RUN_COUNTERS = (
    ("voloco_tokens", "tokens trained by the run's peers", "tokens_total"),
    ("voloco_bytes_sent", "bytes the run's peers sent", "bytes_sent_total"),
    ("voloco_bytes_received", "bytes the run's peers received", "bytes_received_total"),
)
_PEER_GAUGES = (
    ("voloco_peer_round", "the round the peer trains for", "round"),
    ("voloco_peer_loss", "the peer's last training loss", "loss"),
    ("voloco_peer_val_loss", "the peer's last validation loss", "val_loss"),
    ("voloco_peer_tokens", "tokens the peer trained on", "tokens"),
    ("voloco_peer_tokens_per_second", "the peer's tokens per second", "tokens_per_s"),
    ("voloco_peer_bytes_sent", "bytes the peer sent", "bytes_sent"),
    ("voloco_peer_bytes_received", "bytes the peer received", "bytes_received"),
    ("voloco_peer_utilization", "time in inner steps over wall time, last round", "util"),
    ("voloco_peer_last_seen_seconds", "seconds since the peer's last heartbeat", "last_seen_s"),
)


def _num(v: Any) -> float:
    return float("nan") if v is None else float(v)


class SnapshotCollector:
    def __init__(self, snapshot: Callable[[], Optional[Dict[str, Any]]]):
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        if not snap:
            return
        run = snap["run"]
        labels = {"run": run["run_id"]}
        for name, doc, key in _RUN_GAUGES:
            g = GaugeMetricFamily(name, doc, labels=list(labels))
            g.add_metric(list(labels.values()), _num(run[key]))
            yield g
        for name, doc, key in _RUN_COUNTERS:
            c = CounterMetricFamily(name, doc, labels=list(labels))
            c.add_metric(list(labels.values()), _num(run[key]))
            yield c
        rows = snap["peers"]["rows"][:MAX_PEER_SERIES]
        for name, doc, key in _PEER_GAUGES:
            g = GaugeMetricFamily(name, doc, labels=["peer"])
            for r in rows:
                g.add_metric([r["peer_id"]], _num(r[key]))
            yield g
        info = GaugeMetricFamily("voloco_peer_info", "what the peer says of itself (value 1)",
                                 labels=["peer", "role", "device", "state", "reach"])
        for r in rows:
            info.add_metric([r["peer_id"], r["role"], r["device"], r["state"], r["reach"]], 1.0)
        yield info


def make_registry(snapshot: Callable[[], Optional[Dict[str, Any]]]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshot))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
