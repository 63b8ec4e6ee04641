"""A misbehaving swarm member for tests: it joins a run, poses as a peer of the current round, and
then misbehaves inside the real exchange.

    python -m tests.support.hostile_peer JOIN_ADDR MODE ROUNDS

MODE:
- ``garbage``: sends random bytes as its payload;
- ``equivocate``: sends a different payload to every groupmate that asks;
- ``die``: serves a valid payload to the first groupmate that asks, then SIGKILLs itself (its DHT
  process and p2pd included) in the middle of the gather.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import sys
import time
from typing import AsyncIterator

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2, runtime_pb2

from peer.exchange import gatherer as exchange
from protocol.codecs import make_codec
from protocol.dht.keys import averager_prefix
from protocol.wire.payload import encode_payload
from protocol.dht.records import Progress
from swarm.dht.node import parse_multiaddrs, start_dht
from swarm.records import fetch_spec, publish_progress, read_progress

log = logging.getLogger("hostile")


class HostileGatherer(exchange.PayloadGatherer):
    """hivemind names P2P handlers after the servicer class: the adversary wears the honest name."""

    behaviour = "garbage"  # not "mode": DecentralizedAverager uses that name
    served = 0

    async def rpc_fetch_payload(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        if request.peer_id != self.peer_id.to_bytes():
            async for msg in super().rpc_fetch_payload(request, context):
                yield msg
            return
        if self.behaviour == "equivocate":
            yield averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=os.urandom(64)))
            return
        if self.behaviour == "die" and self.served >= 1:
            os.killpg(os.getpgid(0), signal.SIGKILL)
        self.served += 1
        async for msg in super().rpc_fetch_payload(request, context):
            yield msg


HostileGatherer.__name__ = HostileGatherer.__qualname__ = "PayloadGatherer"


def _fake(spec, rnd: int, state: str, start: str) -> Progress:
    return Progress(rnd, spec.outer.inner_steps, state, spec.digest(), 0.0, float("nan"), 0, 0.0, 0, 0, start, -1)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s hostile: %(message)s")
    join, mode, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dht = start_dht(parse_multiaddrs([join]), ["/ip4/127.0.0.1/tcp/0"])
    spec = fetch_spec(dht)
    me = dht.peer_id.to_base58()
    HostileGatherer.behaviour = mode
    gatherer = HostileGatherer(
        dht, prefix=averager_prefix(spec.run_id), schema=spec.digest().encode(),
        min_group_size=spec.swarm.min_group_size, max_group_size=spec.swarm.max_group_size,
        matchmaking_time=spec.swarm.matchmaking_time, gather_timeout=spec.swarm.gather_timeout,
    )
    gatherer.run_in_background(await_ready=True)
    codec = make_codec(spec)
    done, attempts = 0, 0
    # a round whose group formed without us does not count: try again in the next one (timing on a
    # loaded machine, not what the tests check), up to a few extra rounds
    while done < rounds and attempts < rounds + 4:
        honest = [v for v in read_progress(dht, spec.run_id) if v.peer_id != me and v.progress.state != "stopped"]
        training = [v.progress for v in honest if v.progress.state == "training"]
        if not training:
            time.sleep(0.05)
            continue
        rnd = max(p.round for p in training)
        start = next((v.progress.params_hash for v in honest if v.progress.round == rnd and v.progress.params_hash), "")
        if mode == "garbage":
            payload = bytes(random.getrandbits(8) for _ in range(2048))
        else:
            zeros = {n: torch.zeros(s) for n, s in spec.param_shapes().items()}
            payload, _ = encode_payload(codec, zeros, run_digest=spec.digest(), round=rnd,
                                        steps=spec.outer.inner_steps)
        # pose as a peer still training this round, so that the honest peers wait for us ...
        publish_progress(dht, spec.run_id, me, _fake(spec, rnd, "training", start), ttl=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            mine = [v.progress for v in read_progress(dht, spec.run_id) if v.peer_id != me and v.progress.round == rnd]
            if mine and all(p.state in ("ready", "exchanging") for p in mine):
                break
            time.sleep(0.05)
        # ... then turn up ready, with a group that expects us
        publish_progress(dht, spec.run_id, me, _fake(spec, rnd, "ready", start), ttl=30)
        result = gatherer.gather(rnd, payload, start_hash=start, expected_size=len(honest) + 1, timeout=20)
        log.info(f"round {rnd}: {'no group' if result is None else f'group of {len(result.group)}'}")
        attempts += 1
        done += result is not None and len(result.group) > 1
        while True:  # next round: wait until the honest peers have moved past this one
            now = [v.progress.round for v in read_progress(dht, spec.run_id) if v.peer_id != me]
            if not now or min(now) > rnd:
                break
            time.sleep(0.1)
    gatherer.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main()
