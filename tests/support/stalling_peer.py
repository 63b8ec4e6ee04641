"""A swarm member that only lies in its progress record (tests): it never trains, never serves a
state and never joins a group.

    python -m tests.support.stalling_peer JOIN_ADDR RUN_KEY MODE SECONDS

MODE:
- ``stall``: claims to be "training" at the round the honest peers are at, so that they wait for it;
- ``far-ahead``: claims to be "training" at round 2**62, far ahead of everyone;
- ``pair``: two identities that claim to be "training" at the honest peers' round and, both, to
  have gathered a set of that round in a group of their own (a name nobody can fetch): the claim
  that used to keep a no-show from ever being struck (protocol/round/no_shows.py);
- ``fresh``: ``stall`` under a new identity (a new DHT node and key) every round, so that no
  strike ever applies: what the budget for waits for strangers bounds.
"""

from __future__ import annotations

import dataclasses
import hashlib
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
    if mode not in ("stall", "far-ahead", "pair", "fresh"):
        raise SystemExit(f"MODE {mode!r}: stall, far-ahead, pair or fresh")

    def node():
        return start_dht(parse_multiaddrs([join]), ["/ip4/127.0.0.1/tcp/0"], run_key=run_key)

    dhts = [node() for _ in range(2 if mode == "pair" else 1)]
    spec = fetch_spec(dhts[0])
    mine = {d.peer_id.to_base58() for d in dhts}
    logging.info(f"{', '.join(sorted(mine))}: lies as {mode!r} for {seconds:.0f} s")
    end, last = time.monotonic() + seconds, None
    while time.monotonic() < end:
        honest = [v.progress.round for v in read_progress(dhts[0], spec.run_id)
                  if v.peer_id not in mine and v.progress.round < FAR]
        rnd = FAR if mode == "far-ahead" else max(honest, default=0)
        if mode == "fresh" and last is not None and rnd != last:  # a new round: a new identity
            dhts[0].shutdown()
            dhts = [node()]
            mine.add(dhts[0].peer_id.to_base58())
            logging.info(f"round {rnd}: lies as {dhts[0].peer_id.to_base58()}")
        last = rnd
        claim = Progress(rnd, 1, "training", spec.digest(), 0.0, float("nan"), 0, 0.0, 0, 0, "", -1)
        if mode == "pair":  # "we gathered round rnd (and the one before) in a group of our own"
            fake = hashlib.sha256(f"{spec.run_id}:{rnd}".encode()).hexdigest()[:32]
            claim = dataclasses.replace(claim, gathered_round=rnd, gathered=fake, gathered_before=fake)
        for d in dhts:
            publish_progress(d, spec.run_id, d.peer_id.to_base58(), claim, ttl=10.0)
        time.sleep(0.2)
    for d in dhts:
        d.shutdown()


if __name__ == "__main__":
    main()
