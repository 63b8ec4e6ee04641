"""A low-resource peer's life in a pipeline chain: candidate, stage, and back to candidate.

The peer publishes a chain-candidate record (capacity, bandwidth, the endpoint of its stage
listener) and waits for the coordinator to put it in a chain (coordinator/chain_former.py). In a
chain it runs one stage (a ``peer.training.model.Model`` with a block range) on an asyncio loop of its own:
every round it opens fresh links to its neighbours (peer/chain/links.py; the handshake pins the
round, so both ends hold the same T, and each end proves it holds the key of the peer id the
chain assignment names for its stage: peer/chain/handshake.py), and each inner step runs the
GPipe schedule over them (peer/chain/gpipe.py). When a neighbour dies, stalls or sends what this stage cannot use, the step
raises a StageError with the parameters and optimizer state untouched: the peer drops the
round's work (ChainBroken), reports itself waiting again, and the coordinator re-forms chains
from the waiting candidates under a newer epoch.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Callable, Dict, Optional, Tuple

import torch
from hivemind.p2p import PeerID

from peer.chain.gpipe import close_round, run_inner_step
from peer.exchange.identity import payload_signer
from peer.training.model import Model, build_model
from peer.training.resources import Resources
from peer.chain.errors import LinkError, StageError
from peer.chain.handshake import LinkAuth
from peer.chain.links import StageIdentity, connect_link, link_codec
from peer.chain.listener import StageListener
from protocol.chain.records import CandidateRecord, ChainAssignment
from protocol.chain.endpoints import announced_endpoints, dial_order, format_endpoint, hosts_of_maddrs
from protocol.chain.frames import FrameFormat
from protocol.spec import RunSpec
from protocol.round.timing import Timing
from swarm.records import publish_candidate, read_assignments, read_candidates

logger = logging.getLogger("voloco.chain")

_PLACEHOLDER = StageIdentity(run_digest="", chain_id="", stage=-1, round=-1)


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def unreachable(stage: int, peer_id: str, errors: Dict[str, str]) -> str:
    """Why a stage could not dial its neighbour, and what the neighbour's operator can do."""
    tried = "; ".join(f"{endpoint}: {why}" for endpoint, why in errors.items())
    ports = sorted({e.rsplit(":", 1)[1] for e in errors})
    return (f"could not connect to stage {stage} ({peer_id}) at {tried}. Its host must accept TCP on port "
            f"{', '.join(ports)} from this one: open the port in its firewall or router, or start that peer with "
            f"--stage-host (or --announce-maddrs) naming an address this host can reach")


class ChainBroken(Exception):
    """The chain cannot go on (a neighbour died, stalled or misbehaved); the peer waits for a new one."""


class ChainMember:
    def __init__(self, dht, spec: RunSpec, peer_id: str, resources: Resources, host: Optional[str], port: int,
                 stop: threading.Event, timing: Optional[Timing] = None):
        """``host``: ``--stage-host``, the one address to listen on and announce; None: listen on
        every interface (on loopback only in a run whose DHT addresses are all loopback) and
        announce the addresses the DHT node is seen at (protocol/chain/endpoints.py)."""
        self.dht, self.spec, self.peer_id, self.resources, self.stop = dht, spec, peer_id, resources, stop
        self.timing = timing if timing is not None else Timing.from_spec(spec)  # every wait (protocol/round/timing.py)
        self.state = "waiting"
        self.failed_epoch = -1
        self.assignment: Optional[ChainAssignment] = None
        self.last_chain_id: Optional[str] = None  # kept after a chain breaks: what this stage last trained in
        self.k = spec.chain.effective_rank(spec.model.d_model)
        dtype = torch.float16 if spec.chain.wire_dtype == "fp16" else torch.bfloat16
        self.codec = link_codec(spec.model.d_model, self.k, spec.seed, dtype)
        micro = max(1, spec.data.batch_size // spec.chain.micro_batches)
        self.fmt = FrameFormat.for_run(spec, micro_batch=micro, k=self.k)
        self.U = self.codec.U if self.k < spec.model.d_model else None  # the lossless constraint
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="stage-links")
        self._thread.start()
        self._signer = None  # this peer's identity key, loaded at the first link (peer/exchange/identity.py)
        seen = hosts_of_maddrs(str(m) for m in dht.get_visible_maddrs()) if host is None else [host]
        bind = host if host is not None else ("0.0.0.0" if any(not _loopback(h) for h in seen) else "127.0.0.1")
        self.listener: StageListener = self._call(
            StageListener.start(
                bind, port, local=_PLACEHOLDER, role="downstream", fmt=self.fmt, codec=self.codec,
                timeout=spec.chain.link_timeout,
            ),
            timeout=self.timing.chain_call_s,
        )
        self.endpoint = announced_endpoints(seen, self.listener.port, override=host)
        logger.info(f"stage listener on {bind}:{self.listener.port}, announced to chain neighbours as {self.endpoint}")
        self.upstream = self.downstream = None
        self._linked: set = set()  # neighbours linked with this stage in this assignment (_left_chain)
        self.bytes_sent = self.bytes_received = 0
        self.tokens = 0  # tokens whose activations (or gradients) crossed this stage's links

    # ---- candidate --------------------------------------------------------------------------------
    def publish(self) -> None:
        record = CandidateRecord(
            self.spec.digest(), self.resources.memory_bytes, self.resources.bandwidth_mbps, self.state, self.endpoint
        )
        try:
            ttl = max(3 * self.spec.swarm.heartbeat_period, 10.0)
            publish_candidate(self.dht, self.spec.run_id, self.peer_id, record, ttl)
        except Exception as e:
            logger.debug(f"could not publish the candidate record: {e!r}")

    def wait_for_assignment(self) -> Optional[ChainAssignment]:
        """Block until the coordinator puts this peer in a chain (None if the peer is stopping)."""
        self.state = "waiting"
        last_log = 0.0
        while not self.stop.is_set():
            self.publish()
            try:
                mine = read_assignments(self.dht, self.spec).get(self.peer_id)
            except Exception as e:
                logger.debug(f"could not read chain assignments: {e!r}")
                mine = None
            if mine is not None and mine.epoch > self.failed_epoch:
                self.assignment, self.state = mine, "assigned"
                self._linked = set()  # no link of this assignment yet (_left_chain)
                self.last_chain_id = mine.chain.chain_id
                self.publish()
                stage = mine.chain.stage_of(self.peer_id)
                logger.info(
                    f"joined chain {mine.chain.chain_id} as stage {stage.index + 1} of {len(mine.chain.stages)} "
                    f"(blocks {stage.start_block}-{stage.end_block - 1}); activations at rank {self.k} of "
                    f"{self.spec.model.d_model}"
                )
                return mine
            if time.monotonic() - last_log > 10:
                last_log = time.monotonic()
                logger.info(f"waiting for a chain: {self.resources.describe(self.spec)}")
            self.stop.wait(self.timing.chain_poll_s)
        return None

    def stage_range(self) -> Tuple[int, int]:
        stage = self.assignment.chain.stage_of(self.peer_id)
        return stage.start_block, stage.end_block

    def build_stage(self) -> Model:
        """This stage's share of the run's model, on the CPU, with the full model's bits."""
        spec = self.spec
        return build_model(spec.model, spec.seed, spec.partial.slices, spec.partial.attn_slices, blocks=self.stage_range())

    def broken(self, why: str) -> ChainBroken:
        """Give up this chain: back to the candidate pool, never to this assignment again."""
        self.close_links()
        if self.assignment is not None:
            self.failed_epoch = self.assignment.epoch
            if self.stop.is_set():  # stopping as asked: a neighbour that stopped first is no fault
                logger.info(f"chain {self.assignment.chain.chain_id} ended as this peer stops: {why}")
            else:
                logger.warning(f"chain {self.assignment.chain.chain_id} broke: {why}; waiting for a new chain")
        # a stopping peer says so: the coordinator ends its chain without counting a failed formation
        self.assignment, self.state = None, "leaving" if self.stop.is_set() else "waiting"
        self.publish()
        return ChainBroken(why)

    # ---- links ------------------------------------------------------------------------------------
    def open_links(self, sync: Callable[[], int], deadline_s: float) -> None:
        """Connect to this round's neighbours: dial stage i+1, accept stage i-1.

        ``sync`` catches this peer up with the swarm (a stage whose round failed while its
        neighbour's succeeded is a round behind) and returns its round; the handshake pins it."""
        chain = self.assignment.chain
        stage = chain.stage_of(self.peer_id)
        round_no = sync()
        local = StageIdentity(self.spec.digest(), chain.chain_id, stage.index, round_no)
        previous = chain.stages[stage.index - 1] if stage.index > 0 else None
        self.close_links()
        self._call(self.listener.retarget(local, None if previous is None else self._auth(previous.peer_id)), timeout=self.timing.chain_retarget_s)
        deadline = time.monotonic() + deadline_s
        try:
            if stage.index + 1 < len(chain.stages):
                nxt = chain.stages[stage.index + 1]
                endpoint = None
                while endpoint is None and time.monotonic() < deadline and not self.stop.is_set():
                    record = read_candidates(self.dht, self.spec).get(nxt.peer_id)
                    endpoint = record.endpoint if record is not None and record.endpoint else None
                    if endpoint is None:
                        time.sleep(self.timing.chain_redial_s)
                if endpoint is None:
                    raise self.broken(f"stage {nxt.index + 1} published no endpoint")
                targets = dial_order(endpoint)
                attempt, errors = 0, {}
                while True:  # the next stage may still be finishing its previous round, or catching up
                    host, port = targets[attempt % len(targets)]
                    attempt += 1
                    try:
                        self.downstream = self._call(
                            connect_link(host, port, local=local, role="upstream", fmt=self.fmt,
                                         codec=self.codec, timeout=self.spec.chain.link_timeout,
                                         auth=self._auth(nxt.peer_id)),
                            timeout=self.timing.chain_call_s,
                        )
                        self._linked.add(nxt.peer_id)
                        break
                    except (LinkError, OSError, asyncio.TimeoutError) as e:
                        errors[format_endpoint(host, port)] = str(e) or type(e).__name__
                        if time.monotonic() > deadline or self.stop.is_set():
                            raise self.broken(unreachable(nxt.index + 1, nxt.peer_id, errors)) from None
                        if self._left_chain(nxt.peer_id):
                            raise self.broken(f"stage {nxt.index + 1} ({nxt.peer_id}) left the chain: it waits for a new one")
                        if attempt % len(targets) == 0:
                            time.sleep(self.timing.chain_redial_s)
                        now_at = sync()
                        if now_at != local.round:
                            local = StageIdentity(local.run_digest, local.chain_id, local.stage, now_at)
                            self._call(self.listener.retarget(local, self.listener.auth), timeout=self.timing.chain_retarget_s)
            while stage.index > 0 and self.upstream is None:
                if time.monotonic() > deadline or self.stop.is_set():
                    raise self.broken(
                        f"stage {stage.index} ({previous.peer_id}) did not connect to this stage's listener at "
                        f"{self.endpoint} within {deadline_s:.0f} s: if it logged that it could not connect, TCP port "
                        f"{self.listener.port} of this host must be reachable from its host (open it, or start this "
                        f"peer with --stage-host or --announce-maddrs naming an address it can reach)"
                    )
                try:
                    self.upstream = self._call(self.listener.accept(timeout=2.0), timeout=7.0)
                    self._linked.add(previous.peer_id)
                except (asyncio.TimeoutError, TimeoutError):
                    if self._left_chain(previous.peer_id):
                        raise self.broken(f"stage {stage.index} ({previous.peer_id}) left the chain: it waits for a new one")
                    round_no = sync()  # the previous stage may be waiting for us to catch up
                    if round_no != self.listener.local.round:
                        local = StageIdentity(local.run_digest, local.chain_id, local.stage, round_no)
                        self._call(self.listener.retarget(local, self.listener.auth), timeout=self.timing.chain_retarget_s)
        except ChainBroken:
            raise

    def _left_chain(self, neighbour: str) -> bool:
        """Whether ``neighbour``, linked with this stage before in this assignment, says it waits for a
        chain again (its chain broke on its side: a link it lost, a step that failed) or leaves the run. Waiting
        ``round_wait`` for it would be in vain; the coordinator re-forms chains from the waiting
        candidates. (Before its first link a neighbour may not have read the assignment yet.)"""
        if neighbour not in self._linked:
            return False
        try:
            record = read_candidates(self.dht, self.spec).get(neighbour)
        except Exception as e:
            logger.debug(f"could not read chain candidates: {e!r}")
            return False
        return record is not None and record.state in ("waiting", "leaving")

    def _auth(self, neighbour: str) -> LinkAuth:
        """What proves the link to ``neighbour`` (a base58 peer id from the chain assignment)."""
        if self._signer is None:
            self._signer = payload_signer(self.dht)
        try:
            expected = PeerID.from_base58(neighbour).to_bytes()
        except (ValueError, TypeError):
            raise self.broken(f"the chain assignment names {neighbour!r}, which is not a peer id") from None
        return LinkAuth(self._signer, expected)

    def inner_step(self, stage: Model, trainer, T: torch.Tensor, batch, close_from: int = 0) -> Optional[float]:
        """One inner step of this stage (peer/chain/gpipe.py). A neighbour that dies, stalls or sends
        what this stage cannot use raises ChainBroken (reason logged, links closed, parameters
        and optimizer state as they were); the first stage's close of the round, RoundClosed (a close
        before step ``close_from``, ChainBroken); bad arguments of the caller raise ValueError."""
        limit = self.spec.chain.link_timeout * 4
        device = next(stage.parameters()).device
        step = run_inner_step(
            stage, trainer, T=T, micro_batches=self.spec.chain.micro_batches, batch=batch,
            upstream=self.upstream, downstream=self.downstream,
            constraint=None if self.U is None else self.codec.basis_on(device),  # U on the stage's device, copied once
            close_from=close_from,
        )
        try:  # the deadline cancels the step on the loop, so it never updates after we gave up
            loss = self._call(asyncio.wait_for(step, limit), timeout=limit + 10)
        except (StageError, TimeoutError) as e:
            raise self.broken(f"inner step failed: {str(e) or f'no step within {limit:g} s'}")
        self.tokens += batch[0].numel()
        return loss

    def close_round(self, step: int) -> None:
        """End the chain's round before ``step``: this stage is the first and closes the round early
        (peer/round/early_close.py); each next stage learns it from a ``close`` frame. A link that
        fails meanwhile breaks the chain (ChainBroken)."""
        limit = self.spec.chain.link_timeout
        try:
            self._call(asyncio.wait_for(close_round(self.downstream, step), limit), timeout=limit + 10)
        except (StageError, TimeoutError) as e:
            raise self.broken(f"closing the round early failed: {str(e) or f'no flush within {limit:g} s'}")

    def mates(self) -> Tuple[str, ...]:
        """The peer ids of this chain's other stages (they step with this one: one replica)."""
        chain = self.assignment.chain if self.assignment is not None else None
        return tuple(s.peer_id for s in chain.stages if s.peer_id != self.peer_id) if chain is not None else ()

    def close_links(self) -> None:
        """End this round's links; the listener takes no hello until the next round's ``open_links``."""
        try:
            self._call(self.listener.end_round(), timeout=5)
        except Exception as e:
            logger.debug(f"ending the listener's round: {e!r}")
        for link in (self.upstream, self.downstream):
            if link is not None:
                self.bytes_sent += link.bytes_sent
                self.bytes_received += link.bytes_received
                try:
                    self._call(link.close(), timeout=5)
                except Exception as e:
                    logger.debug(f"closing a stage link: {e!r}")
        self.upstream = self.downstream = None

    def shutdown(self) -> None:
        """Say "leaving" in the candidate record first, then close the links: a neighbour that sees its
        link close goes back to "waiting", and the coordinator, reading "leaving" of this member, ends the
        chain as stopped rather than broken (tests/chain/test_stage_endpoints.py)."""
        if self.state != "leaving":
            self.state = "leaving"
            self.publish()
        self.close_links()
        try:
            self._call(self.listener.close(), timeout=5)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)

    def _call(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)
