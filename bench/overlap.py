"""What the one-step-delayed outer update (overlap) costs in loss, at equal tokens.

    python bench/overlap.py [--quick] [--strategies S,S] [--delays 0,0.25,0.5,1] [--seeds N]
                            [--jobs N] [--threads N] [--json OUT]

With overlap (the default, ``outer.overlap``) a live peer trains the next round's first steps
while its exchange is in flight, then continues from θ + (the steps taken meanwhile)
(peer/round/loop.py). How many steps that is depends on how long the exchange takes: a delay of
0.25 means the exchange ended after a quarter of the next round. ``peer.round.simulate.simulate`` with
``overlap_steps`` runs exactly that (R = 4 replicas of the real round engine, real payloads); a
delay of 0 is the sequential loop. Arms of one seed differ only in the delay, so the cost is given
paired, seed by seed: (loss with the delay / loss at 0) - 1, mean ± spread.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import machine, now, run_jobs, table  # noqa: E402
from bench.compression import make_spec  # noqa: E402
from peer.training.data import load_corpus  # noqa: E402
from peer.round.simulate import simulate  # noqa: E402
from protocol.spec import ModelSpec  # noqa: E402
from swarm.jsonout import dumps as strict_json  # noqa: E402

R = 4
CONFIGS = {
    "full": dict(model=dict(d_model=64, n_layers=2, n_heads=4, ffn_hidden=176, seq_len=32),
                 batch_size=8, inner_steps=20, steps=300, lr=3e-3, warmup=20),
    "quick": dict(model=dict(d_model=32, n_layers=1, n_heads=2, ffn_hidden=64, seq_len=16),
                  batch_size=4, inner_steps=8, steps=24, lr=3e-3, warmup=4),
}


def run_arm(job) -> Dict[str, Any]:
    cfg, strategy, delay, seed, threads = job
    torch.set_num_threads(threads)
    spec = make_spec(cfg, {"strategy": strategy}, {}, cfg["steps"], seed)
    H = spec.outer.inner_steps
    steps = round(delay * H)
    t = time.monotonic()
    res = simulate(spec, R, max(1, cfg["steps"] // H), corpus=load_corpus("stdlib"), eval_every=0, overlap_steps=steps)
    row = dict(strategy=strategy, delay=delay, overlap_steps=steps, seed=seed, val_loss=res.final_val_loss,
               tokens=res.tokens, wall_s=time.monotonic() - t)
    print(f"  {strategy} delay {delay:g} ({steps} steps) seed {seed}: val {row['val_loss']:.4f}", flush=True)
    return row


def summarize(rows: List[Dict[str, Any]], strategies: List[str], delays: List[float], seeds: List[int]):
    by = {(r["strategy"], r["delay"], r["seed"]): r["val_loss"] for r in rows}
    out = []
    for s in strategies:
        for d in delays:
            losses = [by[(s, d, k)] for k in seeds]
            rel = [by[(s, d, k)] / by[(s, delays[0], k)] - 1 for k in seeds]
            out.append(dict(strategy=s, delay=d, losses=losses, mean=statistics.fmean(losses),
                            std=statistics.stdev(losses) if len(losses) > 1 else 0.0,
                            cost=statistics.fmean(rel), cost_std=statistics.stdev(rel) if len(rel) > 1 else 0.0,
                            cost_range=(min(rel), max(rel))))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a tiny model and 3 rounds of H = 8: a smoke test")
    ap.add_argument("--strategies", default="sparseloco,diloco", help="comma-separated outer strategies (default: sparseloco,diloco)")
    ap.add_argument("--delays", default="0,0.25,0.5,1",
                    help="comma-separated delays, as fractions of H, the first being the baseline (default: 0,0.25,0.5,1)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 of every arm (default: 3)")
    ap.add_argument("--jobs", type=int, default=1, help="arms run in parallel processes (default: 1)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (default: 1)")
    ap.add_argument("--json", type=Path, metavar="OUT", help="also write every arm and the summary as JSON to OUT")
    args = ap.parse_args(argv)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    delays = [float(d) for d in args.delays.split(",") if d.strip()]
    seeds = list(range(args.seeds))
    if not strategies or not delays or not seeds or any(not 0 <= d <= 1 for d in delays):
        ap.error("--strategies, --delays (each in [0, 1]) and --seeds must name at least one of each")
    name = "quick" if args.quick else "full"
    cfg = CONFIGS[name]
    print(f"bench/overlap.py ({name}): {now()}, {machine()}\nmodel {ModelSpec(**cfg['model']).num_params():,} parameters, "
          f"{R} replicas, {cfg['steps']} inner steps each, H={cfg['inner_steps']}, seeds {seeds}", flush=True)
    t0 = time.monotonic()
    rows = run_jobs(run_arm, [(cfg, s, d, k, args.threads) for k in seeds for s in strategies for d in delays], args.jobs)
    summary = summarize(rows, strategies, delays, seeds)
    lines = [[s["strategy"], f"{s['delay']:g} H", f"{s['mean']:.4f} ± {s['std']:.4f}",
              "-" if s["delay"] == delays[0] else
              f"{100 * s['cost']:+.2f} % ± {100 * s['cost_std']:.2f} [{100 * s['cost_range'][0]:+.2f}, {100 * s['cost_range'][1]:+.2f}]"]
             for s in summary]
    print()
    print(table(["strategy", "exchange ends after", "val loss (mean ± std)", f"cost vs {delays[0]:g} H, paired (mean ± std [min, max])"],
                lines))
    print(f"\ntotal {time.monotonic() - t0:.0f} s")
    if args.json:
        args.json.write_text(strict_json(dict(config=cfg, name=name, date=now(), machine=machine(), rows=rows,
                                             summary=summary), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
