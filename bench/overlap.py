"""What the one-step-delayed outer update (overlap) costs in loss, at equal tokens.

    python bench/overlap.py [--quick | --shape demo] [--strategies S,S] [--delays 0,0.25,0.5,1]
                            [--outer-lrs L,L] [--seeds N] [--jobs N] [--threads N] [--json OUT]

With overlap (the default, ``outer.overlap``) a live peer trains the next round's first steps
while its exchange is in flight, then continues from θ + (the steps taken meanwhile)
(peer/round/loop.py). How many steps that is depends on how long the exchange takes: a delay of
0.25 means the exchange ended after a quarter of the next round. ``peer.round.simulate.simulate`` with
``overlap_steps`` runs exactly that (R = 4 replicas of the real round engine, real payloads); a
delay of 0 is the sequential loop. Arms of one seed differ only in the delay, so the cost is given
paired, seed by seed: (loss with the delay / loss at 0) - 1, mean ± spread. ``--outer-lrs`` runs
every arm at each outer learning rate too, and pairs each with the first delay at the first lr as
well ("vs base"): a smaller outer step may cost less with overlap than the default one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import machine, now, run_jobs, spread, table  # noqa: E402
from bench.compression import CONFIGS as COMPRESSION_CONFIGS, make_spec  # noqa: E402
from peer.training.data import load_corpus  # noqa: E402
from peer.round.simulate import simulate  # noqa: E402
from protocol.spec import ModelSpec  # noqa: E402
from swarm.jsonout import dumps as strict_json  # noqa: E402

R = 4
CONFIGS = {
    "small": dict(model=dict(d_model=64, n_layers=2, n_heads=4, ffn_hidden=176, seq_len=32),
                 batch_size=8, inner_steps=20, steps=300, lr=3e-3, warmup=20),
    "quick": dict(model=dict(d_model=32, n_layers=1, n_heads=2, ffn_hidden=64, seq_len=16),
                  batch_size=4, inner_steps=8, steps=24, lr=3e-3, warmup=4),
    # the demo model's shape (0.87M parameters) on 64-byte sequences, 15 rounds of H = 30
    "demo": COMPRESSION_CONFIGS["full"],
}


def run_arm(job) -> Dict[str, Any]:
    cfg, strategy, delay, seed, threads, lr = job
    torch.set_num_threads(threads)
    spec = make_spec(cfg, {"strategy": strategy, "lr": lr}, {}, cfg["steps"], seed)
    H = spec.outer.inner_steps
    steps = round(delay * H)
    t = time.monotonic()
    res = simulate(spec, R, max(1, cfg["steps"] // H), corpus=load_corpus("stdlib"), eval_every=0, overlap_steps=steps)
    # lr_arg: the --outer-lrs value the arm ran (None: the strategy's own), which the summary pairs by
    row = dict(strategy=strategy, delay=delay, overlap_steps=steps, seed=seed, lr_arg=lr, outer_lr=spec.outer.effective_lr,
               val_loss=res.final_val_loss, tokens=res.tokens, wall_s=time.monotonic() - t)
    print(f"  {strategy} outer lr {row['outer_lr']:g} delay {delay:g} ({steps} steps) seed {seed}: val {row['val_loss']:.4f}",
          flush=True)
    return row


def summarize(rows: List[Dict[str, Any]], strategies: List[str], delays: List[float], seeds: List[int],
              lrs: List[Optional[float]]):
    """Per (strategy, outer lr, delay): the losses, and two paired costs, seed by seed: against the
    first delay at the same lr ("cost") and against the first delay at the first lr ("vs_base")."""
    by = {(r["strategy"], r["lr_arg"], r["delay"], r["seed"]): r for r in rows}
    out = []
    for s in strategies:
        for lr in lrs:
            for d in delays:
                losses = [by[(s, lr, d, k)]["val_loss"] for k in seeds]
                rel = [by[(s, lr, d, k)]["val_loss"] / by[(s, lr, delays[0], k)]["val_loss"] - 1 for k in seeds]
                base = [by[(s, lr, d, k)]["val_loss"] / by[(s, lrs[0], delays[0], k)]["val_loss"] - 1 for k in seeds]
                out.append(dict(strategy=s, outer_lr=by[(s, lr, d, seeds[0])]["outer_lr"], base_lr=lr == lrs[0], delay=d,
                                losses=losses, mean=statistics.fmean(losses), std=spread(losses),
                                cost=statistics.fmean(rel), cost_std=spread(rel), cost_range=(min(rel), max(rel)),
                                vs_base=statistics.fmean(base), vs_base_std=spread(base)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a tiny model and 3 rounds of H = 8: a smoke test")
    ap.add_argument("--shape", choices=["small", "demo"], default="small",
                    help="small: 133,440 parameters, 15 rounds of H = 20 (default); demo: the demo model's shape "
                         "(0.87M parameters, 64-byte sequences), 15 rounds of H = 30")
    ap.add_argument("--strategies", default="sparseloco,diloco", help="comma-separated outer strategies (default: sparseloco,diloco)")
    ap.add_argument("--delays", default="0,0.25,0.5,1",
                    help="comma-separated delays, as fractions of H, the first being the baseline (default: 0,0.25,0.5,1)")
    ap.add_argument("--outer-lrs", default="",
                    help="comma-separated outer learning rates, each a set of arms, the first being the base "
                         "(default: the strategy's own, e.g. sparseloco 1.0, diloco 0.7)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 of every arm (default: 3)")
    ap.add_argument("--jobs", type=int, default=1, help="arms run in parallel processes (default: 1)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (default: 1)")
    ap.add_argument("--json", type=Path, metavar="OUT", help="also write every arm and the summary as JSON to OUT")
    args = ap.parse_args(argv)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    try:
        delays = [float(d) for d in args.delays.split(",") if d.strip()]
    except ValueError:
        ap.error(f"--delays must be comma-separated numbers, got {args.delays!r}")
    if len(set(delays)) != len(delays):
        ap.error(f"--delays must be distinct, got {args.delays!r}")
    seeds = list(range(args.seeds))
    if not strategies or not delays or not seeds or any(not 0 <= d <= 1 for d in delays):
        ap.error("--strategies, --delays (each in [0, 1]) and --seeds must name at least one of each")
    try:
        lrs: List[Optional[float]] = [float(x) for x in args.outer_lrs.split(",") if x.strip()] or [None]
    except ValueError:
        ap.error(f"--outer-lrs must be comma-separated numbers, got {args.outer_lrs!r}")
    if any(lr is not None and not 0 < lr <= 1e3 for lr in lrs) or len(set(lrs)) != len(lrs):
        ap.error(f"--outer-lrs must be distinct numbers in (0, 1000], got {args.outer_lrs!r}")
    if args.quick and args.shape != "small":
        ap.error("--quick and --shape are exclusive")
    name = "quick" if args.quick else args.shape
    cfg = CONFIGS[name]
    print(f"bench/overlap.py ({name}): {now()}, {machine()}\nmodel {ModelSpec(**cfg['model']).num_params():,} parameters, "
          f"{R} replicas, {cfg['steps']} inner steps each, H={cfg['inner_steps']}, seeds {seeds}", flush=True)
    t0 = time.monotonic()
    jobs = [(cfg, s, d, k, args.threads, lr) for k in seeds for s in strategies for lr in lrs for d in delays]
    rows = run_jobs(run_arm, jobs, args.jobs)
    summary = summarize(rows, strategies, delays, seeds, lrs)
    several = len(lrs) > 1  # the "vs base" column only says something new with several lrs
    lines = [[s["strategy"], f"{s['outer_lr']:g}", f"{s['delay']:g} H", f"{s['mean']:.4f} ± {s['std']:.4f}",
              "-" if s["delay"] == delays[0] else
              f"{100 * s['cost']:+.2f} % ± {100 * s['cost_std']:.2f} [{100 * s['cost_range'][0]:+.2f}, {100 * s['cost_range'][1]:+.2f}]"]
             + (["-" if s["delay"] == delays[0] and s["base_lr"] else f"{100 * s['vs_base']:+.2f} % ± {100 * s['vs_base_std']:.2f}"]
                if several else [])
             for s in summary]
    print()
    print(table(["strategy", "outer lr", "exchange ends after", "val loss (mean ± std)",
                 f"cost vs {delays[0]:g} H, paired (mean ± std [min, max])"]
                + ([f"vs {delays[0]:g} H at the first lr"] if several else []), lines))
    print(f"\ntotal {time.monotonic() - t0:.0f} s")
    if args.json:
        args.json.write_text(strict_json(dict(config=cfg, name=name, date=now(), machine=machine(), rows=rows,
                                             summary=summary), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
