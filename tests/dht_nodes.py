"""Real hivemind DHT nodes on loopback for the record tests: a first node that publishes the run's
spec, then ``others`` nodes that join it."""

from __future__ import annotations

from typing import Iterator, List

from protocol.spec import RunSpec
from swarm import records
from swarm.dht import start_dht

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def loopback_nodes(spec: RunSpec, others: int) -> Iterator[List]:
    """Yields [first, *others] started nodes; shuts them all down afterwards (a generator for a fixture)."""
    first = start_dht((), LOOPBACK, run_ids=[spec.run_id])
    started = [first]
    try:
        records.publish_run(first, spec)
        started += [start_dht(first.get_visible_maddrs(), LOOPBACK, run_ids=[spec.run_id]) for _ in range(others)]
        yield started
    finally:
        for n in started:
            n.shutdown()
