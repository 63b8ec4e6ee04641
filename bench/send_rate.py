"""Who sends a payload when a round takes at most K: the eligibility table's steady state (pure, no peers).

    python bench/send_rate.py [--ks 1,4,8,32] [--sizes 64,400] [--rounds 1500] [--fresh 0.0] [--json OUT]
    python bench/send_rate.py --first-rounds 12 --ks 8,32 --sizes 32,64,256 [--runs 40]

protocol/round/eligibility.py lets each member of a part send its payload with probability min(1, p ×
w / 4) and moves p after each round halfway towards target(K) × 4 / M (M: the part's members weighed
by standing, estimated from that round's senders and the standing the round gave; the whole way from
where everyone sends). This runs that rule alone, round after round,
with the real decisions (SHA-256 of each round's seed and each member's name, the exact integer
update), for N members of one part, a share ``--fresh`` of them fresh (weight 1) and the rest
established (weight 4). Per K and N, over
the rounds after the first 100 (p has settled by then): the senders a round against N (the
baseline: every member sends, as with K = 0), how often a round had fewer than K senders, and the
contributions it took (min(E, K)) against K.

``--first-rounds R`` runs a fresh swarm's first R rounds instead, where each round's drawn senders
count and so weigh a quarter more the next round: senders a round by round, today's rule against the
rule before it (p moved from the senders' count alone, blind to the standing the round gave), in the
same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any, Callable, Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import machine, now, table  # noqa: E402
from protocol.round import choice, eligibility  # noqa: E402
from protocol.round.standing import ESTABLISHED  # noqa: E402

SETTLE = 100  # rounds left out of the figures while p settles from CAP


def run(k: int, n: int, rounds: int, fresh: float) -> Dict[str, Any]:
    names = [f"peer{i:05d}" for i in range(n)]
    parts = {s: -1 for s in names}  # every member carries the full model
    standing = {s: ESTABLISHED for s in names[int(round(fresh * n)):]}  # the others are fresh
    table_: Dict[str, int] = {}
    senders: List[int] = []
    for r in range(rounds):
        sent = eligibility.contributors(parts, f"bench:{r}", table_, standing)
        if r >= SETTLE:
            senders.append(len(sent))
        weights = [choice.weight(standing.get(s, 0)) for s in sent]  # nobody's standing moves here
        table_ = eligibility.update(table_, {"-1": [(w, w) for w in weights]}, k)
    return dict(k=k, n=n, target=float(eligibility.target(k)), fresh=fresh, rounds=len(senders),
                senders=statistics.fmean(senders), senders_sd=statistics.pstdev(senders),
                short=sum(e < k for e in senders) / len(senders),
                taken=statistics.fmean(min(e, k) for e in senders) / k)


def counts_only(table: Dict[str, int], candidates: Dict[str, List[Tuple[int, int]]], k: int) -> Dict[str, int]:
    """The rule before 2026-12-07, the baseline of ``--first-rounds``: p moved towards target(K) / E of
    itself from the candidates' count E alone, blind to their weights and to the standing the round gave."""
    aim = eligibility.target(k)
    num, den = aim.numerator, aim.denominator
    out = {}
    for key in set(table) | {key for key, c in candidates.items() if c}:
        p, e = table.get(key, eligibility.CAP), len(candidates.get(key, ()))
        if e <= 0:
            p = 2 * p
        elif p >= eligibility.CAP:
            p = max(p * num // (den * e), p // eligibility.MAX_FALL)
        else:
            p = p * (num + den * e) // (2 * den * e)
        if p < eligibility.CAP:
            out[key] = max(p, 1)
    return out


def first_rounds(k: int, n: int, rounds: int, runs: int, rule: Callable) -> List[float]:
    """Senders a round, mean over ``runs`` runs, in each of a fresh swarm's first ``rounds`` rounds of N
    members of one part, where every drawn sender counts (standing + 1) as in an honest run."""
    names = [f"peer{i:05d}" for i in range(n)]
    parts = {s: -1 for s in names}
    per_round: List[List[int]] = [[] for _ in range(rounds)]
    for run_no in range(runs):
        standing: Dict[str, int] = {}
        table_: Dict[str, int] = {}
        for r in range(rounds):
            seed = f"bench-{run_no}:{r}"
            sent = eligibility.contributors(parts, seed, table_, standing)
            per_round[r].append(len(sent))
            before = {s: choice.weight(standing.get(s, 0)) for s in sent}
            for s in choice.choose({s: -1 for s in sent}, k, seed, standing):
                standing[s] = standing.get(s, 0) + 1
            table_ = rule(table_, {"-1": [(w, choice.weight(standing.get(s, 0))) for s, w in before.items()]}, k)
    return [statistics.fmean(x) for x in per_round]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", default="1,4,8,32", help="comma-separated K (outer.max_contributions; default 1,4,8,32)")
    ap.add_argument("--sizes", default="64,400", help="comma-separated members of the part (default 64,400)")
    ap.add_argument("--rounds", type=int, default=1500, help=f"rounds per (K, N), the first {SETTLE} not counted "
                    "(default 1500)")
    ap.add_argument("--fresh", type=float, default=0.0, help="share of the members that are fresh (weight 1; "
                    "default 0: all established)")
    ap.add_argument("--first-rounds", type=int, default=0, metavar="R",
                    help="instead: senders a round in each of a fresh swarm's first R rounds (every drawn sender "
                    "counts), today's rule against the rule before (p from the candidates' count alone), "
                    "mean over --runs runs")
    ap.add_argument("--runs", type=int, default=40, help="runs per (K, N) for --first-rounds (default 40)")
    ap.add_argument("--json", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if args.first_rounds > 0:
        return young(args)
    ks, sizes = [int(x) for x in args.ks.split(",")], [int(x) for x in args.sizes.split(",")]
    if min(ks) < 1 or min(sizes) < 1 or args.rounds <= SETTLE or not 0 <= args.fresh <= 1:
        raise SystemExit(f"--ks and --sizes must be >= 1, --rounds > {SETTLE}, --fresh in [0, 1]")
    print(f"# who sends at most K, {now()}, {machine()}; {args.rounds} rounds, the first {SETTLE} not counted, "
          f"{args.fresh:.0%} fresh")
    rows = [run(k, n, args.rounds, args.fresh) for k in ks for n in sizes]
    print(table(["K", "N", "target", "senders/round", "vs everyone (N)", "rounds short of K", "taken / K"],
                [[str(r["k"]), str(r["n"]), f"{r['target']:.1f}", f"{r['senders']:.1f} ± {r['senders_sd']:.1f}",
                  f"{r['senders'] / r['n']:.3f}x", f"{100 * r['short']:.1f} %", f"{100 * r['taken']:.1f} %"]
                 for r in rows], left=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=machine(), date=now(), args=vars(args), rows=rows), f, indent=1)
    return 0


def young(args) -> int:
    ks, sizes = [int(x) for x in args.ks.split(",")], [int(x) for x in args.sizes.split(",")]
    if min(ks) < 1 or min(sizes) < 1 or args.runs < 1:
        raise SystemExit("--ks, --sizes and --runs must be >= 1")
    print(f"# senders a round in a fresh swarm's first {args.first_rounds} rounds, {now()}, {machine()}; "
          f"mean over {args.runs} runs; 'before': p from the candidates' count alone")
    rows = []
    for k in ks:
        for n in sizes:
            for name, rule in (("today", eligibility.update), ("before", counts_only)):
                means = first_rounds(k, n, args.first_rounds, args.runs, rule)
                rows.append(dict(k=k, n=n, rule=name, target=float(eligibility.target(k)), senders=means))
    later = lambda r: statistics.fmean(r["senders"][1:])  # noqa: E731
    print(table(["K", "N", "rule", "target"] + [f"round {i + 1}" for i in range(args.first_rounds)]
                + ["rounds 2+ mean", "vs before"],
                [[str(r["k"]), str(r["n"]), r["rule"], f"{r['target']:.1f}"] + [f"{x:.1f}" for x in r["senders"]]
                 + [f"{later(r):.2f}", f"{later(r) / later(rows[i + 1]):.3f}x" if r["rule"] == "today" else "-"]
                 for i, r in enumerate(rows)], left=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=machine(), date=now(), args=vars(args), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
