"""R replicas of the real round logic in one process, for benchmarks and tests.

``simulate`` runs, round after round, what every live full peer runs, minus the network: each
replica is a ``FullReplica`` role (peer/training/roles.py: its own model copy, ``InnerTrainer`` with its
AdamW state, ``TrainStream`` on shard ``f"replica{i}"``) with its own ``RoundEngine``
(peer/outer/engine.py: its own θ and strategy object, hence its own error-feedback or DCT-momentum
buffer). These are the objects a live peer (peer/host/runtime.py) uses, so the simulation computes what
the swarm computes by construction. One round:

1. every replica loads its θ into its model and trains H inner steps;
2. ``engine.encode``: the real bytes a peer would put on the wire;
3. every replica's engine decodes ALL payloads in the canonical order and concludes the round:
   aggregate, outer step on its own θ (DiLoCo's outer momentum, the strategy's shared state, is
   updated by each replica from the same aggregate, as on real peers), settle its buffers.

After each round the θ of every replica is checked bit-identical to replica 0's (``torch.equal``,
cheap). Decoding every payload once per replica costs R² decodes; for the first ``verify_rounds``
rounds each replica really decodes the bytes itself (and the decoded tensors are checked
identical), afterwards the tensors replica 0 decoded are handed to the other replicas (decoding is
a pure function of the bytes, as the codecs guarantee and the first rounds check). Aggregate,
apply and settle always run per replica.

Byte accounting follows the real exchange (``peer/exchange/gatherer.py``, an all-gather): each member
serves its payload to the other R−1 members and fetches their R−1 payloads, so per round
``sent = (R−1)·len(own payload)`` and ``received = Σ len(other payloads)``. Per-step data-parallel
training is not simulated for bytes: a ring all-reduce of fp32 gradients sends (and receives)
``2·(R−1)/R · 4 · params`` bytes per peer per step, computed analytically
(protocol/wire/exchange_bytes.py).

``train_single`` is the single-process baseline: plain AdamW (the same ``InnerTrainer``) on one
model, no outer loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from peer.training.data import Corpus, TrainStream, load_corpus, val_batches
from peer.training.inner import InnerTrainer, evaluate
from peer.training.model import build_model
from peer.training.roles import FullReplica, SliceOwner
from peer.outer.engine import RoundEngine, Settled
from peer.outer.robust import Contributions, sender_names
from peer.round.handoff import continue_from
from protocol.wire.exchange_bytes import allgather_bytes_per_round, allreduce_bytes_per_step
from peer.outer.strategies import Tensors
from protocol.model.partial import FULL
from protocol.spec import RunSpec
from protocol.wire.payload import claimed_part

__all__ = [
    "RoundStats",
    "SimResult",
    "SingleResult",
    "simulate",
    "train_single",
]

# --- results -------------------------------------------------------------------------------------
@dataclass
class RoundStats:
    round: int  # rounds completed (1-based after the first outer step)
    tokens: int  # tokens trained so far, all replicas together
    train_loss: float  # mean inner-step loss of this round, over replicas and steps
    val_loss: Optional[float]  # on θ after this round's outer step (None when not evaluated)
    payload_bytes: List[int]  # len(encoded payload) of each replica this round
    seconds: float
    params_hash: str = ""  # of θ after this round's outer step (``peer.checkpoints.files.params_hash``, as peers report it)
    excluded: Dict[str, str] = field(default_factory=dict)  # sender -> why its contribution did not count (replica 0's view)
    scores: Dict[str, float] = field(default_factory=dict)  # sender -> its direction check score (peer/outer/consensus.py)
    dropped: Dict[str, List[str]] = field(default_factory=dict)  # sender -> its tensors left out (peer/outer/robust.py)
    clipped: Dict[str, float] = field(default_factory=dict)  # sender -> the smallest scale the clip applied to it (replica 0's view)
    contributors: int = 0  # contributions that entered θ this round (at most K per part: protocol/round/choice.py)
    decode_s: float = 0.0  # seconds replica 0 took to choose and decode them (what one peer decodes)
    senders: int = 0  # payloads sent at all this round (protocol/round/eligibility.py; every replica's with K = 0)


@dataclass
class SimResult:
    strategy: str
    replicas: int
    rounds: int
    inner_steps: int
    num_params: int
    initial_val_loss: float
    history: List[RoundStats] = field(default_factory=list)
    verified_rounds: int = 0  # rounds in which every replica decoded every payload itself
    aggregate: str = "mean"  # the spec's: "chosen" for SparseLoCo's average over the replicas that kept a coordinate
    min_share: float = 0.0  # with "chosen": the floor of that average (outer.sparseloco.min_share)
    wall_s: float = 0.0
    theta: Optional[Tensors] = None

    @property
    def final_val_loss(self) -> float:
        vals = [r.val_loss for r in self.history if r.val_loss is not None]
        return vals[-1] if vals else self.initial_val_loss

    @property
    def tokens(self) -> int:
        return self.history[-1].tokens if self.history else 0

    @property
    def steps_per_replica(self) -> int:
        return self.rounds * self.inner_steps

    @property
    def payload_bytes(self) -> float:
        """One replica's encoded payload for one round (mean over replicas and rounds)."""
        sizes = [b for r in self.history for b in r.payload_bytes]
        return sum(sizes) / len(sizes) if sizes else 0.0

    @property
    def payload_bytes_per_replica(self) -> List[int]:
        """Σ over rounds of each replica's payload sizes (what each one encoded in total)."""
        return [sum(r.payload_bytes[i] for r in self.history) for i in range(self.replicas)]

    @property
    def bytes_sent_per_peer(self) -> float:
        """All-gather model: each member serves its payload to R−1 members, every round (mean over peers)."""
        return sum(allgather_bytes_per_round(b, self.replicas) for b in self.payload_bytes_per_replica) / self.replicas

    @property
    def bytes_received_per_peer(self) -> float:
        """All-gather model: each member fetches the R−1 other payloads, every round (mean over peers)."""
        total = 0
        for r in self.history:
            s = sum(r.payload_bytes)
            total += sum(s - b for b in r.payload_bytes)
        return total / self.replicas

    @property
    def dp_bytes_per_peer(self) -> float:
        """Analytic: what per-step fp32 ring all-reduce would send per peer for the same inner steps."""
        return self.steps_per_replica * allreduce_bytes_per_step(self.num_params, self.replicas)

    def to_dict(self) -> Dict[str, object]:
        keys = ("strategy aggregate min_share replicas rounds inner_steps num_params tokens initial_val_loss final_val_loss "
                "payload_bytes bytes_sent_per_peer bytes_received_per_peer dp_bytes_per_peer verified_rounds wall_s")
        return {**{k: getattr(self, k) for k in keys.split()}, "history": [r.__dict__ for r in self.history]}

@dataclass
class SingleResult:
    steps: int
    batch_size: int
    tokens: int
    num_params: int
    initial_val_loss: float
    history: List[Dict[str, float]] = field(default_factory=list)  # {"step", "tokens", "val_loss"}
    wall_s: float = 0.0
    theta: Optional[Tensors] = None

    @property
    def final_val_loss(self) -> float:
        return self.history[-1]["val_loss"] if self.history else self.initial_val_loss

    def to_dict(self) -> Dict[str, object]:
        keys = "steps batch_size tokens num_params initial_val_loss final_val_loss wall_s history"
        return {k: getattr(self, k) for k in keys.split()}


# --- the simulation ------------------------------------------------------------------------------
@dataclass
class _Replica:
    sender: str
    role: FullReplica  # the model, its inner trainer and batch stream, as on a live full peer
    engine: RoundEngine  # its own θ and strategy object (error-feedback / momentum buffers)

    def load_theta(self) -> None:
        self.role.load_theta(self.engine.theta)


def _shards(seed_shards: Union[str, Sequence[str]], replicas: int) -> List[str]:
    if isinstance(seed_shards, str):
        return [f"{seed_shards}{i}" for i in range(replicas)]
    shards = [str(s) for s in seed_shards]
    if len(shards) != replicas or len(set(shards)) != replicas:
        raise ValueError(f"seed_shards must name {replicas} distinct shards, got {shards}")
    return shards


def simulate(
    spec: RunSpec,
    replicas: int,
    rounds: int,
    *,
    corpus: Optional[Corpus] = None,
    seed_shards: Union[str, Sequence[str]] = "replica",
    eval_every: int = 1,
    device: str = "cpu",
    verify_rounds: int = 1,
    keep_theta: bool = False,
    init_theta: Optional[Tensors] = None,
    on_round: Optional[Callable[[RoundStats], None]] = None,
    parts: Optional[Sequence[int]] = None,
    eval_rounds: Iterable[int] = (),
    overlap_steps: int = 0,
    tamper: Optional[Callable[[int, str, Tensors], Tensors]] = None,
    on_replica: Optional[Callable[[int, object], None]] = None,
    conclude_rounds: Optional[int] = None,
    steps: Optional[Callable[[int, int], int]] = None,
) -> SimResult:
    """Run ``rounds`` rounds of ``replicas`` replicas of the peer round loop in this process.

    ``seed_shards``: a prefix (shard of replica i is f"{prefix}{i}", "replica" by default) or an
    explicit list of shard names; the shard also serves as the replica's sender id in the
    canonical order. ``eval_every``: evaluate θ every that many rounds (and always after the last).
    ``verify_rounds``: rounds in which every replica decodes every payload itself (R² decodes).
    ``init_theta``: start from these parameters instead of the seed's (a shared warm start); the
    inner optimizers and the strategies' buffers still start fresh.
    ``parts``: with partial updates (``spec.partial.slices`` > 1), the slice each replica owns
    (a ``SliceOwner``; ``FULL``, the default, a ``FullReplica``). ``eval_rounds``: further rounds
    after which θ is evaluated. ``overlap_steps``: the one-step-delayed outer update of a live
    peer with overlap (peer/round/loop.py) whose exchange ends after that many inner steps of the
    next round: each replica takes them from θ_send, then continues from θ + (θ_now − θ_send);
    0: the sequential loop (every round from its θ). ``tamper(round, sender, decoded)``: what a hostile
    sender's contribution decodes to instead (bench/trust.py; the same for every replica: a signed
    payload is the same bytes for every member); ``on_replica(i, role)``: a hook on each replica's role
    once built (e.g. a replica that trains on other data). ``conclude_rounds``: rounds in which every
    replica concludes the round itself (None: all); afterwards replica 0 concludes it and the others
    take its θ and settle their own buffers (``RoundEngine.follow``: R outer steps a round become one,
    for swarms of hundreds). With ``outer.max_contributions`` > 0 each round takes the contributions
    ``RoundEngine.choose`` draws, and a replica passed over keeps its update, as a live peer does.
    ``steps(i, round)``: the inner steps replica i trains in that round (from 1 to H; None: H), as
    a slower peer that closes its round early does; its payload says how many.
    """
    if replicas < 1 or rounds < 0:
        raise ValueError("replicas must be >= 1 and rounds >= 0")
    if not 0 <= overlap_steps <= spec.outer.inner_steps:
        raise ValueError(f"overlap_steps must be in [0, H = {spec.outer.inner_steps}], got {overlap_steps}")
    corpus = corpus if corpus is not None else load_corpus(spec.data.corpus, spec.data.val_fraction)
    H = spec.outer.inner_steps
    shards = _shards(seed_shards, replicas)
    parts = list(parts) if parts is not None else [FULL] * replicas
    if len(parts) != replicas:
        raise ValueError(f"parts must name the part of each of the {replicas} replicas, got {parts}")
    eval_rounds = set(eval_rounds)
    t0 = time.monotonic()

    reps: List[_Replica] = []
    for shard, part in zip(shards, parts):
        model = build_model(spec.model, spec.seed, spec.partial.slices, spec.partial.attn_slices)
        if init_theta is not None:
            _load_params(model, init_theta)
        dev = torch.device(device)
        role = FullReplica(spec, model, dev, corpus, shard) if part == FULL else SliceOwner(spec, part, model, dev, corpus, shard)
        theta = {n: p.detach().to("cpu", torch.float32).clone() for n, p in role.params.items()}
        reps.append(_Replica(sender=shard, role=role, engine=RoundEngine(role.strategy, theta)))
        if on_replica is not None:
            on_replica(len(reps) - 1, role)
    val = val_batches(corpus, spec.model.seq_len, spec.data.batch_size, spec.data.val_batches)
    result = SimResult(
        strategy=spec.outer.strategy,
        replicas=replicas,
        rounds=rounds,
        inner_steps=H,
        num_params=spec.model.num_params(),
        initial_val_loss=reps[0].role.evaluate(val),
        aggregate=spec.outer.sparseloco.aggregate if spec.outer.strategy == "sparseloco" else "mean",
        min_share=spec.outer.sparseloco.min_share if spec.outer.strategy == "sparseloco" else 0.0,
    )
    tokens = 0
    for round_no in range(rounds):
        t_round = time.monotonic()
        # 1-2. local training and encoding, replica by replica (each from its own θ, all equal)
        payloads: Dict[str, bytes] = {}
        pendings = {}
        losses: List[float] = []
        sent: Dict[str, Tensors] = {}
        overlapped = overlap_steps if round_no > 0 else 0  # steps of this round taken during the last exchange
        last = round_no == rounds - 1
        for i, rep in enumerate(reps):
            if not overlap_steps:
                rep.load_theta()
            trains = H if steps is None else max(1, min(H, int(steps(i, round_no))))
            for _ in range(max(0, trains - overlapped)):
                x, y = rep.role.stream.next_batch()
                losses.append(rep.role.inner_step(x, y))
                tokens += x.numel()
            if round_no == 0:
                _assert_frozen(rep)
            payloads[rep.sender], pendings[rep.sender] = rep.engine.encode(rep.engine.theta, rep.role.params,
                                                                           max(trains, overlapped))
            if overlap_steps and not last:  # the next round's first steps, while this round's exchange runs
                sent[rep.sender] = {n: p.detach().clone() for n, p in rep.role.params.items()}
                for _ in range(overlap_steps):
                    x, y = rep.role.stream.next_batch()
                    losses.append(rep.role.inner_step(x, y))
                    tokens += x.numel()
        # 3. every member decodes the round's payloads in canonical order, aggregates, applies
        verify = round_no < verify_rounds
        shared_decoded: Optional[List[Tensors]] = None
        first: Optional[Tuple[List[str], List[str]]] = None  # replica 0's (chosen, passed over)
        leader: Optional[Settled] = None
        decode_s = 0.0
        # with K > 0 only the payloads the lineage's eligibility table lets send are sent at all
        kept = reps[0].engine.senders({s: claimed_part(p) for s, p in payloads.items()}, round_no, reps[0].engine.params_hash())
        offered, unsent = {s: p for s, p in payloads.items() if s in kept}, sorted(set(payloads) - kept)
        for rep in reps:
            if leader is not None and conclude_rounds is not None and round_no >= conclude_rounds:
                rep.engine.follow(reps[0].engine, leader, pendings[rep.sender], rep.sender)
                continue
            if verify or shared_decoded is None:
                t_decode = time.monotonic()
                chosen, invalid, passed = rep.engine.choose(offered, round_no, rep.engine.params_hash())
                decoded, bad = rep.engine.decode(chosen)
                decode_s = decode_s or time.monotonic() - t_decode
                if invalid or bad:
                    raise AssertionError(f"round {round_no}: replica {rep.sender} rejected payloads: {invalid or bad}")
                if shared_decoded is None:
                    shared_decoded, first = decoded, (sorted(chosen), sorted(passed + unsent))
                else:
                    if (sorted(chosen), sorted(passed + unsent)) != first:
                        raise AssertionError(f"round {round_no}: replica {rep.sender} chose differently")
                    _assert_same(shared_decoded, decoded, f"round {round_no}: replica {rep.sender} decoded differently")
            else:  # the draw still runs: it records what moves the eligibility table
                rep.engine.choose(offered, round_no, rep.engine.params_hash())
                decoded = shared_decoded
            if tamper is not None:
                decoded = _tampered(decoded, round_no, tamper)
            settled = rep.engine.conclude(decoded, pendings[rep.sender], delivered=True, me=rep.sender, passed=first[1])
            if rep is reps[0]:
                leader = settled
        excluded, scores = leader.excluded, leader.scores
        if verify:
            result.verified_rounds += 1
        for rep in reps[1:]:
            _assert_same([reps[0].engine.theta], [rep.engine.theta], f"round {round_no}: θ of {rep.sender} differs from {reps[0].sender}")
        # 4. evaluate θ (runtime: load θ into the model, then evaluate; with overlap on a copy)
        val_loss = None
        if last or round_no + 1 in eval_rounds or (eval_every > 0 and (round_no + 1) % eval_every == 0):
            local = {n: p.detach().clone() for n, p in reps[0].role.params.items()} if sent else None
            reps[0].load_theta()
            val_loss = reps[0].role.evaluate(val)
            if local is not None:
                _load_params(reps[0].role.model, local)
        for rep in reps:  # with overlap: continue from θ + the steps taken meanwhile
            if rep.sender in sent:
                continue_from(rep.role.params, rep.engine.theta, sent[rep.sender])
        stats = RoundStats(
            round=round_no + 1,
            tokens=tokens,
            train_loss=sum(losses) / len(losses) if losses else float("nan"),
            val_loss=val_loss,
            payload_bytes=[len(payloads[r.sender]) for r in reps],
            seconds=time.monotonic() - t_round,
            params_hash=reps[0].engine.params_hash(),
            excluded=dict(excluded),
            scores=dict(scores),
            dropped=dict(leader.dropped),
            clipped=dict(leader.clipped),
            contributors=leader.contributors,
            decode_s=decode_s,
            senders=len(offered),
        )
        result.history.append(stats)
        if on_round is not None:
            on_round(stats)
    result.wall_s = time.monotonic() - t0
    if keep_theta:
        result.theta = {n: t.clone() for n, t in reps[0].engine.theta.items()}
    return result


def _tampered(decoded, round_no: int, tamper) -> List[Tensors]:
    """``decoded`` with every contribution as ``tamper`` makes it, in the same order and senders."""
    senders = sender_names(decoded)
    return Contributions([tamper(round_no, s, c) for s, c in zip(senders, decoded)], senders, getattr(decoded, "kinds", None),
                         getattr(decoded, "steps", None))


def _load_params(model: torch.nn.Module, theta: Tensors) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(theta[name].to(p.dtype))


def _assert_frozen(rep: _Replica) -> None:
    """Frozen means frozen: weight decay and Adam never touch the tensors a replica does not own."""
    for name, p in rep.role.params.items():
        if name not in rep.engine.strategy.layout and not torch.equal(p.detach().to("cpu", torch.float32), rep.engine.theta[name]):
            raise AssertionError(f"{rep.sender}: frozen tensor {name} changed")


def _assert_same(a: Sequence[Tensors], b: Sequence[Tensors], what: str) -> None:
    if len(a) != len(b):
        raise AssertionError(what)
    for x, y in zip(a, b):
        for name, t in x.items():
            if not torch.equal(t, y[name]):
                raise AssertionError(f"{what} (tensor {name})")


# --- the single-process baseline -----------------------------------------------------------------
def train_single(
    spec: RunSpec,
    steps: int,
    *,
    corpus: Optional[Corpus] = None,
    batch_size: Optional[int] = None,
    shard: str = "single",
    eval_every: int = 0,
    device: str = "cpu",
    on_eval: Optional[Callable[[Dict[str, float]], None]] = None,
    init_theta: Optional[Tensors] = None,
    keep_theta: bool = False,
) -> SingleResult:
    """Plain AdamW (``InnerTrainer`` with ``spec.inner``, schedule included) on one model for
    ``steps`` steps of ``batch_size`` sequences (default ``spec.data.batch_size``); no outer loop.

    For equal tokens with R replicas of N steps each, pass ``steps = R·N`` (same batch), or
    ``steps = N, batch_size = R·B`` (the data-parallel equivalent). The cosine horizon is
    ``spec.inner.total_steps``: set it to ``steps`` in the spec you pass. ``init_theta``: start
    from these parameters (fresh optimizer); ``keep_theta``: return the final ones in ``.theta``.
    """
    corpus = corpus if corpus is not None else load_corpus(spec.data.corpus, spec.data.val_fraction)
    batch_size = batch_size or spec.data.batch_size
    t0 = time.monotonic()
    model = build_model(spec.model, spec.seed)
    if init_theta is not None:
        _load_params(model, init_theta)
    model = model.to(device)
    trainer = InnerTrainer(model, spec.inner, device)
    stream = TrainStream(corpus, spec.model.seq_len, batch_size, spec.seed, shard=shard)
    val = val_batches(corpus, spec.model.seq_len, spec.data.batch_size, spec.data.val_batches)
    result = SingleResult(
        steps=steps,
        batch_size=batch_size,
        tokens=0,
        num_params=spec.model.num_params(),
        initial_val_loss=evaluate(model, val, device),
    )
    for step in range(1, steps + 1):
        x, y = stream.next_batch()
        trainer.step(x, y)
        result.tokens += x.numel()
        if step == steps or (eval_every > 0 and step % eval_every == 0):
            point = {"step": step, "tokens": result.tokens, "val_loss": evaluate(model, val, device)}
            result.history.append(point)
            if on_eval is not None:
                on_eval(point)
    result.wall_s = time.monotonic() - t0
    if keep_theta:
        result.theta = {n: p.detach().to("cpu", torch.float32).clone() for n, p in model.named_parameters()}
    return result
