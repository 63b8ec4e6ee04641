"""Liveness in real processes: a peer announced but never arriving delays honest rounds by the
straggler allowance only, and a progress record claiming round 2**62 does not keep a late joiner
from catching up."""

from __future__ import annotations

import statistics
import sys

import pytest

from tests.support.swarm_harness import Proc, Swarm, assert_groups_identical

pytestmark = pytest.mark.slow

LIE_SECONDS = 240


def liar(swarm: Swarm, tmp_path, mode: str) -> Proc:
    proc = Proc([sys.executable, "-m", "tests.support.stalling_peer", swarm.join, swarm.run_key, mode, str(LIE_SECONDS)],
                tmp_path / f"{mode}.log")
    swarm.procs.append(proc)
    return proc


def test_a_stalling_peer_and_a_forged_round_neither_stall_rounds_nor_block_catch_up(tmp_path):
    swarm = Swarm(tmp_path, strategy="sparseloco", inner_steps=20)  # round_wait = 20 s
    try:
        for name in ("a", "b"):
            swarm.add_peer(name)
        swarm.wait(lambda: min(swarm.round_of("a"), swarm.round_of("b")) >= 1, 150, "a first round")
        stall, forged = liar(swarm, tmp_path, "stall"), liar(swarm, tmp_path, "far-ahead")
        swarm.wait(lambda: "lies as" in stall.text() and "lies as" in forged.text(), 120, "the liars to start")
        swarm.wait(lambda: "not waiting longer" in swarm.peers["a"].text() + swarm.peers["b"].text(), 120, "the stall")
        start = min(swarm.round_of("a"), swarm.round_of("b"))
        swarm.wait(lambda: min(swarm.round_of("a"), swarm.round_of("b")) >= start + 5, 240, "five rounds beside the liars")
        swarm.add_peer("late")
        swarm.wait(lambda: (swarm.status("late") or {}).get("rounds", 0) >= 2, 180, "the late joiner's first rounds")
        swarm.wait_shared(("a", "b", "late"), 4, 120, "rounds in one group")
        statuses = [swarm.status(n) for n in ("a", "b", "late")]
        assert all(p.proc.poll() is None for p in swarm.peers.values()), "an honest peer exited"
        assert stall.proc.poll() is None and forged.proc.poll() is None, "a liar stopped early"

        # the stall cost a round at most the allowance, then the staller was skipped
        for s in statuses[:2]:
            beside = [r["seconds"] for r in s["history"] if r["round"] > start]
            assert statistics.median(beside) < 10.0, beside  # each would take >= round_wait (20 s) otherwise
        logs = swarm.peers["a"].text() + swarm.peers["b"].text()
        assert "not waiting again for" in logs, logs[-3000:]

        # the late joiner caught up from an honest peer and took part in a real group round
        late = statuses[2]
        assert "downloading the state of round 4611686018427387904" not in swarm.peers["late"].text()
        first = late["history"][0]
        assert first["round"] > start + 1 and len(first["group"]) >= 2, late["history"]
        assert assert_groups_identical(statuses) >= 4
    finally:
        swarm.close()
