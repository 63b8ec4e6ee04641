"""Real peer processes over hivemind against the in-process simulation of the same run.

Three peers start together (``--wait-peers``), train three rounds on one torch thread each and
stop; the simulation runs the same spec with the peers' ids as shards. Every round every peer's θ
must be bit-identical to the simulation's, and so must the validation losses: the exchange adds
nothing and loses nothing, and the benchmarks' simulated figures are those of real peers.
Every peer must be in one group every round with every payload delivered; a payload the direction
check refused (a fresh honest update of round 0 sometimes agrees too little with the others at this
size) was delivered, and the simulation refuses it too (tests/support/swarm_harness.py ``refused_senders``).
"""


from pathlib import Path

import pytest

from protocol.spec import ModelSpec, RunSpec
from tests.support.bench_loader import load_bench

swarm_check = load_bench("swarm_check")

pytestmark = pytest.mark.slow


def test_real_swarm_is_bit_identical_to_its_simulation(tmp_path):
    spec = RunSpec(run_id="real-vs-sim", seed=3, model=ModelSpec(d_model=48, n_layers=2, n_heads=2, ffn_hidden=96, seq_len=32)).replace(
        data={"batch_size": 4, "val_batches": 2},
        inner={"lr": 3e-3, "warmup_steps": 3, "total_steps": 40},
        outer={"strategy": "sparseloco", "inner_steps": 8, **swarm_check.SEQUENTIAL},
        # a group closes as soon as every peer the barrier expects has joined; the longer matchmaking
        # window only matters on a loaded machine, where a leader's 2 s can pass before the third peer asks
        swarm={**swarm_check.BENCH_SWARM, "matchmaking_time": 6.0},
    )
    statuses = swarm_check.run_swarm(spec, peers=3, rounds=3, workdir=tmp_path, timeout=300, log=lambda *a, **k: None)
    check = swarm_check.check_against_simulation(spec, statuses, rounds=3)
    for r in check["per_round"]:
        assert r["full_group"], (f"round {r['round']}: not every peer was in one group: {r['records']}\n"
                                 + _warnings(tmp_path))
        assert r["identical"], f"round {r['round']}: real θ {r['real_hashes']} vs simulated {r['sim_hash']}"
        assert r["real_val"] == [r["sim_val"]] * 3
        assert r["real_sent_per_peer"] > 0
    assert check["identical_rounds"] == 3


def _warnings(workdir: Path) -> str:
    """The peers' WARN lines and last lines: what a failure on a loaded CI machine leaves to read."""
    out = []
    for log in sorted(workdir.glob("peer*.log")):
        lines = log.read_text(errors="replace").splitlines()
        out += [f"{log.name}: {line}" for line in [x for x in lines if " WARN " in x][-10:] + lines[-5:]]
    return "\n".join(out)
