"""The peer: rounds of H inner steps, then a compressed exchange with the peers of the round.

One round, as the peer sees it:
1. reset the model to the global parameters θ of this round and train H inner steps;
2. Δ = θ − θ_local; the strategy folds Δ into its local buffers and encodes a payload;
3. wait (bounded) until every live peer of the round is ready, then find a group with hivemind's
   matchmaking and all-gather payloads (peer/exchange.py);
4. validate and decode every payload, aggregate in sender order, take the outer step on θ: every
   member of the group ends with bit-identical θ;
5. checkpoint, evaluate, publish progress to the DHT.

A peer that finds no group keeps its pseudo-gradient in its local buffers (nothing is lost with
SparseLoCo and DCT) and, if the swarm has moved on, downloads the current state from a live peer.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from peer.chain import ChainBroken, ChainMember
from peer.data import TrainStream, load_corpus, val_batches
from peer.exchange import PayloadGatherer
from peer.inner import InnerTrainer, evaluate
from peer.model import build_model
from peer.progress import ProgressBar, human_bytes
from peer.resources import detect
from peer.state import flatten_optimizer_state, load_checkpoint, params_hash, save_checkpoint, unflatten_optimizer_state
from peer.strategies import canonical_order, make_strategy, pseudo_gradient
from peer.swarm import PeerView, fetch_spec, publish_progress, read_progress, start_dht
from protocol.activations import constrain_to_subspace_
from protocol.errors import ProtocolError
from protocol.keys import averager_prefix
from protocol.partial import FULL, choose_part, describe
from protocol.records import CHOOSING, Progress
from protocol.spec import RunSpec

logger = logging.getLogger("voloco.peer")


@dataclass
class PeerOptions:
    join: Sequence[Any]  # parsed multiaddrs
    run_id: Optional[str] = None
    data: Optional[str] = None
    device: str = "cpu"
    identity: Optional[str] = None
    checkpoint_dir: Optional[Path] = None
    host_maddrs: Sequence[str] = ("/ip4/0.0.0.0/tcp/0",)
    announce_maddrs: Sequence[str] = ()
    status_file: Optional[Path] = None
    max_memory_gb: Optional[float] = None  # declared memory for training; None: detect
    bandwidth_mbps: Optional[float] = None
    stage_host: str = "127.0.0.1"  # where neighbours reach this peer's stage listener, if it joins a chain
    stage_port: int = 0
    max_rounds: Optional[int] = None
    threads: Optional[int] = None
    spec_timeout: float = 30.0
    wait_peers: int = 1  # before the first round, wait until this many peers (self included) have started


@dataclass
class RoundRecord:
    round: int
    params_hash: str
    group: List[str]
    contributors: int
    excluded: Dict[str, str]
    bytes_sent: int
    bytes_received: int
    loss: float
    val_loss: float
    seconds: float
    resynced: bool = False  # it started off the group's parameters and downloaded them after the round


@dataclass
class Totals:
    tokens: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    rounds: int = 0
    history: List[RoundRecord] = field(default_factory=list)


# peers that take no part in rounds yet: booting, or waiting for a chain. A peer never waits for
# them; one that went ahead alone meanwhile is caught up with (downloaded) when they start.
_NOT_IN_ROUNDS = ("stopped", "starting")


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for st in optimizer.state.values() for t in st.values() if torch.is_tensor(t))


def majority_hash(hashes: Dict[str, str]) -> str:
    """The starting point most of a group shares (ties: the smallest hash, the same on every member)."""
    counts: Dict[str, int] = {}
    for h in hashes.values():
        counts[h] = counts.get(h, 0) + 1
    return min(counts, key=lambda h: (-counts[h], h))


class Peer:
    def __init__(self, opts: PeerOptions):
        self.opts = opts
        self.stop_event = threading.Event()
        self.totals = Totals()
        self.state = "starting"
        self.step = 0
        self.last_loss = float("nan")
        self.val_loss = float("nan")
        self.initial_val_loss = float("nan")
        self.tokens_per_s = 0.0
        self.theta: Dict[str, torch.Tensor] = {}
        self.round = 0
        self.part = CHOOSING
        self.trainable = 0
        self.chain: Optional[ChainMember] = None
        self.consistent = True  # False after a round whose group started from other parameters than ours
        self._lock = threading.RLock()  # guards theta, round and strategy state against state downloads

    # ---- set-up ---------------------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        """SIGINT/SIGTERM end the peer after its current step (hivemind's averager start resets SIGINT)."""
        if threading.current_thread() is not threading.main_thread():
            return

        def stop(signum, frame):
            if not self.stop_event.is_set():
                logger.info("stopping: finishing the current step (signal again to force)")
                self.stop_event.set()
            else:
                raise KeyboardInterrupt

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)

    def start(self) -> None:
        opts = self.opts
        if opts.threads:
            torch.set_num_threads(opts.threads)
        self.dht = start_dht(opts.join, opts.host_maddrs, opts.announce_maddrs, opts.identity)
        self.peer_id = self.dht.peer_id.to_base58()
        logger.info(f"peer {self.peer_id} joined the DHT")
        self.spec: RunSpec = fetch_spec(self.dht, opts.run_id, timeout=opts.spec_timeout)
        spec = self.spec
        # be visible from the start: a peer that sees a newcomer never takes a round alone
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, daemon=True, name="heartbeat")
        self._heartbeat.start()
        logger.info(
            f"run {spec.run_id} (spec {spec.digest()}): {spec.model.num_params() / 1e6:.2f}M-parameter model, "
            f"strategy {spec.outer.strategy}, H={spec.outer.inner_steps}"
        )
        self.corpus = load_corpus(opts.data or spec.data.corpus, spec.data.val_fraction)
        logger.info(f"data: {self.corpus}")
        self.device = torch.device(opts.device)
        self.resources = detect(self.device, opts.max_memory_gb, opts.bandwidth_mbps)
        logger.info(f"resources: {self.resources.describe(spec)}")
        # θ: the global parameters, on the CPU, the whole model (a chain stage holds it too, to serve
        # and check state like any peer; only its own share lives on its device)
        full = build_model(spec.model, spec.seed, spec.partial.slices, spec.partial.attn_slices)
        self.layout = spec.param_shapes()
        self.theta = {n: p.detach().to(torch.float32).clone() for n, p in full.named_parameters()}
        self.val = val_batches(self.corpus, spec.model.seq_len, spec.data.batch_size, spec.data.val_batches)
        if self.resources.fits(spec):
            self.part = self._choose_part()
            self._build_role(full)
        else:
            del full
            self.chain = ChainMember(
                self.dht, spec, self.peer_id, self.resources, opts.stage_host, opts.stage_port, self.stop_event
            )
            if self.chain.wait_for_assignment() is None:
                raise KeyboardInterrupt
            self.part = self.chain.stage_range()
            self._build_role(None)
        self.gatherer = PayloadGatherer(
            self.dht,
            prefix=averager_prefix(spec.run_id),
            schema=spec.digest().encode(),
            min_group_size=spec.swarm.min_group_size,
            max_group_size=spec.swarm.max_group_size,
            matchmaking_time=spec.swarm.matchmaking_time,
            gather_timeout=spec.swarm.gather_timeout,
            request_timeout=min(1.0, spec.swarm.matchmaking_time / 3),
        )
        self.gatherer.state_provider = self._shareable_state
        self.gatherer.run_in_background(await_ready=True)
        self.install_signal_handlers()

        if self.chain is None:
            self._restore_checkpoint()
        self._catch_up()
        self._load_theta_into_model()
        self.initial_val_loss = self.val_loss = self._evaluate()
        if self.chain is None:
            logger.info(f"round {self.round}: validation loss {self.val_loss:.3f} nats/byte")
        self._enable_state_sharing()

    def _build_role(self, full: Optional[torch.nn.Module]) -> None:
        """Model, strategy, optimizer and data stream for this peer's part of the model: the whole
        model, a slice of it (partial updates) or a chain stage's blocks."""
        spec = self.spec
        if isinstance(self.part, tuple):
            self.model = self.chain.build_stage().to(self.device)
            shard = self.chain.assignment.chain.chain_id  # every stage of a chain draws the same batches
        else:
            self.model = full.to(self.device)
            shard = self.peer_id
        self.params = dict(self.model.named_parameters())
        self.strategy = make_strategy(spec, part=self.part)
        for name, p in self.params.items():  # partial updates: no gradients, no optimizer state for the rest
            p.requires_grad_(name in self.strategy.layout)
        self.trainer = InnerTrainer(self.model, spec.inner, self.device)
        self.trainable = sum(p.numel() for p in self.trainer.params)
        what = f"blocks {self.part[0]}-{self.part[1] - 1} of a chain" if isinstance(self.part, tuple) else describe(spec, self.part)
        logger.info(
            f"training {what}: {self.trainable / 1e6:.3f}M of {spec.model.num_params() / 1e6:.3f}M parameters "
            f"trainable, AdamW state {human_bytes(8 * self.trainable)}"
        )
        self.stream = TrainStream(self.corpus, spec.model.seq_len, spec.data.batch_size, spec.seed, shard=shard)

    def _choose_part(self) -> int:
        """FULL, or the slice of a partial run this peer owns (kept across restarts)."""
        slices = self.spec.partial.slices
        if slices <= 1:
            return FULL
        found = load_checkpoint(self.opts.checkpoint_dir) if self.opts.checkpoint_dir is not None else None
        if found is not None and found[1].get("spec") == self.spec.digest() and found[1].get("part") in range(slices):
            return int(found[1]["part"])
        # peers that start together see each other choosing and spread over the slices
        time.sleep(max(2 * self.spec.swarm.heartbeat_period, 5.0))
        view = [v for v in self._view() if v.peer_id != self.peer_id and v.progress.state != "stopped"]
        owners = [v.progress.part for v in view if v.progress.part >= 0]
        waiting = [v.peer_id for v in view if v.progress.part == CHOOSING]
        part = choose_part(slices, owners, waiting, self.peer_id)
        counts = {s: owners.count(s) for s in range(slices)}
        logger.info(f"took slice {part} of {slices} (live owners per slice before: {counts})")
        return part

    # ---- the loop -------------------------------------------------------------------------------
    def run(self) -> None:
        spec = self.spec
        max_rounds = self.opts.max_rounds or spec.max_rounds
        try:
            if self.opts.wait_peers > 1 and self.round == 0:
                self._wait_for_quorum(self.opts.wait_peers)
            while not self.stop_event.is_set():
                if max_rounds and self.round >= max_rounds:
                    logger.info(f"reached round {self.round}: stopping as asked")
                    break
                self._one_round()
        finally:
            self.state = "stopped"
            self._publish()
            self._write_status()

    def _wait_for_quorum(self, n: int) -> None:
        """A coordinated start: hold round 0 until ``n`` peers (this one included) have started.

        Peers that are still starting do not count (they may still be loading data); a peer already
        past round 0 ends the wait (the run is under way: this peer caught up with it at start)."""
        self.state = "waiting"
        self._publish()
        t0 = last_log = time.monotonic()
        while not self.stop_event.is_set():
            view = [v for v in self._view() if v.progress.state not in _NOT_IN_ROUNDS]
            started = {v.peer_id for v in view} | {self.peer_id}
            if len(started) >= n or any(v.progress.round > 0 for v in view):
                logger.info(f"{len(started)} peers have started: training round {self.round}")
                return
            if time.monotonic() - last_log >= 10.0:
                last_log = time.monotonic()
                logger.info(f"waiting for {n} peers to start ({len(started)} so far, {last_log - t0:.0f} s)")
            time.sleep(0.25)

    def _one_round(self) -> None:
        spec, H = self.spec, self.spec.outer.inner_steps
        t0 = time.monotonic()
        self.state = "training"
        self._publish()
        try:
            losses, round_start = self._inner_steps(H)
        except ChainBroken:
            self._rejoin_chain()
            return
        if losses is None:
            return

        t_train = time.monotonic()
        delta = pseudo_gradient(round_start, self.params, self.strategy.layout)
        payload, pending = self.strategy.encode(delta, self.round)
        self.state = "ready"
        self._publish()
        t_encode = time.monotonic()
        expected, alone, behind = self._wait_for_round_peers()
        t_wait = time.monotonic()
        if self.stop_event.is_set():
            return
        self.state = "exchanging"
        result = None
        start_hash = params_hash(self.theta)
        if not alone and not (behind and expected == 1):  # nobody of our round left to meet: catch up instead
            result = self.gatherer.gather(
                self.round, payload, start_hash=start_hash, expected_size=expected, timeout=spec.swarm.round_wait
            )
        if result is None and not alone and not self._swarm_is_empty():
            self.strategy.settle(pending, delivered=False)
            logger.warning(f"round {self.round}: found no group; keeping this round's update locally")
            with self._lock:
                self._load_theta_into_model()
            self._catch_up()
            return

        t_gather = time.monotonic()
        payloads = result.payloads if result is not None else {self.peer_id: payload}
        decoded, excluded = [], dict(result.excluded) if result is not None else {}
        for sender in canonical_order(payloads):
            try:
                decoded.append(self.strategy.decode(payloads[sender], self.round))
            except ProtocolError as e:
                excluded[sender] = f"invalid payload: {e}"
                logger.warning(f"round {self.round}: rejected the payload of {sender}: {e}")
        if result is not None:
            self.consistent = start_hash == majority_hash(result.start_hashes)
            if not self.consistent:
                logger.error(
                    f"round {self.round}: this peer started from parameters {start_hash}, most of its group from "
                    f"{majority_hash(result.start_hashes)}; it will download the group's state after this round"
                )
        with self._lock:
            self.strategy.apply(self.theta, self.strategy.aggregate(decoded))
            self.strategy.settle(pending, delivered=self.peer_id in payloads and self.peer_id not in excluded)
            self.round += 1
            self._load_theta_into_model()
        sent = result.bytes_sent if result is not None else 0
        received = result.bytes_received if result is not None else 0
        self.totals.bytes_sent += sent
        self.totals.bytes_received += received
        self.totals.rounds += 1
        t_apply = time.monotonic()
        self.val_loss = self._evaluate()
        logger.debug(
            f"round {self.round - 1} timing: train {t_train - t0:.2f} s, encode {t_encode - t_train:.2f} s, "
            f"wait {t_wait - t_encode:.2f} s, gather {t_gather - t_wait:.2f} s, apply {t_apply - t_gather:.2f} s, "
            f"eval {time.monotonic() - t_apply:.2f} s"
        )
        record = RoundRecord(
            round=self.round,
            params_hash=params_hash(self.theta),
            group=sorted(result.group) if result is not None else [self.peer_id],  # every member, contributing or not
            contributors=len(decoded),
            excluded=excluded,
            bytes_sent=sent,
            bytes_received=received,
            loss=sum(losses) / len(losses),  # NaN on a chain stage other than the last
            val_loss=self.val_loss,
            seconds=time.monotonic() - t0,
        )
        if not self.consistent:  # repair before reporting: the round ends with the group's parameters
            self._catch_up(even_at_same_round=True)
            record.params_hash = params_hash(self.theta)
            record.resynced = self.consistent  # False: no groupmate served the round's state in time
        self.totals.history.append(record)
        self._save_checkpoint()
        self._enable_state_sharing()
        self._publish()
        self._write_status()
        logger.info(
            f"round {self.round} done | group {len(record.group)}{' (' + str(len(excluded)) + ' excluded)' if excluded else ''} "
            f"| loss {record.loss:.3f} | val {self.val_loss:.3f} | {self.tokens_per_s / 1e3:.1f}k tok/s "
            f"| sent {human_bytes(sent)} recv {human_bytes(received)} | {record.seconds:.1f} s | θ {record.params_hash}"
        )

    def _inner_steps(self, H: int):
        """H inner steps from θ; returns (losses, the parameters the round started from), or
        (None, None) when the peer is stopping. Raises ChainBroken for a chain stage."""
        round_start = self.theta
        if self.chain is not None:
            self.chain.open_links(self._sync_round, deadline_s=self.spec.swarm.round_wait)
            round_start = {n: p.detach().to("cpu", torch.float32).clone() for n, p in self.params.items()}
            T = self.theta["embed.weight"].to(self.device)
        bar = ProgressBar(H, f"round {self.round}")
        losses: List[float] = []
        try:
            for self.step in range(1, H + 1):
                if self.stop_event.is_set():
                    return None, None
                x, y = self.stream.next_batch()
                t = time.monotonic()
                if self.chain is None:
                    loss = self.trainer.step(x, y)
                else:
                    loss = self.chain.inner_step(self.model, self.trainer, T, (x, y))
                    loss = float("nan") if loss is None else loss
                dt = time.monotonic() - t
                self.tokens_per_s = 0.8 * self.tokens_per_s + 0.2 * (x.numel() / dt) if self.tokens_per_s else x.numel() / dt
                if self.chain is None or self.part[0] == 0:  # a chain's tokens count once, at its first stage
                    self.totals.tokens += x.numel()
                losses.append(loss)
                self.last_loss = loss
                bar.update(self.step, f"loss {self.last_loss:.3f} | {self.tokens_per_s / 1e3:.1f}k tok/s")
        finally:
            bar.close()
            if self.chain is not None:
                self.chain.close_links()
        return losses, round_start

    def _sync_round(self) -> int:
        """Catch up with the swarm if it is ahead; the round this peer trains next."""
        self._catch_up()
        return self.round

    def _rejoin_chain(self) -> None:
        """The chain broke: drop this round's work, wait for a new chain, rebuild for its stage."""
        with self._lock:
            self._load_theta_into_model()
        self.state = "starting"
        self._publish()
        if self.chain.wait_for_assignment() is None:
            return
        self.part = self.chain.stage_range()
        self._build_role(None)
        self._catch_up()
        self._load_theta_into_model()

    def _wait_for_round_peers(self):
        """Wait (bounded) until every live peer of this round is ready.

        Returns (expected group size, alone: no other live peer at all, behind: some peer is at a
        later round)."""
        deadline = time.monotonic() + self.spec.swarm.round_wait
        last = self.totals.history[-1] if self.totals.history else None
        # last round's groupmates still finishing it (evaluating, checkpointing) will train this
        # round with us: without waiting for them the group would close before they arrive
        mates = set(last.group) - {self.peer_id} if last is not None and last.round == self.round else set()
        while True:
            view = self._view()
            mine = [v for v in view if v.progress.round == self.round and v.peer_id != self.peer_id]
            # in our first round, peers still "waiting" for the start quorum are about to train it too
            busy = ("training", "waiting") if self.totals.rounds == 0 else ("training",)
            training = [v for v in mine if v.progress.state in busy]
            finishing = [
                v for v in view
                if v.peer_id in mates and v.progress.round == self.round - 1 and v.progress.state not in _NOT_IN_ROUNDS
            ]
            if not (training or finishing) or time.monotonic() > deadline or self.stop_event.is_set():
                others = [v for v in view if v.peer_id != self.peer_id and v.progress.state not in _NOT_IN_ROUNDS]
                ready = [v for v in mine if v.progress.state in ("ready", "exchanging")]
                behind = any(v.progress.round > self.round for v in others)
                return 1 + len(ready), not others, behind
            time.sleep(0.25)

    def _view(self) -> List[PeerView]:
        try:
            views = read_progress(self.dht, self.spec.run_id)
        except Exception as e:  # the DHT being slow must not stop training
            logger.debug(f"could not read progress records: {e!r}")
            return []
        return [v for v in views if v.progress.spec == self.spec.digest()]

    def _swarm_is_empty(self) -> bool:
        return not [v for v in self._view() if v.peer_id != self.peer_id and v.progress.state not in _NOT_IN_ROUNDS]

    # ---- state: checkpoint, download, sharing -----------------------------------------------------
    def _load_theta_into_model(self) -> None:
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(self.theta[name].to(p.device, p.dtype))
            if self.chain is not None and self.chain.U is not None:
                # the lossless variant, chain-local: this round starts from θ with every output
                # projection in span(U) (the embedding's drift from T is zero at a round's start)
                T = self.theta["embed.weight"].to(self.device)
                constrain_to_subspace_(self.model.named_parameters(), self.chain.U.to(self.device), T, exact=True)

    def _shareable_state(self):
        with self._lock:
            meta = {"round": self.round, "spec": self.spec.digest(), "names": list(self.layout)}
            shared = self.strategy.shared_state()
            meta["shared"] = sorted(shared)
            tensors = [self.theta[n].clone() for n in self.layout] + [shared[k].clone() for k in sorted(shared)]
        return meta, tensors

    def _enable_state_sharing(self) -> None:
        # late joiners download from the most advanced peer, and never from one that left its group's consensus
        self.gatherer.state_sharing_priority = float(2 * self.round + (1 if self.consistent else 0))
        self.gatherer.allow_state_sharing = True

    def _catch_up(self, even_at_same_round: bool = False) -> None:
        """Download the current state if live peers are ahead of us (round 0 is the seed's, everywhere).

        ``even_at_same_round``: this peer ended a round off its group's parameters and must take a
        state of at least its own (new) round, even if no groupmate has published that round yet:
        a groupmate still evaluating it serves an older state, which is refused and asked again."""
        others = [v for v in self._view() if v.peer_id != self.peer_id and v.progress.state != "stopped"]
        ahead = max((v.progress.round for v in others), default=-1)
        if even_at_same_round:
            if not others:
                return
            ahead = max(ahead, self.round)
        elif ahead <= self.round:
            return
        min_round = ahead
        previous, self.state = self.state, "syncing"
        self._publish()
        try:
            for attempt in range(3):
                logger.info(f"downloading the state of round {ahead} from a live peer")
                got = self.gatherer.load_state(timeout=self.spec.swarm.gather_timeout)
                if got is not None:
                    try:
                        self._install_state(*got, min_round=min_round)
                        self.consistent = True
                        self._enable_state_sharing()
                        return
                    except ProtocolError as e:
                        logger.warning(f"rejected a downloaded state: {e}")
                time.sleep(1.0 + attempt)
            logger.warning("could not download the current state; continuing from our own")
        finally:
            self.state = previous
            self._publish()

    def _install_state(self, meta: Any, tensors: Sequence[torch.Tensor], min_round: int = 0) -> None:
        if not isinstance(meta, dict) or meta.get("spec") != self.spec.digest():
            raise ProtocolError("state is from another run spec")
        names, shared_names = meta.get("names"), meta.get("shared")
        if names != list(self.layout) or not isinstance(shared_names, list) or len(tensors) != len(names) + len(shared_names):
            raise ProtocolError("state does not list this run's tensors")
        round_no = meta.get("round")
        if isinstance(round_no, bool) or not isinstance(round_no, int) or round_no < 0:
            raise ProtocolError("state has no valid round")
        if round_no < min_round:  # a peer that has not finished the round yet: try again
            raise ProtocolError(f"state of round {round_no} is older than the swarm's round {min_round}")
        theta = {}
        for name, t in zip(names, tensors):
            if tuple(t.shape) != tuple(self.layout[name]) or not torch.isfinite(t).all():
                raise ProtocolError(f"state tensor {name} has a wrong shape or non-finite values")
            theta[name] = t.to(torch.float32).clone()
        shared = {k: t.to(torch.float32) for k, t in zip(shared_names, tensors[len(names) :])}
        with self._lock:
            try:
                self.strategy.load_shared_state(shared)
            except ValueError as e:
                raise ProtocolError(str(e)) from None
            self.theta = theta
            self.round = round_no
            self._load_theta_into_model()
        self.totals.bytes_received += sum(t.numel() * t.element_size() for t in tensors)
        logger.info(f"installed the state of round {round_no} (θ {params_hash(self.theta)})")

    def _save_checkpoint(self) -> None:
        directory = self.opts.checkpoint_dir
        if directory is None:
            return
        opt_tensors, opt_rest = flatten_optimizer_state(self.trainer.optimizer.state_dict(), "optimizer.")
        tensors = {f"theta.{n}": t for n, t in self.theta.items()}
        tensors.update({f"shared.{k}": v for k, v in self.strategy.shared_state().items()})
        tensors.update({f"local.{k}": v for k, v in self.strategy.local_state().items()})
        tensors.update(opt_tensors)
        meta = {
            "round": self.round,
            "spec": self.spec.digest(),
            "inner_step": self.trainer.step_count,
            "part": self.part,
            "stream": self.stream.state_dict(),
            "optimizer": opt_rest,
            "tokens": self.totals.tokens,
        }
        save_checkpoint(directory, tensors, meta)

    def _restore_checkpoint(self) -> bool:
        directory = self.opts.checkpoint_dir
        found = load_checkpoint(directory) if directory is not None else None
        if found is None:
            return False
        tensors, meta = found
        if meta.get("spec") != self.spec.digest():
            logger.warning(f"checkpoint in {directory} is from another run spec; starting afresh")
            return False
        try:
            theta = {n: tensors[f"theta.{n}"] for n in self.layout}
            self.strategy.load_shared_state({k[7:]: v for k, v in tensors.items() if k.startswith("shared.")})
            self.strategy.load_local_state({k[6:]: v for k, v in tensors.items() if k.startswith("local.")})
            self.trainer.load_state_dict(
                {"step": meta["inner_step"], "optimizer": unflatten_optimizer_state(tensors, meta["optimizer"], "optimizer.")}
            )
            self.stream.load_state_dict(meta["stream"])
        except (KeyError, ValueError) as e:
            logger.warning(f"checkpoint in {directory} does not fit this run ({e}); starting afresh")
            return False
        self.theta, self.round = theta, int(meta["round"])
        self.totals.tokens = int(meta.get("tokens", 0))
        logger.info(f"resumed from the checkpoint of round {self.round} in {directory}")
        return True

    # ---- reporting ------------------------------------------------------------------------------
    def _evaluate(self) -> float:
        if self.chain is not None:
            return float("nan")  # one stage cannot run the whole model: full replicas report the loss
        return evaluate(self.model, self.val, self.device)

    def _progress(self) -> Progress:
        return Progress(
            round=self.round,
            step=self.step,
            state=self.state,
            spec=self.spec.digest(),
            loss=float(self.last_loss),
            val_loss=float(self.val_loss),
            tokens=self.totals.tokens,
            tokens_per_s=float(self.tokens_per_s),
            bytes_sent=self.totals.bytes_sent,
            bytes_received=self.totals.bytes_received,
            params_hash=params_hash(self.theta) if self.theta and self.state != "training" else "",
            part=self.part if isinstance(self.part, int) else FULL,  # a chain stage counts as a replica's share
        )

    def _publish(self) -> None:
        try:
            ttl = max(3 * self.spec.swarm.heartbeat_period, 10.0)  # a busy peer's heartbeat may be late
            publish_progress(self.dht, self.spec.run_id, self.peer_id, self._progress(), ttl=ttl)
        except Exception as e:
            logger.debug(f"could not publish progress: {e!r}")

    def _heartbeat_loop(self) -> None:
        while not self.stop_event.wait(self.spec.swarm.heartbeat_period):
            self._publish()
            if self.chain is not None:
                self.chain.publish()  # the coordinator keeps a chain only while its members report in

    def status(self) -> Dict[str, Any]:
        return {
            "peer_id": self.peer_id,
            "run_id": self.spec.run_id,
            "spec": self.spec.digest(),
            "strategy": self.spec.outer.strategy,
            "part": list(self.part) if isinstance(self.part, tuple) else self.part,
            "chain": self.chain.assignment.chain.chain_id if self.chain is not None and self.chain.assignment else None,
            "link_bytes_sent": self.chain.bytes_sent if self.chain is not None else 0,
            "link_bytes_received": self.chain.bytes_received if self.chain is not None else 0,
            "link_tokens": self.chain.tokens if self.chain is not None else 0,
            "trainable_params": self.trainable,
            "optimizer_state_bytes": optimizer_state_bytes(self.trainer.optimizer),
            "state": self.state,
            "round": self.round,
            "initial_val_loss": self.initial_val_loss,
            "val_loss": self.val_loss,
            "tokens": self.totals.tokens,
            "rounds": self.totals.rounds,
            "bytes_sent": self.totals.bytes_sent,
            "bytes_received": self.totals.bytes_received,
            "params_hash": params_hash(self.theta),
            "history": [r.__dict__ for r in self.totals.history],
        }

    def _write_status(self) -> None:
        path = self.opts.status_file
        if path is None:
            return
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.status()))
        os.replace(tmp, path)

    def shutdown(self) -> None:
        self.stop_event.set()
        for closer in (self.chain, getattr(self, "gatherer", None), getattr(self, "dht", None)):
            if closer is not None:
                try:
                    closer.shutdown()
                except Exception as e:
                    logger.debug(f"shutdown: {e!r}")
