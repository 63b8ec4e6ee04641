"""A real swarm against its simulation: the same run as processes over hivemind and in one process.

Used by ``bench/compression.py --real``. ``run_swarm`` starts a coordinator with the given spec
and ``peers`` peers (``voloco peer --wait-peers N --max-rounds K --threads 1``) on loopback, waits
until every peer has stopped after round K, and returns their status files (round history with
θ hashes, validation losses and stream-level byte counts). ``check_against_simulation`` then runs
``peer.round.simulate.simulate`` for the same spec with the peers' ids as data shards (a real peer's
shard is its peer id; the simulation's shard names are also its sender ids, so the canonical
aggregation order is the same) on one torch thread, and compares round by round: θ hash of every
real peer against the simulation's, validation loss, bytes per round.

Bit-identical θ is expected whenever every round had every peer in one group: the real round loop
and the simulation run the same training, codec and aggregation code on the same CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import machine, now, table  # noqa: E402
from peer.training.data import load_corpus
from peer.round.simulate import simulate  # noqa: E402
from protocol.spec import RunSpec  # noqa: E402
from tests.support.swarm_harness import refused_senders  # noqa: E402
from voloco.demo import Child, coordinator_up, peer_argv, read_status  # noqa: E402

BENCH_SWARM = {"matchmaking_time": 2.0, "round_wait": 60.0, "gather_timeout": 30.0, "heartbeat_period": 0.5}
# the simulation trains each round's H steps from that round's θ: the real peers must too (no overlap,
# whose local delta depends on when an exchange ends, and no early close, which depends on timing)
SEQUENTIAL = {"overlap": False, "min_inner_fraction": 1.0}
Watch = Callable[[List[Optional[Dict[str, Any]]], List[int]], None]  # (every peer's status now, the peers' pids)


def run_swarm(spec: RunSpec, peers: int, rounds: int, workdir: Path, timeout: float = 1800.0, log=print,
              quorum: Optional[int] = None, watch: Optional[Watch] = None,
              starting: Callable[[], ContextManager] = contextlib.nullcontext) -> List[Dict[str, Any]]:
    """Run ``rounds`` rounds of ``spec`` with ``peers`` real peer processes; their final statuses.

    ``quorum``: every peer's ``--wait-peers`` (default: all of them). ``watch``, when given, is
    called about once a second while the peers run, with every peer's status as it is now (None
    where a peer has written none yet) and the peer processes' pids (to sample their /proc).
    ``starting``: a context entered while each peer process is started (and not the coordinator):
    bench/scale.py's CPU quota."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "run.toml"
    config.write_text(spec.to_toml())
    children: List[Child] = []
    try:
        join, run_key = coordinator_up(workdir, config, children)
        for i in range(peers):
            argv = peer_argv(join, workdir, i, threads=1, run_key=run_key) + [
                "--wait-peers", str(quorum or peers), "--max-rounds", str(rounds)]
            with starting():
                children.append(Child(f"peer{i}", argv, workdir / f"peer{i}.log"))
        deadline = time.monotonic() + timeout
        last = -1
        while any(c.proc.poll() is None for c in children[1:]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the swarm did not finish {rounds} rounds in {timeout:.0f} s; logs in {workdir}")
            statuses = [read_status(workdir, i) for i in range(peers)]
            if watch is not None:
                watch(statuses, [c.proc.pid for c in children[1:]])
            done = min((s or {}).get("round", 0) for s in statuses)
            if done != last:
                log(f"    real swarm: {done}/{rounds} rounds done by every peer", flush=True)
                last = done
            time.sleep(1.0)
        failed = [c.name for c in children[1:] if c.proc.returncode != 0]
        if failed:
            raise RuntimeError(f"{', '.join(failed)} exited with an error; logs in {workdir}")
    finally:
        for c in reversed(children):
            c.stop(grace=10.0)
    statuses = [read_status(workdir, i) for i in range(peers)]
    if any(s is None for s in statuses):
        raise RuntimeError(f"a peer wrote no status file; logs in {workdir}")
    return statuses


def check_against_simulation(spec: RunSpec, statuses: List[Dict[str, Any]], rounds: int) -> Dict[str, Any]:
    """Simulate the real run with the peers' shards; compare θ hashes, losses and bytes per round."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the peers ran with --threads 1: the same kernels, the same bits
    try:
        ids = [s["peer_id"] for s in statuses]
        sim = simulate(spec, len(ids), rounds, corpus=load_corpus(spec.data.corpus, spec.data.val_fraction),
                       seed_shards=ids, eval_every=1)
    finally:
        torch.set_num_threads(threads)
    per_round = []
    for h in sim.history:
        real = [next((r for r in s["history"] if r["round"] == h.round), None) for s in statuses]
        present = [r for r in real if r is not None]
        per_round.append(dict(
            round=h.round,
            sim_hash=h.params_hash,
            real_hashes=sorted({r["params_hash"] for r in present}),
            identical=len(present) == len(real) and all(r["params_hash"] == h.params_hash for r in present),
            # every peer in the group and every payload delivered; a payload the round's checks refused
            # (peer/outer/robust.py: the direction check) was delivered, and the simulation refuses it too
            full_group=all(r is not None and len(r["group"]) == len(ids)
                           and r["contributors"] + len(refused_senders(r)) == len(ids) for r in real),
            refused=max((len(refused_senders(r)) for r in present), default=0),
            # what each peer recorded of the round, for a failure's message (None: it has no such round)
            records=[None if r is None else {k: r.get(k) for k in ("group", "contributors", "excluded", "sets", "resynced", "held")}
                     for r in real],
            sim_val=h.val_loss,
            real_val=[r["val_loss"] for r in present],
            sim_sent_per_peer=(len(ids) - 1) * sum(h.payload_bytes) / len(ids),
            real_sent_per_peer=sum(r["bytes_sent"] for r in present) / max(1, len(present)),
        ))
    return dict(
        peers=ids,
        rounds=rounds,
        identical_rounds=sum(r["identical"] for r in per_round),
        full_group_rounds=sum(r["full_group"] for r in per_round),
        sim_final_val=sim.final_val_loss,
        real_final_val=[s["val_loss"] for s in statuses],
        sim_payload_bytes=sim.payload_bytes,
        sim_sent_per_peer=sim.bytes_sent_per_peer,
        real_sent_per_peer=sum(s["bytes_sent"] for s in statuses) / len(statuses),
        real_received_per_peer=sum(s["bytes_received"] for s in statuses) / len(statuses),
        per_round=per_round,
    )


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Run a real swarm of peer processes on loopback and its in-process "
                                 "simulation; print, round by round, whether every peer's θ is bit-identical to the simulation's.")
    ap.add_argument("--peers", type=int, default=3, help="real peer processes (default 3)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds every peer trains before it stops (default 4)")
    ap.add_argument("--strategy", choices=("sparseloco", "diloco", "dct"), default="sparseloco",
                    help="outer strategy of the run (default sparseloco); the rest is the default run spec")
    ap.add_argument("--workdir", type=Path, default=None, help="where the processes' logs and status files go (default: a temporary folder)")
    ap.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write the comparison as JSON to OUT")
    args = ap.parse_args(argv)
    if args.peers < 1 or args.rounds < 1:
        ap.error("--peers and --rounds must be at least 1")
    spec = RunSpec(run_id="swarm-check").replace(outer={"strategy": args.strategy, **SEQUENTIAL}, swarm=BENCH_SWARM)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="voloco-swarm-check-"))
    print(f"{now()} | {machine()}\n{args.peers} peers x {args.rounds} rounds of the default run ({args.strategy}); logs in {workdir}")
    t0 = time.monotonic()
    statuses = run_swarm(spec, args.peers, args.rounds, workdir)
    check = check_against_simulation(spec, statuses, args.rounds)
    rows = [[str(r["round"]), r["sim_hash"], ", ".join(r["real_hashes"]), "yes" if r["identical"] else "NO",
             "yes" if r["full_group"] else "no", f"{r['sim_val']:.4f}", f"{r['sim_sent_per_peer']:,.0f}",
             f"{r['real_sent_per_peer']:,.0f}"] for r in check["per_round"]]
    print(table(["round", "simulated θ", "real θ (every peer)", "identical", "one group", "val loss",
                 "sim bytes sent/peer", "real bytes sent/peer"], rows))
    print(f"θ bit-identical in {check['identical_rounds']}/{args.rounds} rounds "
          f"({check['full_group_rounds']} with every peer in one group); {time.monotonic() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(check, indent=1))
    return 0 if check["identical_rounds"] == check["full_group_rounds"] == args.rounds else 1


if __name__ == "__main__":
    sys.exit(main())
