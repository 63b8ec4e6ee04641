"""A swarm member that only lies in its progress record (tests): it never trains, never serves a
state and never joins a group.

    python -m tests.support.stalling_peer JOIN_ADDR RUN_KEY MODE SECONDS

MODE:
- ``stall``: claims to be "training" at the round the honest peers are at, so that they wait for it;
- ``far-ahead``: claims to be "training" at round 2**62, far ahead of everyone.
"""

from __future__ import annotations

import logging
import sys
import time

from protocol.dht.records import Progress
from swarm.dht.node import parse_multiaddrs, start_dht
from swarm.records import fetch_spec, publish_progress, read_progress

FAR = 1 << 62


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s stalling: %(message)s")
    join, run_key, mode, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    dht = start_dht(parse_multiaddrs([join]), ["/ip4/127.0.0.1/tcp/0"], run_key=run_key)
    spec = fetch_spec(dht)
    me = dht.peer_id.to_base58()
    logging.info(f"{me} lies as {mode!r} for {seconds:.0f} s")
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        honest = [v.progress.round for v in read_progress(dht, spec.run_id) if v.peer_id != me and v.progress.round < FAR]
        rnd = FAR if mode == "far-ahead" else max(honest, default=0)
        claim = Progress(rnd, 1, "training", spec.digest(), 0.0, float("nan"), 0, 0.0, 0, 0, "", -1)
        publish_progress(dht, spec.run_id, me, claim, ttl=10.0)
        time.sleep(0.2)
    dht.shutdown()


if __name__ == "__main__":
    main()
