"""The peer: its life cycle and the round loop, over the parts that do the work.

One round, as the peer sees it:
1. the role (peer/training/roles.py: full replica, slice owner or chain stage) loads θ of this round into
   its model and trains H inner steps;
2. the round engine (peer/outer/engine.py) encodes the pseudo-gradient into a payload;
3. membership (peer/round/membership.py) waits (bounded) until every live peer of the round is ready;
   the exchange (peer/exchange/gatherer.py) finds a group with hivemind's matchmaking and all-gathers the
   payloads the group agrees on;
4. the engine decodes, aggregates and applies them: every member ends with bit-identical θ;
5. checkpoint (peer/checkpoints/contents.py), evaluate, report (peer/round/report.py).
The round loop itself is peer/round/loop.py: by default the exchange of a round runs while the
next round's inner steps go on (one-step-delayed outer update), and a slower peer closes its round
early once most of its round is ready (peer/round/early_close.py).

A peer that finds no group keeps its pseudo-gradient in its local buffers (nothing is lost with
SparseLoCo and DCT) and, if the swarm has moved on, downloads the current state from a live peer
(peer/round/state_sync.py). A peer that started a round off its group's parameters takes the group's
state before it reports the round.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import torch

from peer.checkpoints import contents as checkpoints
from peer.host import cpu_share, device_choice, lifecycle
from peer.chain.stage import ChainMember
from peer.checkpoints.writer import CheckpointWriter
from peer.training.data import val_batches
from peer.exchange.gatherer import PayloadGatherer
from peer.round.membership import Membership
from peer.host.metrics import serve_metrics
from peer.training.model import build_model
from peer.round.report import Totals, optimizer_state_bytes, write_status
from peer.training.resources import detect
from peer.training.roles import ChainStage, FullReplica, Role, SliceOwner
from peer.outer.engine import RoundEngine
from peer.round.loop import RoundLoop, majority_hash
from peer.round.state_sync import StateSync
from peer.training.tokenizer import obtain_corpus
from peer.host.utilization import Utilization, device_label, device_peak_bytes, progress_extras
from protocol.round import peer_states
from protocol.dht.keys import averager_prefix
from protocol.dht.records import CHOOSING, Progress
from protocol.spec import RunSpec
from protocol.round.timing import Timing
from swarm.cpu_meter import thread_cpu
from swarm.access.admission import admission_gate
from swarm.dht import known_nodes
from swarm.dht.node import start_dht
from swarm.helper_processes import on_stop_signals, starting_helpers
from swarm.access.reachability import UNKNOWN, watch_reachability
from swarm.records import fetch_spec

logger = logging.getLogger("voloco.peer")

__all__ = ["Peer", "PeerOptions", "majority_hash"]  # majority_hash: peer/round/loop.py's


@dataclass
class PeerOptions:
    join: Sequence[Any]  # parsed multiaddrs
    run_id: Optional[str] = None
    run_key: Optional[str] = None  # fingerprint of the run's key: only a spec it signed is accepted
    join_token: Optional[str] = None  # a private run's shared secret (swarm/access/admission.py)
    data: Optional[str] = None
    device: str = "auto"  # "auto": CUDA when torch sees it, else the CPU (peer/host/device_choice.py)
    identity: Optional[str] = None
    checkpoint_dir: Optional[Path] = None
    host_maddrs: Sequence[str] = ("/ip4/0.0.0.0/tcp/0",)
    announce_maddrs: Sequence[str] = ()
    client_mode: bool = False  # connect out only (swarm/access/reachability.py tells whether it is needed)
    use_relay: bool = True
    use_auto_relay: bool = False
    status_file: Optional[Path] = None
    max_memory_gb: Optional[float] = None  # declared memory for training; None: detect
    bandwidth_mbps: Optional[float] = None
    stage_host: Optional[str] = None  # where neighbours reach this peer's stage listener (None: its DHT addresses)
    stage_port: int = 0
    max_rounds: Optional[int] = None
    threads: Optional[int] = None
    compile: Optional[bool] = None  # torch.compile of the inner steps' forward; None: on CUDA only (device_choice)
    spec_timeout: float = 30.0
    wait_peers: int = 1  # before the first round, wait until this many peers (self included) have started
    metrics_port: int = 0  # serve Prometheus metrics on this port (peer/host/metrics.py); 0: off


class Peer:
    def __init__(self, opts: PeerOptions):
        self.opts = opts
        self.stop_event = threading.Event()
        self.totals = Totals()
        self.checkpoint_writer = CheckpointWriter()  # end-of-round checkpoints, in the background
        self.state = "starting"
        self.step = 0
        self.last_loss = float("nan")
        self.val_loss = float("nan")
        self.gathered = (0, "")  # (round, name) of the last set this peer's group agreed (peer/round/merge.py)
        self.gathered_before = ""  # the name of the one its group agreed the round before, if any
        self.gathered_from = ""  # the θ the set of self.gathered was applied to (peer/round/merge.py)
        self.initial_val_loss = float("nan")
        self.tokens_per_s = 0.0
        self.role: Optional[Role] = None
        self.engine: Optional[RoundEngine] = None
        self.loop: Optional[RoundLoop] = None  # the round loop (peer/round/loop.py), once the peer has a role
        self._chain: Optional[ChainMember] = None
        self.util = Utilization()  # time in inner steps / wall time, per round (peer/host/utilization.py)
        self.reach = UNKNOWN  # "public" | "client" | "unknown": can other nodes dial this peer (swarm/access/reachability.py)
        self.started = False  # start() done: the phase follows the state (peer/host/lifecycle.py)

    @property
    def round(self) -> int:
        return self.engine.round if self.engine is not None else 0

    # ---- set-up ---------------------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        """SIGINT/SIGTERM/SIGHUP end the peer after its current step (hivemind's averager start resets
        SIGINT); its helper processes stop only when the peer stops them (swarm/helper_processes.py)."""
        if threading.current_thread() is not threading.main_thread():
            return

        def stop(signum, frame):
            if not self.stop_event.is_set():
                logger.info("stopping: finishing the current step (signal again to force)")
                self.stop_event.set()
            else:
                raise KeyboardInterrupt

        on_stop_signals(stop)

    def start(self) -> None:
        opts = self.opts
        machine = device_choice.detect_machine(share=not opts.threads)
        self.choice = device_choice.choose(opts.device, opts.compile, opts.threads, machine)
        if self.choice.threads:
            torch.set_num_threads(self.choice.threads)
        logger.info(self.choice.describe(machine))
        # without --threads: its share of the host, looked at again at every round's start (by the loop)
        self.thread_share = cpu_share.ThreadShare(machine.base_threads, self.choice.threads or machine.cpu_threads,
                                                  device_choice.share, set_threads=torch.set_num_threads).start() \
            if self.choice.shared else None
        lifecycle.meter_wire(self)  # self.wire: every TCP byte of this peer's processes, from the DHT's first on
        lifecycle.set_phase(self, "joining the DHT")
        with starting_helpers():  # Ctrl+C reaches this process only; it stops them (swarm/helper_processes.py)
            self.dht = start_dht(opts.join, opts.host_maddrs, opts.announce_maddrs, opts.identity, opts.client_mode,
                                 join_token=opts.join_token, run_key=opts.run_key, use_relay=opts.use_relay,
                                 use_auto_relay=opts.use_auto_relay, keep_trying=True,
                                 known=known_nodes.recall(known_nodes.nodes_file(opts.identity)))
        self.peer_id = self.dht.peer_id.to_base58()
        self.metrics = serve_metrics(self, opts.metrics_port) if opts.metrics_port else None
        watch_reachability(self, self.dht, opts.join, opts.client_mode, opts.host_maddrs)  # sets self.reach
        logger.info(f"peer {self.peer_id} joined the DHT")
        self.spec: RunSpec = fetch_spec(self.dht, opts.run_id, timeout=opts.spec_timeout)
        spec = self.spec
        # be visible from the start: a peer that sees a newcomer never takes a round alone
        self.timing = Timing.from_spec(spec)  # every wait of the round (protocol/round/timing.py), handed to each collaborator
        self.membership = Membership(self.dht, spec, self.peer_id, self._progress, self.stop_event, timing=self.timing)
        self.membership.start_heartbeat(extra=lambda: self.role.heartbeat() if self.role is not None else None)
        logger.info(
            f"run {spec.run_id} (spec {spec.digest()}): {spec.model.num_params() / 1e6:.2f}M-parameter model, "
            f"strategy {spec.outer.strategy}, H={spec.outer.inner_steps}"
        )
        lifecycle.set_phase(self, "loading data")
        self.corpus = obtain_corpus(self.dht, spec, opts.data, opts.checkpoint_dir)  # the run's tokenizer, verified
        logger.info(f"data: {self.corpus}")
        self.device = torch.device(self.choice.device)
        self.resources = detect(self.device, opts.max_memory_gb, opts.bandwidth_mbps)
        logger.info(f"resources: {self.resources.describe(spec)}")
        self.val = val_batches(self.corpus, spec.model.seq_len, spec.data.batch_size, spec.data.val_batches)
        # θ: the global parameters, on the CPU, the whole model (a chain stage holds it too, to serve
        # and check state like any peer; only its own share lives on its device)
        full = build_model(spec.model, spec.seed, spec.partial.slices, spec.partial.attn_slices)
        theta = {n: p.detach().to(torch.float32).clone() for n, p in full.named_parameters()}
        self.role = self._first_role(full)
        del full
        if self.role is None:
            raise KeyboardInterrupt
        self.engine = RoundEngine(self.role.strategy, theta)
        self.gatherer = PayloadGatherer(
            self.dht,
            prefix=averager_prefix(spec.run_id),
            schema=spec.digest().encode(),
            min_group_size=spec.swarm.min_group_size,
            max_group_size=spec.swarm.max_group_size,
            matchmaking_time=spec.swarm.matchmaking_time,
            gather_timeout=spec.swarm.gather_timeout,
            timing=self.timing,
            request_timeout=spec.swarm.matchmaking_time / 3,  # a leader answers within a third of its wait
            max_payload_bytes=self.role.strategy.max_payload_bytes,  # every part's payload fits
        )
        self.sync = StateSync(spec, self.engine, self.gatherer, self.membership, self.peer_id,
                              set_state=self._set_state, on_installed=self._installed)
        self.gatherer.state_provider = self.sync.shareable_state
        self.gatherer.authorizer = admission_gate(self.dht, spec.run_id)  # None in a public run
        self.membership.tell = self.gatherer.note_progress  # barriers that wait for us may ask it directly
        with starting_helpers():
            self.gatherer.run_in_background(await_ready=True)
        self.membership.publish()  # the gatherer serves our record from now on
        self.install_signal_handlers()

        if self.role.checkpointed:
            tokens = checkpoints.restore(opts.checkpoint_dir, spec, self.engine, self.role)
            self.totals.tokens = tokens or 0
        lifecycle.set_phase(self, "getting the swarm's state")
        self.sync.catch_up()
        self._load_theta()
        self.initial_val_loss = self.val_loss = self._evaluate()
        if self.role.reports_loss:
            logger.info(f"round {self.round}: validation loss {self.val_loss:.3f} nats/byte ({self.val_loss * self.corpus.bytes_per_token:.3f} nats/token)")
        self.sync.enable_sharing()
        self.loop = RoundLoop(self, threads=self.thread_share)
        self.started = True
        lifecycle.report_phase(self)

    def _first_role(self, full: torch.nn.Module) -> Optional[Role]:
        """What this peer trains: the model (or one slice of it) if it fits, else a chain stage."""
        spec, opts = self.spec, self.opts
        if not self.resources.fits(spec):
            self._chain = ChainMember(
                self.dht, spec, self.peer_id, self.resources, opts.stage_host, opts.stage_port, self.stop_event,
                timing=self.timing,
            )
            lifecycle.set_phase(self, "waiting for a chain")
            if self._chain.wait_for_assignment() is None:
                return None
            if opts.compile:  # asked for explicitly
                logger.warning("--compile applies to full and partial peers: this chain stage's inner steps run eagerly")
            return ChainStage(spec, self._chain, self.device, self.corpus)
        slices = spec.partial.slices
        if slices <= 1:
            return FullReplica(spec, full, self.device, self.corpus, self.peer_id, compile=self.choice.compile)
        part = checkpoints.saved_part(opts.checkpoint_dir, spec)  # a restarted peer keeps its slice
        if part not in range(slices):
            part = self.membership.choose_slice(slices)
        return SliceOwner(spec, int(part), full, self.device, self.corpus, self.peer_id, compile=self.choice.compile)

    # ---- the loop -------------------------------------------------------------------------------
    def run(self) -> None:
        max_rounds = self.opts.max_rounds or self.spec.max_rounds
        try:
            if self.opts.wait_peers > 1 and self.round == 0:
                self._set_state("waiting")
                self.membership.wait_for_quorum(self.opts.wait_peers)
            while not self.stop_event.is_set():
                if max_rounds and self.loop.rounds_started() >= max_rounds:
                    self.loop.finish()
                    logger.info(f"reached round {self.round}: stopping as asked")
                    break
                self.loop.one_round()
        finally:
            self.loop.drain()
            self.state = "stopped"
            self.membership.publish()
            write_status(self.opts.status_file, self.status())
        if not self.stop_event.is_set():  # its rounds are done (--rounds), not interrupted nor failed
            self._serve_the_last_round()

    def _serve_the_last_round(self) -> None:
        """After its last round, keep serving that round's sets and payloads while other peers of the
        round still merge it (ready or exchanging in its records), at most ``Timing.set_fetch_s``: a peer
        that draws its contributions (peer/round/draw.py) fetches the drawn payloads once its merge is
        over, and a peer that left the moment it concluded would leave it a second θ."""
        last, timing = self.round - 1, self.membership.timing
        deadline = time.monotonic() + timing.set_fetch_s
        said = False
        while time.monotonic() < deadline:
            merging = [v for v in self.membership.view() if v.peer_id != self.peer_id and v.progress.round == last
                       and v.progress.state in peer_states.DONE]
            if not merging:
                return
            if not said:
                logger.info(f"serving round {last}'s sets to {len(merging)} peer(s) still merging it "
                            f"(at most {timing.set_fetch_s:g} s)")
                said = True
            time.sleep(timing.view_poll_s)

    def _sync_round(self) -> int:
        """Catch up with the swarm if it is ahead; the round this peer trains next."""
        self.sync.catch_up()
        return self.round

    def _recover(self) -> None:
        """The role abandoned the round: drop its work, get a role to go on with, catch up."""
        self._load_theta()
        # the status file says so at once, not the last round's status (its chain, "exchanging") while a
        # stage whose chain broke waits, minutes perhaps, for a new chain (tests/round/test_recovery_status.py)
        self.phase = "waiting for a chain" if isinstance(self.role, ChainStage) else "recovering"
        self._set_state("starting")
        role = self.role.recover(self.corpus)
        if role is None:
            return
        self.role = role
        self.engine.strategy = role.strategy
        self.sync.catch_up()
        self._load_theta()

    # ---- state ----------------------------------------------------------------------------------
    def _load_theta(self) -> None:
        if self.loop is not None and self.loop.defers_load():
            return  # the inner loop loads θ, with its local delta, at its next step (peer/round/loop.py)
        with self.engine.lock:
            self.role.load_theta(self.engine.theta)

    def _installed(self, nbytes: int) -> None:
        self._load_theta()
        self.totals.bytes_received += nbytes
        # a state of an earlier round (a solo lineage rejoining the swarm): the rounds it trained past
        # that one are abandoned, and the history keeps one record a round
        self.totals.history = [r for r in self.totals.history if r.round < self.engine.round]

    def _set_state(self, state: str) -> str:
        if not peer_states.allowed(self.state, state):  # a move the table (protocol/round/peer_states.py) lacks
            logger.error(f"state {self.state!r} -> {state!r} is not a move protocol/round/peer_states.py allows")
        previous, self.state = self.state, state
        self.membership.publish()
        lifecycle.report_phase(self)
        return previous

    # ---- reporting ------------------------------------------------------------------------------
    def _evaluate(self) -> float:
        return self.corpus.per_byte(self.role.evaluate(self.val))  # nats per byte with any tokenizer

    def _progress(self) -> Progress:
        engine = self.engine
        # θ's round, hash and state digest, read together (a round may conclude meanwhile); a training
        # peer reports them too, without waiting for the exchange: newcomers check a served θ against them
        round_no, theta_hash, digest = engine.reported(waits=self.state != "training") if engine is not None else (0, "", "")
        return Progress(
            round=round_no,
            step=self.step,
            state=self.state,
            spec=self.membership.digest,
            loss=float(self.last_loss),
            val_loss=float(self.val_loss),
            tokens=self.totals.tokens,
            tokens_per_s=float(self.tokens_per_s),
            bytes_sent=self.totals.bytes_sent,
            bytes_received=self.totals.bytes_received,
            params_hash=theta_hash,
            part=self.role.progress_part if self.role is not None else CHOOSING,
            **progress_extras(self),  # device, util, reach
            gathered_round=self.gathered[0],
            gathered=self.gathered[1],
            gathered_before=self.gathered_before,
            gathered_from=self.gathered_from,
            state_digest=digest,
            sends=self.role.progress_sends if self.role is not None else "",
        )

    def status(self) -> Dict[str, Any]:
        role = self.role
        return {
            "peer_id": self.peer_id,
            "run_id": self.spec.run_id,
            "spec": self.membership.digest,
            "strategy": self.spec.outer.strategy,
            **role.status(),
            "device": device_label(str(self.device)),  # cuda:0 NVIDIA H100 80GB HBM3, cpu
            "device_peak_bytes": device_peak_bytes(self.device),  # the GPU memory torch allocated at most; None on the CPU
            "precision": role.trainer.precision,  # what the inner steps run in: bf16 or fp32
            "compiled": role.trainer.compiled,  # --compile: the forward pass through torch.compile
            "trainable_params": role.trainable,
            "optimizer_state_bytes": optimizer_state_bytes(role.trainer.optimizer),
            "state": self.state,
            "phase": lifecycle.phase_of(self),
            "round": self.round,
            "initial_val_loss": self.initial_val_loss,
            "val_loss": self.val_loss,
            **self.corpus.loss_report(self.val_loss),  # val_loss_per_token, bytes_per_token, tokenizer
            "tokens": self.totals.tokens,
            "rounds": self.totals.rounds,
            "util": self.util.value,  # compute utilization: time in inner steps / wall time, last round
            # the H at about which this peer's compute would be busy 95 % of the time (None: busy enough)
            "busy_at_inner_steps": self.loop.advisor.h if self.loop is not None else None,
            "bytes_sent": self.totals.bytes_sent,
            "bytes_received": self.totals.bytes_received,
            "wire": lifecycle.wire_status(self),  # every TCP byte on the wire, and the control plane's share
            "cpu_by_thread": thread_cpu(),  # this process's CPU seconds by thread (swarm/cpu_meter.py)
            "params_hash": self.engine.params_hash(),
            # the standing, eligibility and shared state held with θ (peer/checkpoints/files.py), as the
            # progress record reports it: equal on every peer of one lineage
            "state_digest": self.engine.reported(waits=False)[2],
            "history": [r.__dict__ for r in self.totals.history],
        }

    def shutdown(self) -> None:
        if getattr(self, "thread_share", None) is not None:
            self.thread_share.stop()
        if getattr(self, "dht", None) is not None:  # the next start's other doors into the swarm
            known_nodes.remember(self.dht, known_nodes.nodes_file(self.opts.identity))
        lifecycle.shutdown(self, (self._chain, getattr(self, "gatherer", None), getattr(self, "dht", None),
                                  getattr(self, "metrics", None)))
