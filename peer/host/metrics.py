"""A peer's Prometheus metrics (``--metrics-port N``): what its progress record says, scraped live.

A collector on a registry of its own reads the peer's progress record (``Peer._progress``) at
every scrape, so the numbers are the ones the peer publishes to the DHT; the wire bytes
(swarm/wire/meter.py: every TCP byte of the peer's processes, and the control plane's share of
them) come from the peer's status, which the DHT record leaves out. prometheus_client's WSGI
app is served by the standard library's WSGI server in a daemon thread; ``shutdown`` stops it.
"""

from __future__ import annotations

import logging
import threading
from socketserver import ThreadingMixIn
from typing import Any, Callable, Iterator, Optional
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from peer.host.lifecycle import wire_status
from protocol.dht.records import STATES, Progress
from swarm.console import UsageError

logger = logging.getLogger("voloco.peer")

_GAUGES = (
    ("voloco_peer_round", "the round this peer trains for", "round"),
    ("voloco_peer_step", "inner steps done in this round", "step"),
    ("voloco_peer_loss", "last training loss (nats per byte)", "loss"),
    ("voloco_peer_val_loss", "last validation loss (nats per byte; NaN before the first evaluation)", "val_loss"),
    ("voloco_peer_tokens_per_second", "tokens per second of the inner steps", "tokens_per_s"),
    ("voloco_peer_utilization", "time in inner steps over wall time, last round", "util"),
)
_COUNTERS = (
    ("voloco_peer_tokens", "tokens this peer trained on", "tokens"),
    ("voloco_peer_bytes_sent", "bytes sent (exchange and state download)", "bytes_sent"),
    ("voloco_peer_bytes_received", "bytes received (exchange and state download)", "bytes_received"),
)


_WIRE_COUNTERS = (
    ("voloco_peer_wire_bytes_sent", "TCP payload bytes the peer's processes sent (all traffic; retransmissions included)", "sent"),
    ("voloco_peer_wire_bytes_received", "TCP payload bytes the peer's processes received (all traffic)", "received"),
    ("voloco_peer_wire_packets_sent", "TCP segments the peer's processes sent, pure ACKs included", "packets_sent"),
    ("voloco_peer_wire_packets_received", "TCP segments the peer's processes received", "packets_received"),
)


class ProgressCollector:
    def __init__(self, progress: Callable[[], Progress], peer_id: Callable[[], str],
                 wire: Optional[Callable[[], Optional[dict]]] = None):
        self._progress, self._peer_id, self._wire = progress, peer_id, wire

    def collect(self) -> Iterator[Metric]:
        try:
            p = self._progress()
            peer = self._peer_id()
        except Exception:  # still starting: nothing to say yet
            return
        labels = ["peer"]
        for name, doc, key in _GAUGES:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([peer], float(getattr(p, key)))
            yield g
        for name, doc, key in _COUNTERS:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric([peer], float(getattr(p, key)))
            yield c
        state = GaugeMetricFamily("voloco_peer_state", "1 for the state the peer is in", labels=["peer", "state"])
        for s in STATES:
            state.add_metric([peer, s], 1.0 if p.state == s else 0.0)
        yield state
        info = GaugeMetricFamily("voloco_peer_info", "the peer's device, part and reachability (value 1)",
                                 labels=["peer", "device", "part", "reach"])
        info.add_metric([peer, p.device, str(p.part), p.reach], 1.0)
        yield info
        yield from self._wire_metrics(peer)

    def _wire_metrics(self, peer: str) -> Iterator[Metric]:
        """The wire bytes (swarm/wire_bytes.wire_report), nothing when they are unknown."""
        try:
            wire = self._wire() if self._wire is not None else None
        except Exception:
            wire = None
        if not wire:
            return
        for name, doc, key in _WIRE_COUNTERS:
            c = CounterMetricFamily(name, doc, labels=["peer"])
            c.add_metric([peer], float(wire[key]))
            yield c
        # by kind: control is what is left after the payloads and the chain's links, so it is a gauge
        for way in ("sent", "received"):
            g = GaugeMetricFamily(f"voloco_peer_wire_{way}_by_kind_bytes",
                                  f"wire bytes {way} by kind: payload (exchange, state download), chain (stage "
                                  f"links), control (DHT, matchmaking, framing: the rest)", labels=["peer", "kind"])
            for kind, value in wire[f"{way}_by"].items():
                g.add_metric([peer, kind], float(value))
            yield g


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    timeout = 10.0  # seconds a connection may stay silent: idle or slow clients cannot pile up threads

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature
        pass


class MetricsServer:
    """``/metrics`` (any path, as prometheus_client's app answers) on ``host:port``."""

    def __init__(self, progress: Callable[[], Progress], peer_id: Callable[[], str], port: int, host: str = "0.0.0.0",
                 wire: Optional[Callable[[], Optional[dict]]] = None):
        registry = CollectorRegistry(auto_describe=False)
        registry.register(ProgressCollector(progress, peer_id, wire))
        try:
            self._httpd = make_server(host, port, make_wsgi_app(registry), server_class=_Server, handler_class=_Quiet)
        except OSError as e:
            raise UsageError(f"--metrics-port {port}: cannot listen on {host}:{port} ({e.strerror or e})") from None
        self.port = self._httpd.server_port
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="voloco-metrics", daemon=True)
        self._thread.start()
        logger.info(f"metrics: http://{'localhost' if host == '0.0.0.0' else host}:{self.port}/metrics")

    def shutdown(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5.0)


def serve_metrics(peer: Any, port: int) -> MetricsServer:
    """Serve ``peer``'s progress and wire bytes as Prometheus metrics on ``port`` (every interface)."""
    return MetricsServer(peer._progress, lambda: peer.peer_id, port, wire=lambda: wire_status(peer))
