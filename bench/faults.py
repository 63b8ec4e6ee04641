"""Faults over real links: one swarm goes through every fault scenario in turn, one row each.

Four peers of a tiny SparseLoCo run (d 64, 2 layers, H 20, sequential rounds) and a coordinator,
each on a host of its own (network namespaces on a bridge, every link capped with tbf at --rate:
tests/support/netns_hosts.py), then a fifth peer that joins late. Once every peer has trained --warmup
rounds (past the steep start of training), the scenarios (tests/support/fault_scenarios.py) run in this order: a peer SIGKILLed mid-gather and restarted; a peer SIGSTOPped past the round's
deadline, then resumed; the coordinator SIGKILLed and restarted; a host's link down past the round's
deadline, then up; a late joiner mid-round; two peers restarted at once; --kills SIGKILLs at random
instants (half aimed at a checkpoint being written), each peer restarted at once.

Per scenario: the rounds the survivors completed between the fault and the recovery, the time to
recover (fault to the first round every member ends in one group with one θ), whether each
returning peer was identical to its group after its first round back, and the validation loss of
the recovered round against the undisturbed run's at equal tokens trained into θ (the in-process
simulation of the four first peers, bit-identical to a real undisturbed swarm; "r20.5": after 20.5
of its rounds, tests/support/fault_losses.py), and the fault's cost: how much it widened that gap, the mean
gap over the recovered round and the 2 after it against the mean over the swarm's last 3 rounds
before the fault (counted as even where the swarm was ahead) (the scenarios share one swarm, so the gap adds up; one round's gap alone moves
from round to round). PASS needs all of it: survivors trained on, returning peers
identical, the fault's cost at most +2 % (a lower loss is no harm). Over the whole run every pair
of groupmates must hold one θ in every round, or be back on one θ within 3 rounds (a member cut off
mid-gather decides alone; the next round's start-hash check repairs it: such splits are counted and
printed), and every checkpoint on disk must load.

Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import exit_on_sigterm, machine, now, table  # noqa: E402
from tests.support.fault_scenarios import SCENARIOS, WARMUP_ROUNDS, run_faults  # noqa: E402
from tests.support.netns_hosts import netns_unavailable  # noqa: E402


def report(result: dict) -> str:
    lines = []
    for r in result["rows"]:
        if "failed" in r:
            lines.append([r["scenario"], "-", "-", f"{r['recover_s']:.0f}", "-", "-", "-", "-", "-", "FAIL"])
            continue
        back = ", ".join(f"{n}: r{v[0]} {'same θ' if v[1] else 'DIFFERENT'}" if v else f"{n}: none"
                         for n, v in r["returning"].items()) or "-"
        ratio, cost = r["loss_ratio"], r["loss_cost"]
        lines.append([
            r["scenario"], str(r["survivor_rounds"]), f"{r['fault_round']} -> {r['recovered_round']}",
            f"{r['recover_s']:.1f}", back, f"{r['val_loss']:.4f}",
            f"{r['undisturbed_val_loss']:.4f} (r{r['token_round']:.1f})" if r["undisturbed_val_loss"] else "-",
            f"{(ratio - 1) * 100:+.2f} %" if ratio is not None else "-",
            f"{cost * 100:+.2f} %" if cost is not None else "-", "PASS" if r["ok"] else "FAIL",
        ])
    cols = ["scenario", "survivor rounds", "rounds", "recover s", "returning (first round back)", "val loss",
            "undisturbed at equal tokens", "vs undisturbed", "fault's cost", "result"]
    return table(cols, lines, left=1)


def summary(result: dict) -> str:
    random_row = next((r for r in result["rows"] if r["scenario"] == "random_kills" and "failed" not in r), None)
    kills = (f"; random kills: {random_row['kills']} ({random_row['kills_at_checkpoint']} while a checkpoint was "
             f"being written, {random_row['kills_in_startup']} during a start-up)") if random_row else ""
    problems = result["problems"]
    repaired = result.get("repaired_splits", [])
    return (f"{result['groupmate_pairs_checked'] - len(repaired)} of {result['groupmate_pairs_checked']} (round, peer, "
            f"groupmate) pairs identical, {len(repaired)} apart and back on one θ within 3 rounds; "
            f"{len(problems)} problem(s) (unloadable checkpoints, refused checkpoints, groupmates apart for longer){kills}; "
            f"{result['rounds']} rounds, {result['tokens_per_round']} tokens per peer a round, "
            f"{result['wall_s']:.0f} s" + "".join(f"\n  problem: {p[:4000]}" for p in problems)
            + "".join(f"\n  repaired split: {p[:1000]}" for p in repaired))


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", default=",".join(SCENARIOS),
                    help=f"comma-separated scenarios to run, in this order (default: all: {','.join(SCENARIOS)})")
    ap.add_argument("--kills", type=int, default=100, help="SIGKILLs of the random_kills scenario (default 100)")
    ap.add_argument("--quick", action="store_true", help="10 random kills instead of --kills (a few minutes less)")
    ap.add_argument("--rate", default="100mbit", help="every host's link rate, a tc rate (default 100mbit)")
    ap.add_argument("--warmup", type=int, default=WARMUP_ROUNDS,
                    help=f"rounds every peer trains before the first fault (default {WARMUP_ROUNDS})")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random kills' victims and instants (default 0)")
    ap.add_argument("--workdir", type=Path, default=None, help="where the logs, status files and checkpoints go "
                    "(default: a new temporary folder)")
    ap.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write every row and check as JSON to OUT")
    args = ap.parse_args(argv)
    exit_on_sigterm()
    why = netns_unavailable()
    if why:
        sys.exit(f"needs network namespaces: {why}")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="voloco-faults-"))
    kills = 10 if args.quick else args.kills
    print(f"{machine()}, {now()}", flush=True)
    result = run_faults(workdir, [s for s in args.scenarios.split(",") if s], kills=kills, seed=args.seed,
                        rate=args.rate, warmup=args.warmup)
    print()
    print(report(result))
    print(summary(result))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "date": now(), **result}, indent=1))
    ok = all(r.get("ok") for r in result["rows"]) and not result["problems"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
