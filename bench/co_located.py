"""Peers that share one host: each taking its share of the cores, against each taking every core.

    python bench/co_located.py [--peers 2] [--minutes 3] [--repeats 2] [--preset demo]
                               [--inner-steps 30] [--json OUT] [--workdir DIR]

A coordinator and ``--peers`` full peers on this machine, started as a user starts them (``voloco
peer`` with no ``--threads``), for ``--minutes``; then the same with every peer given ``--threads``
set to torch's default on this host (every core: what a peer took before it counted the peers beside
it). The arms alternate, ``--repeats`` times each. Per run, from the peers' status files and logs: the
threads each peer chose (its start-up line, and any "CPU threads a -> b" line after it), its rounds,
its tokens a second of wall time over its steady rounds (bench/gpu_swarm.py ``peer_row``), the swarm's
sum, and whether every round ended on one θ. The baseline in the same run: the swarm's tokens/s
against the mean of the "every core" runs. Guarded by tests/bench/test_bench_co_located.py.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine, now, table  # noqa: E402
from bench.gpu_swarm import make_spec, one_theta, peer_row  # noqa: E402
from swarm.jsonout import write_atomic  # noqa: E402
from voloco.demo import (Child, coordinator_up, exited_with_error, peer_argv, read_statuses,  # noqa: E402
                         stop_all, wait_until_settled)

ARMS = ("share", "every core")
_CHOSEN = re.compile(r"(\d+) CPU threads?\b")
_CHANGED = re.compile(r"CPU threads \d+ -> (\d+)")


def threads_of(log: str) -> str:
    """The threads a peer's log says it took: its start-up choice, then each change ("2", "2 -> 1")."""
    first = _CHOSEN.search(log)
    seen = [first.group(1)] if first else []
    seen += _CHANGED.findall(log)
    return " -> ".join(seen) or "?"


def run_arm(arm: str, peers: int, minutes: float, spec, workdir: Path, every_core: int) -> Dict[str, Any]:
    """One swarm of ``peers`` on this host for ``minutes``: its peers' figures."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "run.toml"
    config.write_text(spec.to_toml())
    children: List[Child] = []
    t0 = time.monotonic()
    try:
        join, run_key = coordinator_up(workdir, config, children)
        for i in range(peers):
            argv = peer_argv(join, workdir, i, threads=None if arm == "share" else every_core, run_key=run_key)
            children.append(Child(f"peer{i}", argv + ["--device", "cpu", "--wait-peers", str(peers)], workdir / f"peer{i}.log"))
        deadline = t0 + minutes * 60
        while time.monotonic() < deadline and all(c.proc.poll() is None for c in children):
            time.sleep(2.0)
        wait_until_settled(partial(read_statuses, workdir, peers), 60.0)
    finally:
        stop_all(children)
    statuses = read_statuses(workdir, peers)
    rows = [peer_row(spec, s) for s in statuses if s]
    logs = [(workdir / f"peer{i}.log").read_text(errors="replace") if (workdir / f"peer{i}.log").exists() else ""
            for i in range(peers)]
    speeds = [r["tokens_per_s"] for r in rows]
    thetas = one_theta(rows)
    failed = exited_with_error(children)
    return dict(arm=arm, threads=[threads_of(log) for log in logs], rounds=[r["rounds"] for r in rows],
                tokens_per_s=speeds, swarm_tokens_per_s=sum(speeds) if speeds and None not in speeds else None,
                one_theta=all(n == 1 for n in thetas.values()), failed=failed, workdir=str(workdir))


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=2, help="full peers on this host (default 2)")
    ap.add_argument("--minutes", type=float, default=3.0, help="training time of each run (default 3: the every-core arm needs 3 rounds past its first two)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each arm, alternating (default 2)")
    ap.add_argument("--preset", default="demo", help="the model: demo (the default run's), tiny, or a preset")
    ap.add_argument("--inner-steps", type=int, default=30, help="H (default 30, the default run's)")
    ap.add_argument("--batch", type=int, default=16, help="sequences an inner step (default 16, the default run's)")
    ap.add_argument("--workdir", type=Path, default=None, help="where logs and status files go (default: a temporary folder)")
    ap.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write the runs as JSON to OUT")
    args = ap.parse_args(argv)
    if args.peers < 2 or not args.minutes > 0 or args.repeats < 1:
        raise SystemExit("--peers at least 2, --minutes positive, --repeats at least 1")
    import torch

    every_core = torch.get_num_threads()
    spec = make_spec(args.preset, args.inner_steps, args.batch)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="co-located-"))
    print(f"# peers sharing one host, {now()}, {machine()}; {args.peers} peers, {args.preset} "
          f"({spec.model.num_params() / 1e6:.2f}M), H = {args.inner_steps}, {args.minutes:g} min a run; "
          f"'every core': --threads {every_core}; logs in {workdir}", flush=True)
    runs = []
    for rep in range(args.repeats):
        for arm in ARMS:
            run = run_arm(arm, args.peers, args.minutes, spec, workdir / f"{arm.replace(' ', '-')}-{rep}", every_core)
            runs.append(run)
            print(f"  {arm} #{rep}: threads {run['threads']}, rounds {run['rounds']}, "
                  f"{run['swarm_tokens_per_s'] or 0:,.0f} tokens/s", flush=True)
    base = [r["swarm_tokens_per_s"] for r in runs if r["arm"] == "every core" and r["swarm_tokens_per_s"]]
    base_mean = statistics.fmean(base) if base else None
    lines = []
    for r in runs:
        speed = r["swarm_tokens_per_s"]
        lines.append([r["arm"], ", ".join(r["threads"]), " ".join(map(str, r["rounds"])),
                      " ".join("-" if s is None else f"{s:,.0f}" for s in r["tokens_per_s"]),
                      "-" if speed is None else f"{speed:,.0f}",
                      "-" if speed is None or not base_mean else f"{speed / base_mean:.2f}x",
                      "yes" if r["one_theta"] else "NO", ", ".join(r["failed"]) or "-"])
    print(table(["arm", "threads a peer", "rounds", "tokens/s a peer", "swarm tokens/s", "vs every core", "one θ",
                 "exited with an error"], lines, left=1))
    if args.json:
        write_atomic(args.json, dict(date=now(), machine=machine(), peers=args.peers, preset=args.preset,
                                     minutes=args.minutes, every_core=every_core, runs=runs))
    return 1 if any(r["failed"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
