"""Heterogeneous replicas (docs/chains.md): pipeline chains beside full replicas, SparseLoCo.

    python bench/chains.py [--quick] [--json OUT] [--only a,c] [--jobs N] [--threads T] [--seeds S]
                           [--warm-rounds W]

``--quick``: ~1 min (a 0.13M model, 60 steps per replica: a smoke run, its losses are noise-level).
Full: ~7-8 CPU-minutes at 1 thread (d 128, 4 layers, 200 steps per replica, 5 arms); ``--jobs 2``
runs two arms at a time.

Same model, data, seeds and total tokens in every arm; R = 4 replicas, a chain counting as one
replica (one model whose forward and backward cross a stage boundary after block n_layers / 2):

* (a) ``4 full``: four full replicas (the reference);
* (b) ``3 full + chain k=d``: the fourth replica is a 2-stage chain with an uncompressed boundary
  (the identity codec: ``h - T[tok]`` in fp16, no constraint);
* (c) ``3 full + chain k=d/10``: selective compression. Only the chain projects its boundary onto
  ``span(U)`` at the default rank ``spec.chain.effective_rank(d)``, with the lossless chain-local
  constraint exactly as peer/host/runtime.py + peer/chain/gpipe.py run it;
* (d) ``4 chains k=d/10``: uniform compression. Every replica is a compressed chain and the run
  trains the subspace-constrained model (the run-wide variant of protocol/chain/subspace_constraint.py, what
  ``chain.compress_all`` describes): θ is projected once at the start and after every outer step
  (``exact=True``), so no replica drops anything at its round start;
* extra row (``--quick`` skips it): (c') = (c) at the larger rank d // 4; ``--only ...,d4`` adds
  (d') = (d) at d // 4 (not in the default run, to keep it short).

The in-process simulation follows the runtime step by step (peer/round/simulate.py's round loop, which
trains full replicas only):

* a full replica: load θ, H x ``InnerTrainer.step`` (global-norm clip), Δ = θ − θ_local, one
  payload of the whole model;
* a chain: one model, one AdamW (element-wise, so one optimizer over both stages equals one per
  stage; tests/chain/test_pipeline.py checks this emulation bit-identical to stages linked over TCP), one
  ``TrainStream`` whose shard is the replica's (both stages draw the same batches). Round start as
  ``Peer._load_theta_into_model``: load θ, then, when k < d, ``constrain_to_subspace_(..., U,
  T=θ["embed.weight"], exact=True)``; that projected start is ``round_start`` and T is θ's
  embedding. One inner step as ``run_inner_step``: the batch split into ``spec.chain.micro_batches``
  micro-batches, each ``embed -> blocks[:m] -> compressed_boundary(codec, T) -> blocks[m:] -> head``,
  ``(loss / M).backward()`` in micro-batch order; ``project_gradients_`` (k < d); lr; clip each
  stage's own gradients; AdamW step; ``constrain_to_subspace_(..., U, T)`` (k < d). Each stage is
  a peer of the exchange: Δ over its own tensors from the round start, its own
  ``make_strategy(spec, part=(start, end))`` (error feedback per stage), its own payload;
* exchange: every member (full peer or stage peer) decodes every payload in ``canonical_order``
  (really in round 0, with the decoded tensors checked identical; later rounds reuse the first
  member's decode, decoding being a pure function of the bytes), ``aggregate`` (each tensor
  averaged over the payloads that carry it: 4 per tensor in every arm), ``apply`` to its own θ,
  ``settle``; θ is asserted bit-identical across members every round.

``--seeds S`` runs every arm with seeds 0 … S−1 (losses paired with (a) of the same seed, mean ±
spread); ``--warm-rounds W`` starts every arm from θ after W rounds of 4 full replicas, so the chain
joins a run under way without standing (the direction check then judges it: the ``refused`` column
counts its stages' updates that did not count).

Rows: validation loss of θ after the last round, evaluated uncompressed (the full model, as a
full peer reports it), its ratio to (a); for chain arms also the loss as the chain computes it
(θ projected, through the compressed boundary). Bytes per token between stages from the codec's
formulas (``ActivationCodec.forward_bytes_per_token``: k·2 + 1 token-id byte for the 256-byte
vocabulary; ``backward_bytes_per_token``: k·2) and the ratio against the plain fp16 hidden state
each way, 2·(d·2); in brackets the same per token with the real frame encoding
(``protocol.chain.frames.encode_frame`` of one micro-batch: msgpack header and length prefix included).
Exchange bytes as bench/compression.py counts them (all-gather: each member serves its payload to
the G − 1 other members and fetches theirs every round; a chain's stages are two members, so G is
4, 5 or 8), mean per member over the run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import decode_payloads, human, machine, now, run_jobs, table  # noqa: E402
from peer.training.data import TrainStream, load_corpus, val_batches  # noqa: E402
from peer.training.inner import InnerTrainer, evaluate  # noqa: E402
from peer.training.model import build_model  # noqa: E402
from peer.chain.links import link_codec  # noqa: E402
from peer.outer.engine import RoundEngine  # noqa: E402
from peer.outer.strategies import make_strategy  # noqa: E402
from bench.chain_replicas import Member, Replica, chain_evaluate, chain_step, copy_theta, load  # noqa: E402
from protocol.chain.activations import uncompressed_bytes_per_token  # noqa: E402
from protocol.chain.frames import Activations, FrameFormat, Grads, encode_frame  # noqa: E402
from protocol.spec import ModelSpec, RunSpec  # noqa: E402
from protocol.chain.subspace_constraint import constrain_to_subspace_  # noqa: E402
from swarm.jsonout import dumps as strict_json  # noqa: E402  (NaN -> null: strict JSON)

R = 4
CONFIGS = {
    # the demo model's shape (d 128, 4 layers, 0.87M parameters) on 64-byte sequences
    "full": dict(
        model=dict(d_model=128, n_layers=4, n_heads=4, ffn_hidden=352, seq_len=64),
        batch_size=16, inner_steps=20, rounds=10, lr=2e-3, warmup=20, extra=True,
    ),
    # a tiny model for a smoke run
    "quick": dict(
        model=dict(d_model=64, n_layers=2, n_heads=4, ffn_hidden=176, seq_len=32),
        batch_size=8, inner_steps=10, rounds=6, lr=3e-3, warmup=10, extra=False,
    ),
}


@dataclass(frozen=True)
class Arm:
    key: str
    label: str
    chains: int  # replicas that are chains (the last ones); the others are full
    rank: str  # "d": uncompressed boundary; "default": spec.chain.effective_rank(d); "d4": d // 4
    run_wide: bool = False  # the constrained model everywhere (uniform arm)


ARMS = [
    Arm("a", "(a) 4 full", 0, "d"),
    Arm("b", "(b) 3 full + chain k=d", 1, "d"),
    Arm("c", "(c) 3 full + chain k=d/10 (selective)", 1, "default"),
    Arm("d", "(d) 4 chains k=d/10 (uniform)", 4, "default", run_wide=True),
]
EXTRA_ARMS = [Arm("c4", "(c') 3 full + chain k=d/4 (selective)", 1, "d4")]  # in the full run
OPTIONAL_ARMS = [Arm("d4", "(d') 4 chains k=d/4 (uniform)", 4, "d4", run_wide=True)]  # --only d4


def make_spec(cfg: Dict[str, Any], seed: int = 0) -> RunSpec:
    steps = cfg["inner_steps"] * cfg["rounds"]
    return RunSpec(run_id="bench-chains", seed=seed, model=ModelSpec(**cfg["model"])).replace(
        data={"batch_size": cfg["batch_size"], "val_batches": 8},
        inner={"lr": cfg["lr"], "warmup_steps": cfg["warmup"], "total_steps": steps},
        outer={"strategy": "sparseloco", "inner_steps": cfg["inner_steps"]},
    )


def rank_of(spec: RunSpec, rank: str) -> int:
    d = spec.model.d_model
    return {"d": d, "default": spec.chain.effective_rank(d), "d4": d // 4}[rank]


# --- link bytes ----------------------------------------------------------------------------------
def link_bytes(spec: RunSpec, k: int) -> Dict[str, Any]:
    """Per token between the two stages: the codec's formulas, and real frames of one micro-batch."""
    d, vocab, S = spec.model.d_model, spec.model.vocab_size, spec.model.seq_len
    codec = link_codec(d, k, spec.seed, torch.float16)
    micro = max(1, spec.data.batch_size // spec.chain.micro_batches)
    fmt = FrameFormat.for_run(spec, micro_batch=micro, k=k)
    tokens = micro * S
    values = torch.zeros(micro, S, k, dtype=torch.float16)
    act = len(encode_frame(Activations(mb=3, step=1000, tokens=torch.zeros(micro, S, dtype=torch.int64), values=values), fmt))
    grad = len(encode_frame(Grads(mb=3, step=1000, values=values), fmt))
    fwd, bwd = codec.forward_bytes_per_token(vocab), codec.backward_bytes_per_token()
    plain = 2 * uncompressed_bytes_per_token(d, torch.float16)
    return dict(k=k, forward=fwd, backward=bwd, total=fwd + bwd, plain_fp16=plain, ratio=plain / (fwd + bwd),
                frame_forward=act / tokens, frame_backward=grad / tokens, frame_total=(act + grad) / tokens)


_CORPUS: Dict[str, Any] = {}


def corpus_once():
    if "stdlib" not in _CORPUS:
        _CORPUS["stdlib"] = load_corpus("stdlib")
    return _CORPUS["stdlib"]


def run_arm(job) -> Dict[str, Any]:
    cfg, arm, threads, seed = job
    torch.set_num_threads(threads)
    t0 = time.monotonic()
    spec = make_spec(cfg, seed)
    if arm.run_wide:  # every replica trains the constrained model: the run spec says so
        spec = spec.replace(chain={"compress_all": True})
    corpus = corpus_once()
    H, rounds, M = spec.outer.inner_steps, cfg["rounds"], spec.chain.micro_batches
    d, L = spec.model.d_model, spec.model.n_layers
    cut = L // 2
    k = rank_of(spec, arm.rank)
    codec = link_codec(d, k, spec.seed, torch.float16)
    U = codec.U if k < d else None
    stages = [(0, cut), (cut, L)]

    theta0 = {n: p.detach().clone() for n, p in build_model(spec.model, spec.seed).named_parameters()}
    if cfg.get("warm_rounds"):  # a run already under way: the chain joins full replicas that trained it
        from peer.round.simulate import simulate
        theta0 = simulate(spec, R, cfg["warm_rounds"], corpus=corpus, seed_shards="warm", eval_every=0, keep_theta=True).theta
    if arm.run_wide and U is not None:  # the constrained model from round 0 (T = E: the embedding is untouched)
        constrain_to_subspace_(theta0, U, theta0["embed.weight"], exact=True)

    reps: List[Replica] = []
    for i in range(R):
        name = f"replica{i}"
        model = build_model(spec.model, spec.seed)
        chain = i >= R - arm.chains
        if chain:
            members = [Member(f"{name}-stage{s}", RoundEngine(make_strategy(spec, part=(a, b)), copy_theta(theta0)))
                       for s, (a, b) in enumerate(stages)]
        else:
            members = [Member(name, RoundEngine(make_strategy(spec), copy_theta(theta0)))]
        rep = Replica(name, model, InnerTrainer(model, spec.inner), TrainStream(corpus, spec.model.seq_len, spec.data.batch_size,
                      spec.seed, shard=name), members, chain)
        if chain:
            params = dict(model.named_parameters())
            rep.cut, rep.codec, rep.U = cut, codec, U
            rep.groups = [[params[n] for n in m.engine.strategy.layout] for m in members]
        reps.append(rep)
    members = [m for rep in reps for m in rep.members]
    val = val_batches(corpus, spec.model.seq_len, spec.data.batch_size, spec.data.val_batches)
    evaluator = build_model(spec.model, spec.seed)
    load(evaluator, theta0)
    initial = evaluate(evaluator, val)

    history = []
    sent = {m.sender: 0 for m in members}
    received = {m.sender: 0 for m in members}
    payload_sizes: Dict[str, List[int]] = {m.sender: [] for m in members}
    tokens = 0
    refused = {"stage": 0, "full": 0}  # contributions the round's checks refused, the first member's view
    for round_no in range(rounds):
        payloads, pendings, losses = {}, {}, []
        for rep in reps:
            theta = rep.members[0].engine.theta  # every member's θ is the same (asserted below)
            load(rep.model, theta)
            if rep.chain:
                rep.T = theta["embed.weight"].clone()
                if rep.U is not None and not arm.run_wide:  # chain-local: start from θ projected
                    constrain_to_subspace_(rep.model.named_parameters(), rep.U, rep.T, exact=True)
                start = {n: p.detach().clone() for n, p in rep.model.named_parameters()}
            else:
                start = theta
            for _ in range(H):
                x, y = rep.stream.next_batch()
                losses.append(chain_step(rep, x, y, M) if rep.chain else rep.trainer.step(x, y))
                tokens += x.numel()
            params = dict(rep.model.named_parameters())
            for m in rep.members:
                payloads[m.sender], pendings[m.sender] = m.engine.encode(start, params)
        total_bytes = sum(len(p) for p in payloads.values())
        shared = None
        for m in members:
            own = len(payloads[m.sender])
            payload_sizes[m.sender].append(own)
            sent[m.sender] += (len(members) - 1) * own
            received[m.sender] += total_bytes - own
            decoded = decode_payloads(m.engine, payloads, round_no, shared, f"{m.sender} decoded differently")
            if shared is None:
                shared = decoded
            settled = m.engine.conclude(decoded, pendings[m.sender], delivered=True)
            if m is members[0]:
                for sender in settled.excluded:
                    refused["stage" if "-stage" in sender else "full"] += 1
            if arm.run_wide and U is not None:  # the aggregate is not in span(U): project θ again, exactly
                constrain_to_subspace_(m.engine.theta, U, m.engine.theta["embed.weight"], exact=True)
        theta = members[0].engine.theta
        for m in members[1:]:
            assert all(torch.equal(theta[n], m.engine.theta[n]) for n in theta), f"round {round_no}: θ of {m.sender} differs"
        last = round_no == rounds - 1
        val_loss = None
        if last or (round_no + 1) % max(1, rounds // 5) == 0:
            load(evaluator, members[0].engine.theta)
            val_loss = evaluate(evaluator, val)
        history.append(dict(round=round_no + 1, tokens=tokens, train_loss=sum(losses) / len(losses), val_loss=val_loss))

    theta = members[0].engine.theta
    chain_view = None
    if arm.chains:  # the loss the chain's own model has: θ projected as at a round start, through the boundary
        load(evaluator, theta)
        T = theta["embed.weight"].clone()
        if U is not None and not arm.run_wide:
            constrain_to_subspace_(evaluator.named_parameters(), U, T, exact=True)
        chain_view = chain_evaluate(evaluator, val, codec, T, cut)
    full = [m for rep in reps if not rep.chain for m in rep.members]
    stage = [m for rep in reps if rep.chain for m in rep.members]
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    row = dict(
        key=arm.key, arm=arm.label, seed=seed, refused=refused, chains=arm.chains, k=k, run_wide=arm.run_wide, cut=cut, rounds=rounds, H=H,
        tokens=tokens, initial_val_loss=initial, val_loss=history[-1]["val_loss"], chain_view_val_loss=chain_view,
        members=len(members), link=link_bytes(spec, k) if arm.chains else None,
        payload_full=mean([mean(payload_sizes[m.sender]) for m in full]) if full else None,
        payload_stage=mean([mean(payload_sizes[m.sender]) for m in stage]) if stage else None,
        sent_per_peer=mean(list(sent.values())), received_per_peer=mean(list(received.values())),
        sent_by_member=sent, received_by_member=received, history=history, wall_s=time.monotonic() - t0,
    )
    print(f"  {arm.label} seed {seed}: val {row['val_loss']:.4f}, refused {refused['stage']} stage / {refused['full']} full"
          + (f", chain view {chain_view:.4f}" if chain_view is not None else "") + f", {row['wall_s']:.0f} s", flush=True)
    return row


def run_arms(cfg, arms, jobs: int, threads: int, seeds: int = 1) -> List[Dict[str, Any]]:
    return run_jobs(run_arm, [(cfg, arm, threads, seed) for seed in range(seeds) for arm in arms], jobs)


# --- report ------------------------------------------------------------------------------------
def print_main(rows, spec: RunSpec) -> None:
    refs = {r["seed"]: r for r in rows if r["key"] == "a"}
    lines = []
    for r in rows:
        link, ref = r["link"], refs.get(r["seed"])
        if ref is not None:
            r["loss_vs_a"] = r["val_loss"] / ref["val_loss"]
        lines.append([
            r["arm"], str(r["seed"]), str(r["k"]) if r["chains"] else "-", f"{r['val_loss']:.4f}",
            f"{r['loss_vs_a']:.4f}" if ref is not None else "-", f"{r['refused']['stage']}/{r['refused']['full']}",
            f"{r['chain_view_val_loss']:.4f}" if r["chain_view_val_loss"] is not None else "-",
            f"{link['forward']}+{link['backward']}={link['total']} [{link['frame_total']:.1f}]" if link else "-",
            f"{link['ratio']:.1f}x" if link else "-",
            human(r["payload_full"]) if r["payload_full"] else "-", human(r["payload_stage"]) if r["payload_stage"] else "-",
            str(r["members"]), human(r["sent_per_peer"]), human(r["received_per_peer"]),
        ])
    print(table(["arm", "seed", "k", "val loss", "vs (a)", "refused st/full", "chain view", "B/token fwd+bwd [frames]", "vs fp16", "payload full",
                 "payload stage", "G", "sent/peer", "recv/peer"], lines))
    d = spec.model.d_model
    print(f"\nval loss: θ after the last round, evaluated uncompressed (nats/byte); vs (a): ratio to (a) of the same seed\n"
          f"(lower is better). refused: contributions of chain stages / full replicas the round's checks refused (the\n"
          f"direction check, peer/outer/robust.py), over the run, as the first member saw them.\n"
          f"chain view: the same θ as a chain trains it (projected as at a round start, through the compressed boundary).\n"
          f"B/token: bytes per token between the stages, codec formulas: forward k·2 + 1 (fp16 values + a 1-byte token\n"
          f"id), backward k·2; in brackets the real frames (msgpack header + 4-byte length) of one micro-batch per token.\n"
          f"vs fp16: the plain fp16 hidden state both ways, 2·d·2 = {2 * 2 * d} B/token, over the fwd+bwd formula bytes.\n"
          f"payload: one member's encoded SparseLoCo payload per round (a full replica / one chain stage). G: members of\n"
          f"the exchange (a chain's stages are 2). sent/recv per peer: whole run, all-gather model as bench/compression.py\n"
          f"((G-1)·own payload sent, the others' payloads received, every round), mean over members.")


def _gap(rows, key: str, field: str = "loss_vs_a") -> Optional[str]:
    """Mean ± spread (std over seeds; 0 for one seed) of an arm's ratio, as a percentage."""
    xs = [100 * (r[field] - 1) for r in rows if r["key"] == key and field in r]
    if not xs:
        return None
    return f"{statistics.mean(xs):+.2f} ± {statistics.pstdev(xs) if len(xs) < 2 else statistics.stdev(xs):.2f} %"


def goals(rows) -> List[str]:
    by = {r["key"]: r for r in rows}  # the last seed's row (the link bytes do not depend on the seed)
    out = []
    c, dd = by.get("c"), by.get("d")
    if c is not None:
        ok = c["link"]["ratio"] >= 8
        out.append(f"bytes/token between stages at the default rank k={c['k']}: {c['link']['ratio']:.1f}x fewer than fp16 "
                   f"(goal >= 8x): {'met' if ok else 'MISSED'}")
    if _gap(rows, "c") is not None:
        mean = statistics.mean(r["loss_vs_a"] for r in rows if r["key"] == "c")
        out.append(f"(c) vs (a): {_gap(rows, 'c')} over {sum(1 for r in rows if r['key'] == 'c')} seed(s) "
                   f"(goal within 3 %): {'met' if mean <= 1.03 else 'MISSED'}")
    if c is not None and dd is not None:
        pairs = {r["seed"]: r["val_loss"] for r in rows if r["key"] == "c"}
        for r in rows:
            if r["key"] == "d" and r["seed"] in pairs:
                r["d_vs_c"] = r["val_loss"] / pairs[r["seed"]]
        better = all(r.get("d_vs_c", 0) > 1 for r in rows if r["key"] == "d")
        out.append(f"(d) vs (c): {_gap(rows, 'd', 'd_vs_c')}: selective {'better' if better else 'NOT better'} than uniform "
                   f"in every seed: {'met' if better else 'MISSED'}")
    for key, other in (("c4", "d4"),):
        if key in by:
            s = f"extra: selective at k=d/4={by[key]['k']}: {_gap(rows, key)} vs (a), {by[key]['link']['ratio']:.1f}x fewer bytes/token"
            if other in by:
                s += f"; uniform at k=d/4: {_gap(rows, other)} vs (a)"
            out.append(s)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, few rounds, no extra arms (a smoke run)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--only", help="comma-separated arm keys: a,b,c,d,c4,d4")
    ap.add_argument("--jobs", type=int, default=1, help="arms run in parallel processes")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--seeds", type=int, default=1, help="seeds per arm (0, 1, ...): losses as mean ± spread over them")
    ap.add_argument("--warm-rounds", type=int, default=0,
                    help="every arm starts from θ after this many rounds of 4 full replicas (not counted): a chain "
                         "that joins a run under way, its stages without standing beside replicas that trained it")
    args = ap.parse_args(argv)
    if args.seeds < 1 or args.warm_rounds < 0:
        ap.error(f"--seeds must be at least 1 and --warm-rounds at least 0, got {args.seeds} and {args.warm_rounds}")
    torch.set_num_threads(args.threads)
    name = "quick" if args.quick else "full"
    cfg = dict(CONFIGS[name], warm_rounds=args.warm_rounds)
    arms = ARMS + (EXTRA_ARMS if cfg["extra"] else [])
    if args.only:
        keys = {k.strip() for k in args.only.split(",")}
        arms = [a for a in ARMS + EXTRA_ARMS + OPTIONAL_ARMS if a.key in keys]
    spec = make_spec(cfg)
    ms = spec.model
    t0 = time.monotonic()
    print(f"bench/chains.py ({name}): {now()}, {machine()}, "
          f"{args.jobs} job(s) x {args.threads} thread(s)")
    print(f"model d {ms.d_model}, {ms.n_layers} layers, {ms.n_heads} heads, ffn {ms.ffn_hidden} ({ms.num_params():,} parameters), "
          f"batch {spec.data.batch_size}x{ms.seq_len}, {R} replicas, {cfg['rounds']} rounds of H={cfg['inner_steps']} "
          f"(N={cfg['rounds'] * cfg['inner_steps']} steps per replica), SparseLoCo defaults; chains cut after block "
          f"{ms.n_layers // 2 - 1}, {spec.chain.micro_batches} micro-batches, fp16 on the wire"
          + (f"; from θ after {args.warm_rounds} warm rounds of {R} full replicas" if args.warm_rounds else ""), flush=True)
    rows = run_arms(cfg, arms, args.jobs, args.threads, args.seeds)
    print()
    print_main(rows, spec)
    lines = goals(rows)
    if lines:
        print("\ngoals:\n" + "\n".join(f"  {s}" for s in lines))
    print(f"\ntotal {time.monotonic() - t0:.0f} s")
    if args.json:
        result = dict(config=cfg, name=name, rows=rows, goals=lines, machine=machine(),
                      date=now())
        args.json.write_text(strict_json(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
