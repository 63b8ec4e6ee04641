"""SparseLoCo's aggregate as contributors grow: does a run of more honest replicas end no worse?

    python bench/aggregate_scale.py [--quick] [--replicas 2,4,6,8,16] [--aggregates chosen,chosen/0.25,mean]
                                    [--rounds 12] [--seeds 3] [--jobs 2] [--threads 1] [--json OUT]

Every arm is ``peer.round.simulate.simulate``: R honest replicas of the real round loop (each its own
model copy, data shard, AdamW and SparseLoCo error feedback, its own round engine), the trust
bench's small model and rounds (12 rounds of H = 20; ``--rounds`` sets another count, the inner
learning-rate schedule stretched to it), the direction check on. R replicas train R
shards, so more replicas see more tokens: the loss at R should be no higher than at fewer.

An aggregate is ``chosen`` (each coordinate averaged over the payloads that kept it), ``chosen/S``
(the same, divided by no fewer than S of the payloads that carry the tensor:
``outer.sparseloco.min_share`` = S) or ``mean`` (every coordinate divided by every payload). The
chosen average moves a coordinate that one of R replicas kept by that replica's whole value, so its
step grows with the union of the senders' supports; the mean shrinks such a coordinate R-fold.

Per (aggregate, R): the final validation loss, mean ± std over the seeds; its gap against the first
aggregate named at the same R (paired by seed); and against the same aggregate at the smallest R
named (paired by seed: what more replicas did to it). ``--json``: every run (``runs``) and the summary.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import add_arm_flags, machine, now, run_summarized, spread, table  # noqa: E402
from bench.compression import make_spec  # noqa: E402
from bench.trust import CONFIGS  # noqa: E402


def parse_aggregate(name: str) -> Dict[str, Any]:
    """``chosen``, ``mean`` or ``chosen/S`` (0 <= S <= 1) as ``outer.sparseloco`` fields."""
    if name in ("chosen", "mean"):
        return {"aggregate": name, "min_share": 0.0}
    kind, _, share = name.partition("/")
    try:
        value = float(share)
    except ValueError:
        value = -1.0
    if kind != "chosen" or not 0.0 <= value <= 1.0:
        raise ValueError(f"aggregate {name!r}: expected chosen, mean or chosen/S with 0 <= S <= 1")
    return {"aggregate": "chosen", "min_share": value}


def run_arm(job) -> Dict[str, Any]:
    """One simulation: (cfg, aggregate name, R, seed, threads)."""
    from peer.round.simulate import simulate
    from peer.training.data import load_corpus

    cfg, aggregate, replicas, seed, threads = job
    torch.set_num_threads(threads)
    logging.getLogger("voloco.peer.robust").setLevel(logging.ERROR)
    spec = make_spec(cfg, {"strategy": "sparseloco", "min_agreement": 3.0}, {}, cfg["steps"], seed)
    spec = spec.replace(outer={"sparseloco": parse_aggregate(aggregate)})
    t = time.monotonic()
    rounds = max(1, cfg["steps"] // cfg["inner_steps"])
    res = simulate(spec, replicas, rounds, corpus=load_corpus("stdlib"),
                   seed_shards=[f"replica{i}" for i in range(replicas)], eval_every=0)
    refused = sum(len(h.excluded) for h in res.history)
    row = dict(aggregate=aggregate, replicas=replicas, seed=seed, val_loss=res.final_val_loss, rounds=rounds,
               refused=refused, wall_s=time.monotonic() - t)
    print(f"  {aggregate:12s} R={replicas:<3d} seed {seed}: val {row['val_loss']:.4f}, refused {refused}, "
          f"{row['wall_s']:.0f} s", flush=True)
    return row


def summarize(rows: List[Dict[str, Any]], aggregates: List[str], replicas: List[int]) -> List[Dict[str, Any]]:
    loss = {(r["aggregate"], r["replicas"], r["seed"]): r["val_loss"] for r in rows}
    out = []
    for agg in aggregates:
        for n in replicas:
            rs = [r for r in rows if r["aggregate"] == agg and r["replicas"] == n]
            if not rs:
                continue

            def paired(key):
                return [r["val_loss"] / loss[key(r)] - 1 for r in rs if key(r) in loss]

            vs_first = paired(lambda r: (aggregates[0], n, r["seed"])) if agg != aggregates[0] else []
            vs_fewest = paired(lambda r: (agg, replicas[0], r["seed"])) if n != replicas[0] else []
            out.append(dict(aggregate=agg, replicas=n, seeds=len(rs),
                            loss=statistics.fmean(r["val_loss"] for r in rs),
                            loss_std=spread([r["val_loss"] for r in rs]),
                            vs_first=statistics.fmean(vs_first) if vs_first else None, vs_first_std=spread(vs_first),
                            vs_fewest=statistics.fmean(vs_fewest) if vs_fewest else None,
                            vs_fewest_std=spread(vs_fewest),
                            refused=sum(r["refused"] for r in rs), sent=sum(n * r["rounds"] for r in rs)))
    return out


def _gap(mean, std) -> str:
    return "-" if mean is None else f"{100 * mean:+.2f} % ± {100 * std:.2f}"


def print_summary(summary: List[Dict[str, Any]], first: str, fewest: int) -> None:
    lines = [[s["aggregate"], str(s["replicas"]), str(s["seeds"]), f"{s['loss']:.4f} ± {s['loss_std']:.4f}",
              _gap(s["vs_first"], s["vs_first_std"]), _gap(s["vs_fewest"], s["vs_fewest_std"]),
              f"{s['refused']}/{s['sent']}"] for s in summary]
    print(table(["aggregate", "R", "seeds", "val loss", f"vs {first} (paired)", f"vs R = {fewest} (paired)",
                 "refused"], lines, left=1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 rounds of H = 10: a smoke run of every arm")
    ap.add_argument("--replicas", default="2,4,6,8,16",
                    help="comma-separated numbers of honest replicas, the first the one the others are compared "
                         "with (default 2,4,6,8,16)")
    ap.add_argument("--aggregates", default="chosen,chosen/0.25,mean",
                    help="comma-separated aggregates: chosen, mean, or chosen/S (outer.sparseloco.min_share = S); "
                         "the first is the one the others are compared with (default chosen,chosen/0.25,mean)")
    ap.add_argument("--rounds", type=int, help="rounds of H inner steps (default 12; --quick: 4)")
    add_arm_flags(ap)
    args = ap.parse_args(argv)
    cfg = dict(CONFIGS["quick" if args.quick else "full"])
    if args.rounds is not None:
        if args.rounds < 1:
            ap.error("--rounds must be at least 1")
        cfg["steps"] = args.rounds * cfg["inner_steps"]
    try:
        replicas = [int(x) for x in args.replicas.split(",")]
        aggregates = [a for a in args.aggregates.split(",") if a]
        for a in aggregates:
            parse_aggregate(a)
    except ValueError as e:
        ap.error(str(e))
    if not aggregates or any(n < 1 for n in replicas) or args.seeds < 1 or args.jobs < 1:
        ap.error("name at least one aggregate, replicas of at least 1, and --seeds and --jobs of at least 1")
    if len(set(aggregates)) < len(aggregates) or len(set(replicas)) < len(replicas):
        ap.error("name each aggregate and each number of replicas once")
    jobs = [(cfg, a, n, seed, args.threads) for seed in range(args.seeds) for n in replicas for a in aggregates]
    print(f"# bench/aggregate_scale.py, {now()}, {machine()}: {len(jobs)} simulations, {args.jobs} at a time",
          flush=True)
    run_summarized(run_arm, jobs, args.jobs, lambda rows: summarize(rows, aggregates, replicas),
                   lambda summary: print_summary(summary, aggregates[0], replicas[0]), args.json, config=cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
