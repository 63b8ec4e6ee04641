"""Who sends a payload when a round takes at most K: the eligibility table's steady state (pure, no peers).

    python bench/send_rate.py [--ks 1,4,8,32] [--sizes 64,400] [--rounds 1500] [--fresh 0.0] [--json OUT]

protocol/round/eligibility.py lets each member of a part send its payload with probability min(1, p ×
w / 4) and moves p after each round halfway towards target(K) / E of itself (E: that round's
senders; the whole way from where everyone sends). This runs that rule alone, round after round,
with the real decisions (SHA-256 of each round's seed and each member's name, the exact integer
update), for N members of one part, a share ``--fresh`` of them fresh (weight 1) and the rest
established (weight 4). Per K and N, over
the rounds after the first 100 (p has settled by then): the senders a round against N (the
baseline: every member sends, as with K = 0), how often a round had fewer than K senders, and the
contributions it took (min(E, K)) against K.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import machine, now, table  # noqa: E402
from protocol.round import eligibility  # noqa: E402
from protocol.round.standing import ESTABLISHED  # noqa: E402

SETTLE = 100  # rounds left out of the figures while p settles from CAP


def run(k: int, n: int, rounds: int, fresh: float) -> Dict[str, Any]:
    names = [f"peer{i:05d}" for i in range(n)]
    parts = {s: -1 for s in names}  # every member carries the full model
    standing = {s: ESTABLISHED for s in names[int(round(fresh * n)):]}  # the others are fresh
    table_: Dict[str, int] = {}
    senders: List[int] = []
    for r in range(rounds):
        e = len(eligibility.contributors(parts, f"bench:{r}", table_, standing))
        if r >= SETTLE:
            senders.append(e)
        table_ = eligibility.update(table_, {"-1": e}, k)
    return dict(k=k, n=n, target=float(eligibility.target(k)), fresh=fresh, rounds=len(senders),
                senders=statistics.fmean(senders), senders_sd=statistics.pstdev(senders),
                short=sum(e < k for e in senders) / len(senders),
                taken=statistics.fmean(min(e, k) for e in senders) / k)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", default="1,4,8,32", help="comma-separated K (outer.max_contributions; default 1,4,8,32)")
    ap.add_argument("--sizes", default="64,400", help="comma-separated members of the part (default 64,400)")
    ap.add_argument("--rounds", type=int, default=1500, help=f"rounds per (K, N), the first {SETTLE} not counted "
                    "(default 1500)")
    ap.add_argument("--fresh", type=float, default=0.0, help="share of the members that are fresh (weight 1; "
                    "default 0: all established)")
    ap.add_argument("--json", help="write the rows as JSON here")
    args = ap.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
