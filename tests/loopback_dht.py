"""Real hivemind DHT nodes on loopback for the records' tests: a coordinator that published a run's
spec, and peers joined to it."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, List

import hivemind

from protocol.records import Progress
from protocol.spec import RunSpec
from swarm import records
from swarm.dht import start_dht

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def progress(spec: RunSpec, rnd: int) -> Progress:
    """A progress record of a peer training round ``rnd``."""
    return Progress(rnd, 0, "training", spec.digest(), 1.0, 0.5, 0, 0.0, 0, 0, "hash", -1)


def join(coord: hivemind.DHT, spec: RunSpec, **kwargs) -> hivemind.DHT:
    return start_dht(coord.get_visible_maddrs(), LOOPBACK, run_ids=[spec.run_id], **kwargs)


@contextmanager
def loopback_swarm(spec: RunSpec, peers: int = 2) -> Iterator[List[hivemind.DHT]]:
    """[the coordinator's node, then ``peers`` nodes joined to it]; every node is shut down after."""
    coord = start_dht((), LOOPBACK, run_ids=[spec.run_id])
    started = [coord]
    try:
        records.publish_run(coord, spec)
        started += [join(coord, spec) for _ in range(peers)]
        yield started
    finally:
        for n in started:
            n.shutdown()
