"""Real hivemind DHT nodes on loopback for the record tests: a first node that publishes the run's
spec (if given), then ``others`` nodes that join it."""

from __future__ import annotations

from typing import Iterator, List, Optional

from protocol.spec import RunSpec
from swarm import records
from swarm.dht.node import start_dht

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def loopback_nodes(spec: Optional[RunSpec], others: int) -> Iterator[List]:
    """Yields [first, *others] started nodes; shuts them all down afterwards (a generator for a fixture).
    With ``spec`` None, the nodes know no run and the first publishes none."""
    run_ids = [spec.run_id] if spec is not None else []
    first = start_dht((), LOOPBACK, run_ids=run_ids)
    started = [first]
    try:
        if spec is not None:
            records.publish_run(first, spec)
        started += [start_dht(first.get_visible_maddrs(), LOOPBACK, run_ids=run_ids) for _ in range(others)]
        yield started
    finally:
        for n in started:
            n.shutdown()


def loopback_gatherers(cls, servers: int, clients: int = 0, **kwargs) -> Iterator[List]:
    """Yields started gatherers of class ``cls`` (peer/exchange/gatherer.py's or a test's subclass, made
    with ``kwargs``), one per node: ``servers`` nodes, then ``clients`` in hivemind's client mode (they
    follow, never lead); shuts them and their nodes down afterwards (a generator for a fixture)."""
    first = start_dht((), LOOPBACK)
    nodes = [first] + [start_dht(first.get_visible_maddrs(), LOOPBACK) for _ in range(servers - 1)]
    nodes += [start_dht(first.get_visible_maddrs(), LOOPBACK, client_mode=True) for _ in range(clients)]
    made = []
    try:
        for node in nodes:
            made.append(cls(node, **kwargs))
            made[-1].run_in_background(await_ready=True)
        yield made
    finally:
        for g in made:
            g.shutdown()
        for node in nodes:
            node.shutdown()
