"""Members that lie inside the agreement of a real exchange, for tests/system/test_hostile_consensus.py.

    python -m tests.support.hostile_exchange JOIN_ADDR ROUNDS MODE [MODE ...]

One process, one member per MODE (each with its own DHT node and identity), so that they join the
same rounds. Each poses as a peer of the current round (as tests/support/hostile_peer.py does), sends a
valid zero update signed with its own identity, then lies in every agreement answer (``rpc_relay``):

- ``frame``: for every other member, a payload digest that member never signed, under a claim the
  framer signed itself (nobody can make a valid one) and the framer's relay signature; a fresh lie
  for every request, so different members hear different lies. Only proof excludes an owner
  (protocol/round/reconcile.py): were a member's word enough, this table would get every honest sender
  excluded as an "equivocator";
- ``invent``: owners outside the group: two with real keys and validly signed payloads of huge
  values for this very group, the rest random ids, and it serves their envelopes to anyone who
  asks (logged: "SERVED"; nobody should ask). Names outside the group are ignored: counted, this
  table's 50 invented owners would take 96 % of the aggregate;
- ``silent``: joins the group and then sends nothing: its payload and its agreement answers never
  come (each request is held until the caller gives up), so the group's gather waits out its
  deadline. A member that does this every round would cost every round a gather slot; each honest
  peer refuses it in its matchmaking after its first silence (peer/exchange/matchmaking.py);
- ``silent-fresh``: ``silent`` under a new identity (DHT node and key) every round, which no
  refusal or strike of an earlier round reaches;
- ``lurk-fresh``: the same, but its record never says "ready", so no barrier counts it among the
  peers a group is sized for: it joins a group to fill a ready peer's seat.
All log "LIED" for every lie told, so a test can tell the attack was made.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable, List, Optional, Tuple

import msgpack
import torch
from hivemind import DHT
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2, runtime_pb2

from peer.exchange import gatherer as exchange
from protocol.codecs import make_codec
from protocol.dht.keys import averager_prefix
from protocol.wire.payload import encode_payload
from protocol.wire.signed import Signer, claim_message, payload_digest, relay_message, seal
from swarm.dht.node import parse_multiaddrs, start_dht
from swarm.records import fetch_spec, publish_progress, read_progress
from tests.support.hostile_peer import _fake

log = logging.getLogger("hostile-exchange")


class LyingGatherer(exchange.PayloadGatherer):
    behaviour = "frame"  # set before the averager process starts
    outsiders: list = []  # invented owners with real keys
    poison = b""  # what an invented owner "sent"

    async def rpc_relay(self, request: averaging_pb2.AveragingData, context: P2PContext) -> averaging_pb2.AveragingData:
        if self.behaviour == "silent":  # every request, even one that comes before it has opened the group
            await self._hold(context)
        group = self._groups.get(request.group_id)
        if group is None or context.remote_id.to_bytes() not in group.members:
            return await super().rpc_relay(request, context)
        ctx, me, key = group.agreement.context, self._signer.peer_id, self._signer
        signers, items = [key], []
        if self.behaviour == "frame":
            for victim in group.agreement.members:
                if victim != me:
                    fake = payload_digest(os.urandom(32))
                    forged = key.sign(claim_message(ctx, victim, fake))
                    items.append([victim, fake, forged, [[me, key.sign(relay_message(ctx, me, victim, fake))]]])
        else:
            digest = payload_digest(self._poison())
            for outsider in self.outsiders:
                relay = [[me, key.sign(relay_message(ctx, me, outsider.peer_id, digest))]]
                items.append([outsider.peer_id, digest, outsider.sign(claim_message(ctx, outsider.peer_id, digest)), relay])
            signers += self.outsiders
            while len(items) < 2 * len(group.members):
                items.append([b"\x12\x20" + os.urandom(32), digest, os.urandom(256), relay])
        log.info(f"LIED ({self.behaviour}) to {context.remote_id} in round {self._round_no}: {len(items)} values")
        answer = msgpack.packb([[[s.peer_id, s.public_key] for s in signers], items], use_bin_type=True)
        return averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=answer))

    def _poison(self) -> bytes:
        """The huge payload, for the current round (it would pass the decoder's header checks)."""
        message = msgpack.unpackb(self.poison, raw=False)
        message["round"] = self._round_no
        return msgpack.packb(message, use_bin_type=True)

    async def _hold(self, context: P2PContext) -> None:
        log.info(f"LIED (silent) to {context.remote_id} in round {self._round_no}: holding its request")
        await asyncio.sleep(3600)

    async def rpc_fetch_payload(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        if self.behaviour == "silent":  # (a fetch that came before it opened the group would get its zeros)
            await self._hold(context)
        group = self._groups.get(request.group_id)
        invented = {o.peer_id: o for o in self.outsiders}
        if group is not None and request.peer_id in invented:
            log.info(f"SERVED invented owner {request.peer_id.hex()[:12]} to {context.remote_id}")
            envelope, _ = seal(invented[request.peer_id], group.agreement.context, self._poison())
            yield averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=envelope))
            return
        async for msg in super().rpc_fetch_payload(request, context):
            yield msg


LyingGatherer.__name__ = LyingGatherer.__qualname__ = "PayloadGatherer"  # hivemind names handlers after the class


def take_part(spec, liars: List[Tuple[DHT, LyingGatherer]], rounds: int,
              renew: Optional[Callable[[], List[Tuple[DHT, LyingGatherer]]]] = None,
              announce_ready: bool = True) -> None:
    """Pose, all together, as members of each of the next ``rounds`` rounds the honest peers train;
    ``renew``: new identities for every round after the first (the old ones shut down; ``liars`` is
    updated in place, so the caller shuts down whichever run at the end); ``announce_ready``: whether
    their records say "ready" before they gather."""
    ids = {dht.peer_id.to_base58() for dht, _ in liars}
    dht = liars[0][0]
    zeros = {n: torch.zeros(s) for n, s in spec.param_shapes().items()}
    joined = tries = 0
    while joined < rounds and tries < rounds + 4:
        honest = [v for v in read_progress(dht, spec.run_id) if v.peer_id not in ids and v.progress.state != "stopped"]
        training = [v.progress.round for v in honest if v.progress.state == "training"]
        if not training:
            time.sleep(0.05)
            continue
        rnd = max(training)
        start = next((v.progress.params_hash for v in honest if v.progress.round == rnd and v.progress.params_hash), "")
        payload, _ = encode_payload(make_codec(spec), zeros, run_digest=spec.digest(), round=rnd,
                                      steps=spec.outer.inner_steps)
        for node, _ in liars:  # a peer still training this round: the honest peers wait for us ...
            publish_progress(node, spec.run_id, node.peer_id.to_base58(), _fake(spec, rnd, "training", start), ttl=30)
        give_up = time.monotonic() + 30
        while time.monotonic() < give_up:
            states = [v.progress.state for v in read_progress(dht, spec.run_id) if v.peer_id not in ids and v.progress.round == rnd]
            if states and all(s in ("ready", "exchanging") for s in states):
                break
            time.sleep(0.05)
        for node, _ in liars if announce_ready else ():  # ... and turns up ready, in a group that expects us
            publish_progress(node, spec.run_id, node.peer_id.to_base58(), _fake(spec, rnd, "ready", start), ttl=30)
        size = len(honest) + len(liars)
        with ThreadPoolExecutor(len(liars)) as pool:
            results = list(pool.map(lambda g: g.gather(rnd, payload, start_hash=start, expected_size=size, timeout=20),
                                    [g for _, g in liars]))
        tries += 1
        groups = [len(r.group) if r is not None else 0 for r in results]
        joined += all(n > len(liars) for n in groups)
        log.info(f"round {rnd}: groups of {groups}")
        while any(v.progress.round <= rnd for v in read_progress(dht, spec.run_id) if v.peer_id not in ids):
            time.sleep(0.1)
        if renew is not None and joined < rounds and tries < rounds + 4:  # new identities for the next round
            old, liars[:] = list(liars), []
            shut_down(old)
            liars[:] = renew()
            ids |= {node.peer_id.to_base58() for node, _ in liars}
            dht = liars[0][0]


def shut_down(liars: List[Tuple[DHT, LyingGatherer]]) -> None:
    for node, gatherer in liars:
        gatherer.shutdown()
        node.shutdown()


def start_liars(join: str, spec, modes: List[str], outsiders: List[Signer], poison: bytes) -> List[Tuple[DHT, LyingGatherer]]:
    """One DHT node and lying gatherer (a new identity) per mode."""
    liars = []
    for mode in modes:
        node = start_dht(parse_multiaddrs([join]), ["/ip4/127.0.0.1/tcp/0"])
        # class attributes, read in the averager process forked by run_in_background
        behaviour = {"lurk": "silent"}.get(mode.removesuffix("-fresh"), mode.removesuffix("-fresh"))
        cls = type("PayloadGatherer", (LyingGatherer,), dict(behaviour=behaviour, outsiders=outsiders, poison=poison))
        # a peer that knows a ready peer follows no new identity as a leader (peer/round/no_show_views.py
        # ``leaders``): a liar that must be in an honest group declares a later expiration than the honest
        # leaders', so that it follows one of them (a silent one leads, as before)
        stretch = 3.0 if behaviour in ("frame", "invent") else 1.0
        gatherer = cls(
            node, prefix=averager_prefix(spec.run_id), schema=spec.digest().encode(),
            min_group_size=spec.swarm.min_group_size, max_group_size=spec.swarm.max_group_size,
            matchmaking_time=spec.swarm.matchmaking_time * stretch, gather_timeout=spec.swarm.gather_timeout,
        )
        gatherer.run_in_background(await_ready=True)
        liars.append((node, gatherer))
    return liars


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s hostile: %(message)s")
    join, rounds, modes = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    probe = start_dht(parse_multiaddrs([join]), ["/ip4/127.0.0.1/tcp/0"])
    spec = fetch_spec(probe)
    probe.shutdown()
    outsiders = [Signer.generate() for _ in range(2)]
    huge = {n: torch.full(s, 1e4) for n, s in spec.param_shapes().items()}
    poison = encode_payload(make_codec(spec), huge, run_digest=spec.digest(), round=0,
                            steps=spec.outer.inner_steps)[0]
    start = functools.partial(start_liars, join, spec, modes, outsiders, poison)
    liars = start()
    fresh = all(m.endswith("-fresh") for m in modes)  # (a process of mixed modes renews nobody)
    try:
        take_part(spec, liars, rounds, renew=start if fresh else None,
                  announce_ready=not all(m.startswith("lurk") for m in modes))
    finally:
        shut_down(liars)


if __name__ == "__main__":
    main()
