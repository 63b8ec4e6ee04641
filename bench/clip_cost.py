"""What median-norm clipping costs honest runs: validation loss at equal tokens, with and without it.

    python bench/clip_cost.py [--quick] [--strategies S,S] [--multiples off,1,2] [--seeds N]
                              [--warm-start STEPS] [--jobs N] [--threads N] [--json OUT]

Every arm is ``bench/compression.py``'s ``run_arm`` (``peer.round.simulate.simulate``: R = 4
replicas of the real round loop, real payloads, every replica's round engine checks, clips,
aggregates and applies): one per strategy, clipping multiple and seed. "off" turns clipping off (the
median rule of peer/outer/robust.py is skipped; the finite checks stay), a number m scales a
contribution's tensor whose norm is over m times the round's median norm of that tensor down to
min(1, m) times that median. A seed changes the model's initialization and the data order; arms of
one seed differ only in the clipping, so the cost is also given paired, seed by seed: (loss with
clipping / loss without) - 1, mean and spread.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine, now, spread, table  # noqa: E402
from bench.compression import run_arms, warm_start  # noqa: E402
from protocol.spec import ModelSpec  # noqa: E402
from swarm.jsonout import dumps as strict_json  # noqa: E402  (NaN -> null: strict JSON)

CONFIGS = {
    # the compression bench's quick model, 15 rounds of H = 20: a few minutes for every arm of 3 seeds
    "full": dict(model=dict(d_model=64, n_layers=2, n_heads=4, ffn_hidden=176, seq_len=32),
                 batch_size=8, inner_steps=20, steps=300, lr=3e-3, warmup=20),
    "quick": dict(model=dict(d_model=64, n_layers=2, n_heads=4, ffn_hidden=176, seq_len=32),
                  batch_size=8, inner_steps=10, steps=30, lr=3e-3, warmup=5),
}


def parse_multiple(text: str) -> Optional[float]:
    return None if text == "off" else float(text)


def label(strategy: str, multiple: Optional[float], seed: int) -> str:
    return f"{strategy} clip {'off' if multiple is None else f'{multiple:g}x'} seed {seed}"


def summarize(rows: List[Dict[str, Any]], strategies: List[str], multiples: List[Optional[float]],
              seeds: List[int]) -> List[Dict[str, Any]]:
    """Per strategy and multiple: the loss over seeds, and the paired relative cost against "off"."""
    by = {(r["strategy"], r.get("clip"), r.get("seed")): r["val_loss"] for r in rows}
    out = []
    for strategy in strategies:
        for m in multiples:
            losses = [by[(strategy, m, s)] for s in seeds]
            rel = [by[(strategy, m, s)] / by[(strategy, None, s)] - 1 for s in seeds] if None in multiples else []
            out.append(dict(
                strategy=strategy, clip=m, losses=losses, mean=statistics.fmean(losses),
                std=spread(losses),
                cost=statistics.fmean(rel) if rel else None,
                cost_std=spread(rel),
                cost_range=(min(rel), max(rel)) if rel else None,
            ))
    return out


def print_summary(summary: List[Dict[str, Any]]) -> None:
    lines = []
    for s in summary:
        cost = "-" if s["cost"] is None or s["clip"] is None else (
            f"{100 * s['cost']:+.2f} % ± {100 * s['cost_std']:.2f} "
            f"[{100 * s['cost_range'][0]:+.2f}, {100 * s['cost_range'][1]:+.2f}]")
        lines.append([s["strategy"], "off" if s["clip"] is None else f"{s['clip']:g}x median",
                      f"{s['mean']:.4f} ± {s['std']:.4f}", " ".join(f"{v:.4f}" for v in s["losses"]), cost])
    print(table(["strategy", "clipping", "val loss (mean ± std)", "per seed", "cost vs off, paired (mean ± std [min, max])"],
                lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 rounds of H = 10 instead of 15 of H = 20: a smoke test")
    ap.add_argument("--strategies", default="sparseloco,diloco,dct", help="comma-separated outer strategies (default: all three)")
    ap.add_argument("--multiples", default="off,1,2",
                    help="comma-separated clipping multiples of the median norm; 'off' for none (default: off,1,2)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 of every arm (default: 3)")
    ap.add_argument("--warm-start", type=int, default=0, metavar="STEPS",
                    help="start every arm from the parameters of this many single-process steps (default: 0, cold)")
    ap.add_argument("--jobs", type=int, default=1, help="arms run in parallel processes (default: 1)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (default: 1)")
    ap.add_argument("--json", type=Path, metavar="OUT", help="also write every arm and the summary as JSON to OUT")
    args = ap.parse_args(argv)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    multiples = [parse_multiple(m.strip()) for m in args.multiples.split(",") if m.strip()]
    seeds = list(range(args.seeds))
    if not strategies or not multiples or not seeds:
        ap.error("--strategies, --multiples and --seeds must name at least one of each")
    name = "quick" if args.quick else "full"
    cfg = CONFIGS[name]
    ms = ModelSpec(**cfg["model"])
    print(f"bench/clip_cost.py ({name}): {now()}, {machine()}, {args.jobs} job(s) x {args.threads} thread(s)\n"
          f"model {ms.num_params():,} parameters, 4 replicas, {cfg['steps']} inner steps each, H={cfg['inner_steps']}, "
          f"seeds {seeds}", flush=True)
    t0 = time.monotonic()
    init = None
    if args.warm_start:
        cfg = dict(cfg, warm_start=args.warm_start)
        init, _ = warm_start(cfg, args.warm_start)
    arms = [(label(s, m, seed), {"strategy": s, "clip": m, "seed": seed}, {})
            for seed in seeds for s in strategies for m in multiples]
    rows = run_arms(cfg, arms, args.jobs, args.threads, init)
    summary = summarize(rows, strategies, multiples, seeds)
    print()
    print_summary(summary)
    print(f"\ntotal {time.monotonic() - t0:.0f} s")
    if args.json:
        args.json.write_text(strict_json(dict(config=cfg, name=name, date=now(), machine=machine(), rows=rows,
                                             summary=summary), indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
