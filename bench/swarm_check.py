"""A real swarm against its simulation: the same run as processes over hivemind and in one process.

Used by ``bench/compression.py --real``. ``run_swarm`` starts a coordinator with the given spec
and ``peers`` peers (``voloco peer --wait-peers N --max-rounds K --threads 1``) on loopback, waits
until every peer has stopped after round K, and returns their status files (round history with
θ hashes, validation losses and stream-level byte counts). ``check_against_simulation`` then runs
``peer.simulate.simulate`` for the same spec with the peers' ids as data shards (a real peer's
shard is its peer id; the simulation's shard names are also its sender ids, so the canonical
aggregation order is the same) on one torch thread, and compares round by round: θ hash of every
real peer against the simulation's, validation loss, bytes per round.

Bit-identical θ is expected whenever every round had every peer in one group: the real round loop
and the simulation run the same training, codec and aggregation code on the same CPU.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, List

import torch

from peer.data import load_corpus
from peer.simulate import simulate
from protocol.spec import RunSpec
from voloco.demo import Child, coordinator_argv, peer_argv, read_status, wait_for_address

BENCH_SWARM = {"matchmaking_time": 2.0, "round_wait": 60.0, "gather_timeout": 30.0, "heartbeat_period": 0.5}


def run_swarm(spec: RunSpec, peers: int, rounds: int, workdir: Path, timeout: float = 1800.0, log=print) -> List[Dict[str, Any]]:
    """Run ``rounds`` rounds of ``spec`` with ``peers`` real peer processes; their final statuses."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "run.toml"
    config.write_text(spec.to_toml())
    children: List[Child] = []
    try:
        coord = Child("coordinator", coordinator_argv(workdir, config, None), workdir / "coordinator.log")
        children.append(coord)
        join = wait_for_address(workdir / "coordinator.addr", coord)
        for i in range(peers):
            argv = peer_argv(join, workdir, i, threads=1) + ["--wait-peers", str(peers), "--max-rounds", str(rounds)]
            children.append(Child(f"peer{i}", argv, workdir / f"peer{i}.log"))
        deadline = time.monotonic() + timeout
        last = -1
        while any(c.proc.poll() is None for c in children[1:]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the swarm did not finish {rounds} rounds in {timeout:.0f} s; logs in {workdir}")
            done = min((s or {}).get("round", 0) for s in (read_status(workdir, i) for i in range(peers)))
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
            full_group=all(r is not None and len(r["group"]) == len(ids) and r["contributors"] == len(ids) for r in real),
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
