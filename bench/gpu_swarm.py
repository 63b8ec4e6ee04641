"""A GPU box as a swarm: a coordinator and peer processes (full replicas and one chain) on one machine.

    python bench/gpu_swarm.py [--preset 125m] [--inner-steps 100] [--batch 8] [--full 2] [--chain-stages 2]
                              [--stage-memory-gb 8.5] [--minutes 5] [--device auto] [--no-compile]
                              [--threads N] [--log-level debug] [--json OUT] [--workdir DIR]
    python bench/gpu_swarm.py --preset tiny --device cpu --minutes 1    # a smoke run on any machine

What a volunteer with a GPU box runs, with the project's own commands (``voloco coordinator``, ``voloco
peer``, as the demo starts them: voloco/demo.py), for ``--minutes``; then every peer is stopped between
two rounds. Peers ``0 .. full-1`` train full replicas; the ``--chain-stages`` others declare
``--stage-memory-gb`` each (too little for a replica) so that the coordinator forms them into a chain.
Per peer, from its status file (peer/host/runtime.py ``status``): its role and device, the rounds it
concluded, its compute utilization (the mean of its rounds past its first two: the start and the held
first exchange), its tokens/s of wall time over those rounds, its validation loss, the H its own
rounds say would keep it busy (``busy_at_inner_steps``: peer/round/busy_advice.py), and on CUDA its
peak allocated memory against the memory estimate that chose its role (protocol/model/capacity.py).
Per round: whether every peer that concluded it holds one θ. Baselines in the same run: a chain's
tokens/s against the full replicas' mean (the ratio), a stage's peak against its estimate (must be at
most 1), and each peer's utilization against the 95 % the GPU-box issue asks.

It does not guess what it cannot measure: without CUDA it runs on the CPU only when ``--device cpu``
is given. Guarded by tests/bench/test_bench_gpu_swarm.py (a tiny run on the CPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import human, machine, now, table  # noqa: E402
from swarm.jsonout import write_atomic  # noqa: E402
from voloco.demo import (Child, chain_peer_bytes, coordinator_up, exited_with_error, peer_argv,  # noqa: E402
                         read_statuses, settled, stop_all, wait_until_settled)

TINY = {"d_model": 32, "n_layers": 2, "n_heads": 2, "ffn_hidden": 64, "seq_len": 32}  # the tests' model
SKIPPED_ROUNDS = 2  # a peer's first rounds: its start and quorum, then the held first exchange
BUSY_GOAL = 0.95


def make_spec(preset: str, inner_steps: int, batch: int):
    from protocol.spec import RunSpec

    model = "\n".join(f"{k} = {v}" for k, v in TINY.items()) if preset == "tiny" else (
        "" if preset == "demo" else f'preset = "{preset}"')
    return RunSpec.from_toml(f'run_id = "gpu-swarm"\n[model]\n{model}\n[data]\nbatch_size = {batch}\n'
                             f'[outer]\ninner_steps = {inner_steps}\n')


def estimate_bytes(spec, part: Any) -> int:
    """The memory estimate that chose this peer's role: a full replica's, or its chain stage's."""
    from protocol.model.capacity import replica_bytes, stage_bytes

    if isinstance(part, list) and len(part) == 2:
        return stage_bytes(spec, int(part[0]), int(part[1]))
    return replica_bytes(spec)


def peer_row(spec, status: Dict[str, Any]) -> Dict[str, Any]:
    """One peer's figures from its final status file."""
    history = status.get("history") or []
    steady = history[SKIPPED_ROUNDS:]
    tokens_per_step = spec.data.batch_size * spec.model.seq_len
    wall = steady[-1]["ended"] - history[SKIPPED_ROUNDS - 1]["ended"] if len(steady) >= 1 else 0.0
    part = status.get("part")
    peak = status.get("device_peak_bytes")
    estimate = estimate_bytes(spec, part)
    return dict(
        peer_id=status["peer_id"], role=(f"blocks {part[0]}-{part[1] - 1}" if isinstance(part, list) else "full"),
        chain=status.get("chain") or status.get("last_chain"), device=status.get("device"),
        compiled=status.get("compiled"), rounds=status.get("rounds", 0), steady_rounds=len(steady),
        util=statistics.fmean(r["util"] for r in steady) if steady else None,
        tokens_per_s=sum(r["steps"] for r in steady) * tokens_per_step / wall if wall > 0 else None,
        val_loss=status.get("val_loss"), busy_at_inner_steps=status.get("busy_at_inner_steps"),
        device_peak_bytes=peak, estimate_bytes=estimate,
        peak_vs_estimate=peak / estimate if peak else None,
        hashes={r["round"]: r["params_hash"] for r in history},
        phases=phase_medians(steady),
    )


PHASES = ("seconds", "busy_s", "exchange_s", "waited", "gather_s", "merge_s", "exchange_cpu", "overlapped")


def phase_medians(rounds: List[Dict[str, Any]]) -> Dict[str, Optional[float]]:
    """Where a steady round's wall time goes, the median over ``rounds`` of each field of its record
    (peer/round/loop.py ``RoundRecord``): ``seconds`` the round's wall time, ``busy_s`` its compute time
    (util × seconds), ``exchange_s`` its last step to θ, of which ``waited`` is matchmaking (encode done
    to the group's barrier), ``gather_s`` the payloads' fetch and ``merge_s`` the merge of sets;
    ``exchange_cpu`` the exchange thread's CPU seconds and ``overlapped`` the next round's steps taken
    while this exchange was in flight."""
    out: Dict[str, Optional[float]] = {}
    for key in PHASES:
        values = [r["util"] * r["seconds"] if key == "busy_s" else r.get(key) for r in rounds]
        values = [float(v) for v in values if isinstance(v, (int, float))]
        out[key] = statistics.median(values) if values else None
    return out


def one_theta(rows: List[Dict[str, Any]]) -> Dict[int, int]:
    """Round -> distinct θ among the peers that concluded it."""
    rounds = sorted({r for row in rows for r in row["hashes"]})
    return {r: len({row["hashes"][r] for row in rows if r in row["hashes"]}) for r in rounds}


def summarize(spec, statuses: List[Optional[Dict[str, Any]]], wall_s: float) -> Dict[str, Any]:
    rows = [peer_row(spec, s) for s in statuses if s]
    full = [r["tokens_per_s"] for r in rows if r["role"] == "full" and r["tokens_per_s"]]
    chains: Dict[str, List[Dict[str, Any]]] = {}
    for r in rows:
        if r["chain"]:
            chains.setdefault(r["chain"], []).append(r)
    chain_rows = []
    for c, st in sorted(chains.items()):
        speeds = [s["tokens_per_s"] for s in st]
        speed = None if None in speeds else min(speeds)  # a chain runs at its slowest stage's pace; unmeasured: None
        chain_rows.append(dict(chain=c, stages=len(st), tokens_per_s=speed,
                               vs_full=speed / statistics.fmean(full) if full and speed is not None else None))
    thetas = one_theta(rows)
    return dict(peers=[{k: v for k, v in r.items() if k != "hashes"} for r in rows], chains=chain_rows,
                distinct_theta=thetas, one_theta_every_round=all(n == 1 for n in thetas.values()),
                wall_s=round(wall_s, 1))


def print_summary(summary: Dict[str, Any]) -> None:
    def pct(x):
        return "-" if x is None else f"{100 * x:.1f} %"

    lines = [[p["peer_id"][-10:], p["role"], (p["device"] or "")[:28], str(p["rounds"]), pct(p["util"]),
              "-" if p["util"] is None else ("yes" if p["util"] >= BUSY_GOAL else "no"),
              "-" if p["tokens_per_s"] is None else f"{p['tokens_per_s']:,.0f}",
              "-" if p["val_loss"] is None else f"{p['val_loss']:.3f}", str(p["busy_at_inner_steps"] or "-"),
              "-" if p["device_peak_bytes"] is None else human(p["device_peak_bytes"]), human(p["estimate_bytes"]),
              "-" if p["peak_vs_estimate"] is None else f"{p['peak_vs_estimate']:.2f}"]
             for p in summary["peers"]]
    print(table(["peer", "role", "device", "rounds", "util (rounds 3+)", f">= {BUSY_GOAL:.0%}", "tokens/s", "val loss",
                 "busy at H", "GPU peak", "estimate", "peak / estimate"], lines, left=3))
    print("where a steady round's seconds go (medians; peer/round/loop.py RoundRecord):")
    print(table(["peer", "role", *PHASES],
                [[p["peer_id"][-10:], p["role"], *("-" if p["phases"].get(k) is None else f"{p['phases'][k]:.2f}"
                                                   for k in PHASES)] for p in summary["peers"]], left=2))
    for c in summary["chains"]:
        ratio = "-" if c["vs_full"] is None else f"{c['vs_full']:.2f}x"
        speed = "-" if c["tokens_per_s"] is None else f"{c['tokens_per_s']:,.0f}"
        print(f"chain {c['chain']}: {c['stages']} stages, {speed} tokens/s, {ratio} a full replica's")
    thetas = summary["distinct_theta"]
    print(f"distinct θ by round: {' '.join(f'{r}:{n}' for r, n in thetas.items()) or '-'}"
          f" ({'one θ every round' if summary['one_theta_every_round'] else 'NOT one θ every round'}); "
          f"{summary['wall_s']:.0f} s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="125m",
                    help="the model: a preset of protocol/spec/presets.py (125m, 350m, 1.3b, ...), 'demo' (the "
                         "spec's default model) or 'tiny' (the tests' model; default 125m)")
    ap.add_argument("--inner-steps", type=int, default=100, help="H, inner steps a round (default 100)")
    ap.add_argument("--batch", type=int, default=8, help="sequences an inner step (default 8)")
    ap.add_argument("--full", type=int, default=2, help="peers that train full replicas (default 2)")
    ap.add_argument("--chain-stages", type=int, default=2, help="low-memory peers that form one chain (default 2; 0: none)")
    ap.add_argument("--stage-memory-gb", type=float, default=None,
                    help="the memory each chain peer declares (--max-memory-gb; default: what the demo's chain peers "
                         "declare for this model: too little for a replica, enough for an even share of a chain)")
    ap.add_argument("--minutes", type=float, default=5.0, help="training time before the peers are stopped (default 5)")
    ap.add_argument("--device", default="auto", help="every peer's --device (default auto: CUDA where torch sees it)")
    ap.add_argument("--no-compile", action="store_true", help="every peer without torch.compile (default: the peer's "
                                                                  "own default, on for CUDA)")
    ap.add_argument("--threads", type=int, default=0,
                    help="every peer's --threads (default: the host's cores over the peers, at least 1)")
    ap.add_argument("--log-level", default="info", choices=["debug", "info"],
                    help="the peers' log level (default info; debug adds each round's 'round N timing:' line: "
                         "train, encode, wait, gather, apply, eval)")
    ap.add_argument("--workdir", type=Path, default=None, help="where logs and status files go (default: a temporary folder)")
    ap.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write the summary as JSON to OUT")
    args = ap.parse_args(argv)
    if args.full < 0 or args.chain_stages < 0 or args.chain_stages == 1 or args.full + args.chain_stages < 2:
        raise SystemExit("--full >= 0 and --chain-stages 0 or >= 2, at least 2 peers in all")
    if not args.minutes > 0 or args.inner_steps < 1 or args.batch < 1 or args.threads < 0:
        raise SystemExit("--minutes must be positive, --inner-steps and --batch at least 1, --threads >= 0")
    if args.device == "auto":
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device here: nothing measured (--device cpu runs it on the CPU)")
            return 0
    spec = make_spec(args.preset, args.inner_steps, args.batch)
    peers = args.full + args.chain_stages
    threads = args.threads or max(1, (os.cpu_count() or 1) // peers)
    stage_gb = args.stage_memory_gb if args.stage_memory_gb is not None else chain_peer_bytes(spec, args.chain_stages) / 1e9
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gpu-swarm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "run.toml"
    config.write_text(spec.to_toml())
    print(f"# a GPU box as a swarm, {now()}, {machine()}; {args.preset} ({spec.model.num_params() / 1e6:.1f}M), "
          f"H = {args.inner_steps}, batch {args.batch}; {args.full} full + {args.chain_stages} chain peers "
          f"({stage_gb:.2f} GB each), --device {args.device}, {threads} threads each, {args.minutes:g} min; "
          f"logs in {workdir}", flush=True)
    t0 = time.monotonic()
    children: List[Child] = []
    try:
        join, run_key = coordinator_up(workdir, config, children)
        for i in range(peers):
            argv = peer_argv(join, workdir, i, threads=threads, memory_gb=stage_gb if i >= args.full else None,
                             run_key=run_key, compile=False if args.no_compile else None)
            children.append(Child(f"peer{i}", argv + ["--device", args.device, "--wait-peers", str(peers),
                                                      "--log-level", args.log_level],
                                  workdir / f"peer{i}.log"))
        deadline = t0 + args.minutes * 60
        while time.monotonic() < deadline and all(c.proc.poll() is None for c in children):
            time.sleep(5.0)
            done = [(s or {}).get("rounds", 0) for s in read_statuses(workdir, peers)]
            print(f"  [{time.monotonic() - t0:5.0f} s] rounds {' '.join(map(str, done))}", flush=True)
        wait_until_settled(partial(read_statuses, workdir, peers), 60.0)
    finally:
        stop_all(children)
    statuses = read_statuses(workdir, peers)
    failed = exited_with_error(children)
    summary = summarize(spec, statuses, time.monotonic() - t0)
    summary.update(preset=args.preset, inner_steps=args.inner_steps, batch=args.batch, full=args.full,
                   chain_stages=args.chain_stages, stage_memory_gb=stage_gb, device=args.device, threads=threads,
                   failed=failed, settled=settled(statuses), machine=machine(), date=now())
    print_summary(summary)
    if failed:
        print(f"exited with an error: {', '.join(failed)} (logs in {workdir})")
    if args.json:
        write_atomic(args.json, summary)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
