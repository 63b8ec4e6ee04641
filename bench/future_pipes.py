"""What one call to a helper process costs: hivemind's futures with and without their result pipe sent once.

A peer calls its DHT process for every read, store and matchmaking poll (and its averager process
for every gather step); each call's ``MPFuture`` carries the caller's result pipe. This benchmark
starts one hivemind DHT (no other node), makes ``--calls`` calls to it (``run_coroutine`` of a
coroutine that returns at once: only the hand-over is timed), and reports per call: wall time, the
DHT process's CPU and the caller's CPU (all its threads: the resource-sharer thread that hands the
pipe over is one). Arms, each in a process of its own, alternated ``--repeats`` times:

- ``hivemind``: every future carries its pipe (hivemind as it is);
- ``lean``: the DHT's pipe wrapped by swarm/future_pipes.py (the pipe once, then a token).

The table compares each arm's median against hivemind's in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine, now, table  # noqa: E402

ARMS = ("hivemind", "lean")


async def _noop(dht, node):
    return None


def one_arm(arm: str, calls: int) -> Dict[str, float]:
    """In this process: start a DHT, make ``calls`` calls, return per-call costs."""
    import psutil
    import hivemind

    from swarm.future_pipes import send_futures_lean

    dht = hivemind.DHT(start=True)
    try:
        if arm == "lean":
            send_futures_lean(dht._outer_pipe)
        for _ in range(20):  # warm-up: the first calls start hivemind's and multiprocessing's threads
            dht.run_coroutine(_noop)
        helper, me = psutil.Process(dht.pid), psutil.Process()
        h0, m0, t0 = sum(helper.cpu_times()[:2]), sum(me.cpu_times()[:2]), time.perf_counter()
        for _ in range(calls):
            dht.run_coroutine(_noop)
        wall = time.perf_counter() - t0
        h1, m1 = sum(helper.cpu_times()[:2]), sum(me.cpu_times()[:2])
    finally:
        dht.shutdown()
    return {"wall_ms": 1e3 * wall / calls, "helper_cpu_ms": 1e3 * (h1 - h0) / calls, "caller_cpu_ms": 1e3 * (m1 - m0) / calls}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=2000, help="calls per arm and repeat (default 2000)")
    ap.add_argument("--repeats", type=int, default=3, help="times each arm runs, alternated (default 3)")
    ap.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write every run's figures as JSON to OUT")
    ap.add_argument("--arm", choices=ARMS, default=None, help=argparse.SUPPRESS)  # one arm, in a child process
    args = ap.parse_args(argv)
    if args.arm:
        print(json.dumps(one_arm(args.arm, args.calls)))
        return 0
    print(f"{now()}: {args.calls} calls to a DHT process per run, arms {', '.join(ARMS)}, {args.repeats} repeats; {machine()}",
          flush=True)
    runs: Dict[str, List[Dict[str, float]]] = {a: [] for a in ARMS}
    for _ in range(args.repeats):
        for arm in ARMS:
            out = subprocess.run([sys.executable, __file__, "--arm", arm, "--calls", str(args.calls)], check=True,
                                 capture_output=True, text=True).stdout
            runs[arm].append(json.loads(out.strip().splitlines()[-1]))
    rows = []
    base = {k: statistics.median(r[k] for r in runs["hivemind"]) for k in runs["hivemind"][0]}
    for arm in ARMS:
        med = {k: statistics.median(r[k] for r in runs[arm]) for k in runs[arm][0]}
        rows.append([arm] + [f"{med[k]:.3f} ({med[k] / base[k]:.2f}x)" for k in ("wall_ms", "helper_cpu_ms", "caller_cpu_ms")])
    print(table(["arm", "wall ms/call", "DHT process CPU ms/call", "caller CPU ms/call"], rows, left=1))
    if args.json:
        args.json.write_text(json.dumps({"calls": args.calls, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
