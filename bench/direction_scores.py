"""The direction check's statistic against its predecessor, on the same contributions: how far
honest, odd-but-honest and hostile updates score from chance.

    python bench/direction_scores.py [--quick] [--attacks negate,noise,garbage] [--kinds slow,other-data,partial]
                                     [--hostile 3:1,3:2,6:2,6:3] [--slice-rounds 4] [--seeds 3] [--jobs 2] [--json OUT]

Each arm is a simulation of bench/trust.py (R honest replicas of the demo-sized model with K
hostile ones, or 4 honest replicas one of which is odd), of bench/partial_loss.py (8 slice owners
of S = 4 slices at top-k 25, its first ``--slice-rounds`` rounds) or of bench/chains.py (arm c: 3
full replicas and a 2-stage chain with compressed links, whose stages are the odd ones). Every
round's decoded contributions are taken where the round engine screens them and scored twice,
with no standing, every contribution judging (as in round 0 of a run), a contribution to θ itself
by those of its kind and a chain stage's by all (peer/outer/robust.py):

- ``per-tensor``: peer/outer/consensus.py's z: each tensor one test, clamped to ±TENSOR_Z,
  combined by Stouffer's rule (the statistic in use);
- ``pooled``: the statistic before it, one z over every coordinate a pair shares,
  Σ A / √Σ O.

A score is the (upper) median of a contribution's z over the others. Unlike the round engine's
screen, every contribution is scored as decoded: none is left out first for a failed check or as a
copy (the simulations' honest replicas send neither). The table gives, per arm,
role and statistic, the lowest, median and highest score over every round and seed, and how many
fall on the wrong side of 3 (the spec's ``outer.min_agreement``): honest ones below it, hostile ones
at or above it. The run's own decisions (standing, evidence pools, kinds) are bench/trust.py's.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import add_arm_flags, machine, now, run_summarized, table  # noqa: E402

MIN_Z = 3.0  # the spec's default outer.min_agreement
STATISTICS = ("per-tensor", "pooled")


def pooled_scores(pairs, among: List[int]) -> Dict[int, float]:
    """Position -> the upper median over the others of ``among`` of Σ A / √Σ O (the former statistic)."""
    from peer.outer.consensus import upper_median

    out = {}
    for i in among:
        zs = []
        for j in among:
            key = (min(i, j), max(i, j))
            if j != i and key in pairs.overlap:
                o = pairs.overlap[key]
                zs.append(pairs.agree[key] / math.sqrt(o) if o else 0.0)
        if zs:
            out[i] = upper_median(zs)
    return out


_SINK: List[Dict[str, Any]] = []  # the scores of the simulation running in this process
_SEEN: set = set()  # (round, senders) already scored: every replica hands the same contributions


def record_scores():
    """Wrap the engine's ``robust_step`` so that each round's contributions are scored by both
    statistics into ``_SINK``; returns the function it wrapped, for the caller to put back."""
    import peer.outer.engine as engine
    from peer.outer.consensus import agreement, score_contributions
    from peer.outer.robust import PLAIN, kinds_of, sender_names

    original = engine.robust_step

    def wrapped(strategy, theta, decoded, round_no=-1, *args, **kwargs):
        senders = tuple(sender_names(decoded))
        if (round_no, senders) not in _SEEN and len(decoded) >= 2:
            _SEEN.add((round_no, senders))
            items, kinds = list(decoded), kinds_of(decoded)
            pairs = agreement(items)
            # as robust._direction: a contribution to θ itself judged by its kind, a chain stage's by all
            plain, everyone = [i for i, k in enumerate(kinds) if k == PLAIN], list(range(len(items)))
            for stat, score in (("per-tensor", lambda among: score_contributions(items, None, pairs, among)),
                                ("pooled", lambda among: pooled_scores(pairs, among))):
                scores = score(plain)
                scores.update({i: z for i, z in score(everyone).items() if i not in scores})
                _SINK.extend(dict(round=round_no, sender=senders[i], statistic=stat, z=z) for i, z in scores.items())
        return original(strategy, theta, decoded, round_no, *args, **kwargs)

    engine.robust_step = wrapped
    return original


def run_arm(job) -> List[Dict[str, Any]]:
    """One simulation: ("trust", cfg, honest, hostile, attack or kind or None, seed, threads),
    ("partial", cfg, rounds, seed, threads) or ("chain", cfg, seed, threads); its rows of scores,
    each with its role."""
    import peer.outer.engine as engine

    t = time.monotonic()
    _SINK.clear()
    _SEEN.clear()
    original = record_scores()
    try:
        arm, role, seed = _simulate(job)
    finally:  # run in-process (--jobs 1, a test), the engine gets its own function back
        engine.robust_step = original
    rows = [dict(row, arm=arm, role=role(row["sender"]), seed=seed) for row in _SINK]
    print(f"  {arm} seed {seed}: {len(rows) // 2} scores, {time.monotonic() - t:.0f} s", flush=True)
    return rows


def _simulate(job):
    """Run the simulation of ``job`` (``run_arm``): its arm's name, the role of a sender, its seed."""
    import torch

    logging.getLogger("voloco.peer.robust").setLevel(logging.ERROR)
    if job[0] == "trust":
        import bench.trust as trust

        _, cfg, honest, hostile, attack, seed, threads = job
        trust.run_arm((cfg, honest, hostile, attack, True, seed, threads))
        arm = f"R={honest} K={hostile} {attack}" if hostile else f"R={honest} {attack or 'clean'}"
        odd = attack in trust.KINDS
        role = lambda s: "hostile" if s.startswith(trust.HOSTILE) else ("odd" if odd and s == "replica0" else "honest")  # noqa: E731
    elif job[0] == "chain":
        import bench.chains as chains

        _, cfg, seed, threads = job
        arm = [a for a in chains.ARMS if a.key == "c"][0]
        chains.run_arm((cfg, arm, threads, seed))
        arm = "3 full + a compressed 2-stage chain"
        role = lambda s: "odd" if "stage" in s else "honest"  # noqa: E731
    else:
        import bench.partial_loss as partial_loss

        _, cfg, rounds, seed, threads = job
        torch.set_num_threads(threads)
        cfg = dict(cfg, rounds=rounds)
        partial_loss.run_arm((cfg, "partial", 4, 25, 0, 8, seed, threads, "chosen", 1.0))
        arm, role = f"R=8 slice owners S=4, {rounds} rounds", (lambda s: "honest")
    return arm, role, seed


def summarize(runs: List[List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    groups: Dict[tuple, List[float]] = {}
    for rows in runs:
        for r in rows:
            groups.setdefault((r["arm"], r["role"], r["statistic"]), []).append(r["z"])
    out = []
    for (arm, role, stat), zs in groups.items():
        wrong = sum(1 for z in zs if (z >= MIN_Z if role == "hostile" else z < MIN_Z))
        out.append(dict(arm=arm, role=role, statistic=stat, n=len(zs), min=min(zs), median=statistics.median(zs),
                        max=max(zs), wrong_side=wrong))
    order = {s: i for i, s in enumerate(STATISTICS)}
    return sorted(out, key=lambda r: (r["arm"], r["role"], order[r["statistic"]]))


def show(summary: List[Dict[str, Any]]) -> None:
    cols = ["arm", "role", "statistic", "scores", "lowest", "median", "highest", f"wrong side of {MIN_Z:g}"]
    print(table(cols, [[r["arm"], r["role"], r["statistic"], str(r["n"]), f"{r['min']:+.2f}", f"{r['median']:+.2f}",
                        f"{r['max']:+.2f}", str(r["wrong_side"])] for r in summary], left=3))


def main(argv=None) -> int:
    import bench.chains as chains
    import bench.partial_loss as partial_loss
    import bench.trust as trust

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="bench/trust.py's quick model and 2 rounds of slice owners")
    ap.add_argument("--attacks", default="negate,noise,garbage", help="comma-separated bench/trust.py attacks")
    ap.add_argument("--kinds", default="slow,other-data,partial", help="comma-separated odd honest replicas ('' none)")
    ap.add_argument("--hostile", default="3:1,3:2,6:2,6:3", help="comma-separated honest:hostile counts per attack")
    ap.add_argument("--no-chain", dest="chain", action="store_false",
                    help="skip bench/chains.py's arm (c): 3 full replicas and a compressed 2-stage chain, whose stages are the odd ones")
    ap.add_argument("--slice-rounds", type=int, default=4,
                    help="rounds of bench/partial_loss.py's slice owners (0: none; default 4, round 0 is where they differ)")
    add_arm_flags(ap)
    args = ap.parse_args(argv)
    attacks, kinds = [a for a in args.attacks.split(",") if a], [k for k in args.kinds.split(",") if k]
    unknown = [a for a in attacks if a not in trust.ATTACKS] + [k for k in kinds if k not in trust.KINDS]
    if unknown:
        ap.error(f"unknown attack(s) or kind(s) {', '.join(unknown)}; have: {', '.join(trust.ATTACKS + trust.KINDS)}")
    try:
        counts = [tuple(int(x) for x in c.split(":")) for c in args.hostile.split(",")]
    except ValueError:
        counts = []
    if not counts or any(len(c) != 2 or c[0] < 1 or c[1] < 0 for c in counts):
        ap.error(f"--hostile wants honest:hostile counts such as 3:1,6:2, got {args.hostile!r}")
    cfg = trust.CONFIGS["quick" if args.quick else "full"]
    slices_cfg = partial_loss.CONFIGS["quick" if args.quick else "full"]
    jobs = []
    for seed in range(args.seeds):
        for attack in attacks:
            jobs += [("trust", cfg, r, k, attack, seed, args.threads) for r, k in counts]
        jobs += [("trust", cfg, trust.KIND_REPLICAS, 0, kind, seed, args.threads) for kind in kinds]
        jobs.append(("trust", cfg, trust.KIND_REPLICAS, 0, None, seed, args.threads))
        if args.chain:
            jobs.append(("chain", chains.CONFIGS["quick" if args.quick else "full"], seed, args.threads))
        if args.slice_rounds:
            jobs.append(("partial", slices_cfg, 2 if args.quick else args.slice_rounds, seed, args.threads))
    print(f"# bench/direction_scores.py, {now()}, {machine()}: {len(jobs)} simulations, {args.jobs} at a time", flush=True)
    run_summarized(run_arm, jobs, args.jobs, summarize, show, args.json, min_z=MIN_Z)
    return 0


if __name__ == "__main__":
    sys.exit(main())
