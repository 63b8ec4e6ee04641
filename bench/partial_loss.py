"""Partial parameter updates at equal tokens and at equal bytes, several owners per slice, over seeds.

    python bench/partial_loss.py [--quick] [--replicas 8] [--slices 4] [--arms full,partial,...]
                                 [--strategy sparseloco|diloco] [--topk 64] [--aggregate chosen] [--slice-step 1.0]
                                 [--rounds 12] [--points 1]
                                 [--seeds 3] [--jobs 2] [--threads 1] [--json OUT]

bench/partial.py measures what a partial peer saves (memory, FLOPs, bytes); this one measures what
it costs in loss, as arXiv 2509.22418 compares them: against full peers at equal tokens and at equal
bytes sent. Every arm is ``peer.round.simulate.simulate``: R replicas of the live peer's roles and
round engine (SparseLoCo defaults), replica r owning slice r % S, so with R >= 2S every slice has
R / S owners. Arms, per seed:

- ``full``: R full replicas (top-k 64 of every 64 x 64 chunk, the default; ``--topk`` sets another
  for every arm, the equal-bytes ones included);
- ``partial S``: R slice owners, the same tokens;
- ``full, equal bytes``: R full replicas whose top-k is the largest that keeps a payload no larger
  than a slice owner's (found by encoding one payload of each part), the same tokens: what the
  partial peers' byte budget buys a full peer;
- ``partial, equal bytes``: R slice owners that synchronise more often, H x (slice owner's payload /
  full payload) inner steps a round (the nearest divisor of the run's inner steps), as many more
  rounds, the same tokens: what the full
  peers' byte budget buys the partial ones (the paper's comparison);
- ``partial, equal bytes by top-k`` (not run by default): R slice owners at the config's H whose top-k
  is the largest that keeps a payload no larger than a full one at ``--topk``, the same tokens: the
  full peers' byte budget spent on denser payloads instead of more rounds;
- ``partial, equal FLOPs`` (not run by default): R slice owners that train as many more rounds as
  their cheaper steps pay for (a full step's FLOPs over a slice owner's, counted by FlopCounterMode,
  rounded down), each arm's schedule to its own end: what the full peers' compute buys the partial ones.

Levers tried on every arm alike: ``--aggregate mean`` (SparseLoCo's mean over every payload of a
part instead of over the payloads that kept a coordinate), ``--slice-step F`` (the outer step of
sliced tensors times F); ``--rounds N`` and ``--points P`` run longer and give the paired gap at P
evenly spaced points of the run (guarded by tests/bench/test_bench_partial_loss.py).

Every arm starts from the same function (the unsliced model of the seed, its MLP cut into slices
where the arm has them: bench/partial.py's ``reslice``), trains the same shards in the same order
(the run seed) for the same rounds. The gaps are paired by seed: (arm / full) − 1, mean ± std.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import add_arm_flags, choose_names, human, machine, now, run_summarized, spread, table  # noqa: E402
from bench.partial import full_init, model_dict, reslice  # noqa: E402
from bench.partial_probes import freeze, fresh_model, make_spec, part_of, step_flops  # noqa: E402

CONFIGS = {
    # bench/partial.py's simulation: d 256, 4 layers, ffn 1024 (MLP = 75 % of block parameters),
    # H = 10, 12 rounds (120 inner steps of 4 x 128 bytes per replica), AdamW 3e-3 cosine
    "full": dict(sim_model="bench d256 L4 f1024", batch_size=4, inner_steps=10, rounds=12, lr=3e-3, warmup=10,
                 val_batches=16),
    "quick": dict(sim_model="quick d64 L2 f256", batch_size=4, inner_steps=5, rounds=3, lr=3e-3, warmup=5,
                  val_batches=4),
}
DEFAULT_TOPK = 64
ARMS = ("full", "partial", "full-bytes", "partial-bytes", "partial-flops", "partial-topk")
DEFAULT_ARMS = ARMS[:4]


def arm_spec(cfg: Dict[str, Any], slices: int, seed: int, topk: int = DEFAULT_TOPK, inner_steps: int = 0,
             aggregate: str = "chosen"):
    """The spec of an arm; ``inner_steps``: its H (0: the config's), the inner steps of the run unchanged;
    ``aggregate``: SparseLoCo's (each coordinate averaged over the payloads that kept it, or over all);
    ``cfg["strategy"]``: the outer strategy of every arm (SparseLoCo unless given); ``cfg["balance_steps"]``:
    the spec's ``partial.balance_steps`` (the default, on, unless given)."""
    H = inner_steps or cfg["inner_steps"]
    spec = make_spec(model_dict(cfg["sim_model"]), slices, cfg["batch_size"], H, cfg["lr"], cfg["warmup"],
                     cfg["rounds"] * cfg["inner_steps"], cfg["val_batches"])
    return spec.replace(seed=seed, outer={"strategy": cfg.get("strategy", "sparseloco"),
                                          "sparseloco": {"topk": topk, "aggregate": aggregate}},
                        partial={"balance_steps": cfg.get("balance_steps", True)})


def payload_bytes(spec, part) -> int:
    """The bytes of one encoded payload of ``part`` (SparseLoCo's size depends on top-k, not on values)."""
    from peer.outer.strategies import make_strategy

    strategy = make_strategy(spec, part=part)
    gen = torch.Generator().manual_seed(0)
    data, _ = strategy.encode({n: torch.randn(s, generator=gen) for n, s in strategy.layout.items()}, 0)
    return len(data)


def largest_topk(cfg: Dict[str, Any], slices: int, budget: int, high: int) -> int:
    """The largest top-k (at most ``high``) whose payload of part 0 of ``slices`` is no larger than
    ``budget`` bytes; 0 where the strategy keeps no top-k (diloco: dense)."""
    if cfg.get("strategy", "sparseloco") != "sparseloco":
        return 0
    low = 1  # a payload grows with top-k: bisect for the largest that fits
    while low < high:
        mid = (low + high + 1) // 2
        if payload_bytes(arm_spec(cfg, slices, 0, mid), part_of(slices, 0)) <= budget:
            low = mid
        else:
            high = mid - 1
    return low


def equal_bytes(cfg: Dict[str, Any], slices: int, base: int = DEFAULT_TOPK) -> Tuple[int, int]:
    """(the largest top-k whose full payload is no larger than a slice owner's payload at top-k ``base``,
    0 where the strategy keeps no top-k (diloco: dense); the H at which slice owners send about a full
    peer's bytes over the run)."""
    budget = payload_bytes(arm_spec(cfg, slices, 0, base), part_of(slices, 0))
    full = payload_bytes(arm_spec(cfg, 1, 0, base), part_of(1))
    low = largest_topk(cfg, 1, budget, base)
    total, target = cfg["rounds"] * cfg["inner_steps"], cfg["inner_steps"] * budget / full
    segment = total // cfg.get("points", 1)  # --points: θ is evaluated every `segment` steps in every arm
    h = min((d for d in range(1, cfg["inner_steps"] + 1) if segment % d == 0), key=lambda d: (abs(d - target), d))
    return low, h  # an H that divides the run's inner steps (and each segment of them): equal tokens


def flops_ratio(cfg: Dict[str, Any], slices: int) -> float:
    """A full replica's FLOPs a step (forward + backward, bench/partial_probes.py ``step_flops``) over a
    slice owner's, at the config's model and batch: a frozen slice skips its weight gradients."""
    from protocol.model.partial import owned_shapes

    flops = []
    for s in (1, slices):
        spec = arm_spec(cfg, s, 0)
        model = fresh_model(spec.model, s)
        freeze(model, owned_shapes(spec, part_of(s, 0)))
        x = torch.randint(0, spec.model.vocab_size, (cfg["batch_size"], spec.model.seq_len),
                          generator=torch.Generator().manual_seed(1))
        flops.append(step_flops(model, x))
    return flops[0] / flops[1]


def scale_slice_steps(strategy, factor: float) -> None:
    """The outer lr of sliced tensors times ``factor`` for this strategy (a lever for slice owners,
    measured here before any spec field exists; shared tensors and full arms are unchanged:
    ``test_the_slice_step_scales_only_sliced_tensors``)."""
    from protocol.model.partial import FULL, slice_of

    apply = strategy.apply
    strategy.apply = lambda theta, update, scales=None: apply(
        theta, {n: u * factor if slice_of(n) != FULL else u for n, u in update.items()}, scales)


def run_arm(job) -> Dict[str, Any]:
    """One simulation: (cfg, arm name, slices, top-k, H (0: the config's), replicas, seed, threads, aggregate,
    slice step: the outer step on sliced tensors scaled by it, on every replica alike)."""
    from peer.round.simulate import simulate
    from peer.training.data import load_corpus

    cfg, arm, slices, topk, H, replicas, seed, threads, aggregate, slice_step = job
    torch.set_num_threads(threads)
    logging.getLogger("voloco.peer.robust").setLevel(logging.ERROR)  # every replica logs every refusal: counted below
    spec = arm_spec(cfg, slices, seed, topk, H, aggregate)
    rounds = cfg["rounds"] * cfg["inner_steps"] // spec.outer.inner_steps
    t = time.monotonic()
    points = cfg.get("points", 1)  # θ evaluated at this many evenly spaced points: the same tokens in every arm
    sim = simulate(spec, replicas, rounds, corpus=load_corpus("stdlib"), eval_every=0, verify_rounds=1,
                   eval_rounds=[rounds * i // points for i in range(1, points)],
                   init_theta=reslice(full_init(model_dict(cfg["sim_model"]), seed), spec.param_shapes()),
                   parts=[part_of(slices, i) for i in range(replicas)],
                   on_replica=None if slice_step == 1.0 else lambda i, role: scale_slice_steps(role.strategy, slice_step))
    sent = sum((replicas - 1) * b for h in sim.history for b in h.payload_bytes) / replicas
    row = dict(arm=arm, slices=slices, topk=topk if spec.outer.strategy == "sparseloco" else 0,
               inner_steps=spec.outer.inner_steps, rounds=rounds, replicas=replicas, seed=seed, tokens=sim.tokens,
               val_loss=sim.final_val_loss, initial_val_loss=sim.initial_val_loss, sent_per_peer=sent,
               refused=sum(len(h.excluded) for h in sim.history), wall_s=time.monotonic() - t,
               left_out=sum(len(names) for h in sim.history for names in h.dropped.values()),
               curve=[[h.tokens, h.val_loss] for h in sim.history if h.val_loss is not None])
    print(f"  R={replicas} {arm:18s} seed {seed}: val {row['val_loss']:.4f}, sent/peer {human(sent)}, "
          f"{row['wall_s']:.0f} s", flush=True)
    return row


def summarize(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per (R, arm): loss over seeds, its gap to the full arm of the same R and seed, and bytes."""
    full = {(r["replicas"], r["seed"]): r for r in rows if r["arm"] == "full"}
    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["replicas"], r["arm"]), []).append(r)
    out = []
    for (replicas, arm), rs in groups.items():
        gaps = [r["val_loss"] / full[(replicas, r["seed"])]["val_loss"] - 1 for r in rs
                if arm != "full" and (replicas, r["seed"]) in full]
        sent = [r["sent_per_peer"] / full[(replicas, r["seed"])]["sent_per_peer"] - 1 for r in rs
                if (replicas, r["seed"]) in full]
        out.append(dict(replicas=replicas, arm=arm, slices=rs[0]["slices"], topk=rs[0]["topk"],
                        inner_steps=rs[0]["inner_steps"], seeds=len(rs),
                        tokens=rs[0]["tokens"], loss=statistics.fmean(r["val_loss"] for r in rs),
                        loss_std=spread([r["val_loss"] for r in rs]),
                        gap=statistics.fmean(gaps) if gaps else None,
                        gap_std=spread(gaps),
                        sent=statistics.fmean(r["sent_per_peer"] for r in rs),
                        sent_vs_full=statistics.fmean(sent) if sent else None,
                        refused=sum(r["refused"] for r in rs), left_out=sum(r.get("left_out", 0) for r in rs),
                        curve=curve_gaps(rs, full)))
    return out


def curve_gaps(rs: List[Dict[str, Any]], full: Dict[tuple, Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per evaluation point (tokens): the arm's loss over seeds and its gap to the full arm's loss of
    the same R, seed and tokens."""
    out = []
    for i, (tokens, _) in enumerate(rs[0]["curve"]):
        losses = [r["curve"][i][1] for r in rs]
        gaps = [r["curve"][i][1] / f["curve"][i][1] - 1 for r in rs
                for f in [full.get((r["replicas"], r["seed"]))] if f is not None and f["curve"][i][0] == tokens]
        out.append(dict(tokens=tokens, loss=statistics.fmean(losses),
                        gap=statistics.fmean(gaps) if gaps and rs[0]["arm"] != "full" else None,
                        gap_std=spread(gaps)))
    return out


def print_summary(summary: List[Dict[str, Any]]) -> None:
    lines = []
    for s in summary:
        gap = "-" if s["gap"] is None else f"{100 * s['gap']:+.2f} % ± {100 * s['gap_std']:.2f}"
        sent = "-" if not s["sent_vs_full"] else f"{100 * s['sent_vs_full']:+.1f} %"
        lines.append([str(s["replicas"]), s["arm"], str(s["topk"] or "dense"), str(s["inner_steps"]), str(s["seeds"]),
                      f"{s['tokens']:,}",
                      f"{s['loss']:.4f} ± {s['loss_std']:.4f}", gap, human(s["sent"]), sent, str(s["refused"]),
                      str(s.get("left_out", 0))])
    print(table(["R", "arm", "top-k", "H", "seeds", "tokens", "val loss", "vs full (paired)", "sent/peer", "vs full",
                 "refused", "tensors left out"], lines, left=2))
    if len(summary[0]["curve"]) > 1:  # --points: the gap along the run
        print("\nval loss along the run (tokens a replica trained; paired gap to full at the same tokens):")
        lines = [[str(s["replicas"]), s["arm"], f"{c['tokens'] // s['replicas']:,}", f"{c['loss']:.4f}",
                  "-" if c["gap"] is None else f"{100 * c['gap']:+.2f} % ± {100 * c['gap_std']:.2f}"]
                 for s in summary for c in s["curve"]]
        print(table(["R", "arm", "tokens/replica", "val loss", "vs full (paired)"], lines, left=2))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small model, 3 rounds of H = 5: a smoke run (~1 min)")
    ap.add_argument("--replicas", default="8", help="comma-separated replica counts R, each >= 2 S (default 8)")
    ap.add_argument("--slices", type=int, default=4, help="S: slices of the partial arm (default 4)")
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                    help=f"comma-separated arms of {', '.join(ARMS)} (default: {','.join(DEFAULT_ARMS)})")
    ap.add_argument("--topk", type=int, default=DEFAULT_TOPK,
                    help=f"SparseLoCo's top-k of every 64 x 64 chunk for every arm; the full equal-bytes arm's is "
                         f"found from it (default {DEFAULT_TOPK}, the spec's)")
    ap.add_argument("--strategy", choices=("sparseloco", "diloco"), default="sparseloco",
                    help="the outer strategy of every arm: sparseloco (the spec's default: top-k values, error "
                         "feedback) or diloco (dense pseudo-gradients and Nesterov outer momentum, the baseline the "
                         "paper compares against; --topk, --aggregate and the full-bytes arm do not apply)")
    ap.add_argument("--aggregate", choices=("chosen", "mean"), default="chosen",
                    help="SparseLoCo's aggregate for every arm: each coordinate averaged over the payloads that kept it "
                         "(chosen, the spec's default) or over all payloads of its part (mean)")
    ap.add_argument("--balance-steps", choices=("on", "off"), default="on",
                    help="the spec's partial.balance_steps for every arm: slices carried by fewer contributions "
                    "than the most-carried tensor take a √(most / theirs) larger outer step (on, the default), "
                    "or the same step as every tensor (off: before 2026-12-05)")
    ap.add_argument("--slice-step", type=float, default=1.0,
                    help="scale the outer step of sliced tensors by this, on top of --balance-steps (the partial arms' "
                         "outer lr for their slices; default 1.0: the spec's rule alone)")
    ap.add_argument("--rounds", type=int, default=0,
                    help="rounds of H inner steps of the run (default 0: the config's, 12; 3 with --quick); the "
                         "equal-bytes arm runs as many tokens in more, shorter rounds")
    ap.add_argument("--points", type=int, default=1,
                    help="evaluate θ at this many evenly spaced points of the run and print the gap at each "
                         "(default 1: at the end only)")
    add_arm_flags(ap)
    args = ap.parse_args(argv)
    cfg = dict(CONFIGS["quick" if args.quick else "full"], points=args.points, strategy=args.strategy,
               balance_steps=args.balance_steps == "on")
    if args.rounds < 0 or not 1 <= args.points <= 64:
        raise SystemExit("--rounds must be >= 0 and --points between 1 and 64")
    if args.rounds:
        cfg["rounds"] = args.rounds
    if cfg["rounds"] % args.points:
        raise SystemExit(f"--points must divide the run's {cfg['rounds']} rounds (equal tokens at every point)")
    replicas = [int(x) for x in args.replicas.split(",")]
    if args.slices < 2 or any(r < 2 * args.slices for r in replicas) or args.seeds < 1:
        raise SystemExit("--slices must be >= 2, every --replicas >= 2 x --slices (several owners a slice), --seeds >= 1")
    if not 0.0 < args.slice_step <= 8.0:
        raise SystemExit("--slice-step must be in (0, 8]")
    if not 2 <= args.topk <= 64 * 64:
        raise SystemExit("--topk must be between 2 and 4096 (entries kept of a 64 x 64 chunk)")
    chosen = choose_names(args.arms, ARMS, "--arms")
    topk_arms = [a for a in ("full-bytes", "partial-topk") if a in chosen]  # arms that set SparseLoCo's top-k
    if args.strategy != "sparseloco" and topk_arms:
        raise SystemExit(f"the {' and '.join(topk_arms)} arms set SparseLoCo's top-k; {args.strategy} has none: "
                         "leave them out of --arms")
    base = args.topk
    topk, h_partial = equal_bytes(cfg, args.slices, base)
    partial_topk = 0
    if "partial-topk" in chosen:  # slice owners' top-k that fills a full payload's bytes at the same H
        partial_topk = largest_topk(cfg, args.slices, payload_bytes(arm_spec(cfg, 1, 0, base), part_of(1)), 64 * 64)
    print(f"# partial updates at equal tokens and equal bytes, {now()}, {machine()}")
    print(f"# model {cfg['sim_model']}, batch {cfg['batch_size']}, H = {cfg['inner_steps']}, {cfg['rounds']} rounds; "
          f"S = {args.slices}; {args.strategy}; top-k {base} of 4096, {args.aggregate} aggregate, slice step "
          f"x{args.slice_step:g}, balanced steps {args.balance_steps}; "
          f"equal bytes: full top-k {topk}, partial H = {h_partial}"
          + (f", partial top-k {partial_topk}" if partial_topk else ""),
          flush=True)
    ratio, flops_cfg = None, cfg
    if "partial-flops" in chosen:  # (counting FLOPs builds and runs both models once: only when asked)
        ratio = flops_ratio(cfg, args.slices)
        # equal FLOPs: slice owners train as many more rounds as their cheaper steps pay for (rounded down:
        # never more compute than a full replica), each arm's learning-rate schedule to its own end
        flops_cfg = dict(cfg, rounds=int(cfg["rounds"] * ratio + 1e-9) // args.points * args.points)
        print(f"# a full replica's step costs {ratio:.3f}x a slice owner's FLOPs: equal FLOPs is {flops_cfg['rounds']} "
              f"rounds of the slice owners against {cfg['rounds']}", flush=True)
    arms = {"full": ("full", 1, base, 0),
            "partial": (f"partial S={args.slices}", args.slices, base, 0),
            "full-bytes": ("full, equal bytes", 1, topk, 0),
            "partial-bytes": (f"partial S={args.slices}, equal bytes", args.slices, base, h_partial),
            "partial-flops": (f"partial S={args.slices}, equal FLOPs", args.slices, base, 0),
            "partial-topk": (f"partial S={args.slices}, bytes by top-k", args.slices, partial_topk, 0)}
    work = [(flops_cfg if a == "partial-flops" else cfg, *arms[a], r, seed, args.threads, args.aggregate, args.slice_step)
            for r in replicas for seed in range(args.seeds) for a in chosen]
    run_summarized(run_arm, work, args.jobs, summarize, print_summary, args.json, config=cfg, slices=args.slices,
                   strategy=args.strategy, flops_ratio=ratio, flops_rounds=flops_cfg["rounds"] if ratio else None,
                   topk=base, aggregate=args.aggregate, slice_step=args.slice_step, balance_steps=args.balance_steps,
                   equal_bytes_topk=topk,
                   equal_bytes_h=h_partial, partial_topk=partial_topk or None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
