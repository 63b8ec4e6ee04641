"""A node that forges DHT records (tests/support/hostile_records.py) inside a real swarm: a run spec with
lr = 50, progress at round 2**62 under the honest peers' ids, a chain assignment naming itself.
The honest peers keep training bit-identical and never see the forgeries; a newcomer that joins
with the run key reads the real spec and logs the forged one as ignored."""

from __future__ import annotations

import sys

import pytest

from tests.support.swarm_harness import Proc, Swarm, assert_groups_identical, run_cli

pytestmark = pytest.mark.slow


def test_forged_records_are_ignored(tmp_path):
    swarm = Swarm(tmp_path, strategy="sparseloco", inner_steps=20)
    try:
        for name in ("a", "b"):
            swarm.add_peer(name)
        swarm.wait(lambda: min(swarm.round_of("a"), swarm.round_of("b")) >= 1, 120, "a first round")
        hostile = Proc([sys.executable, "-m", "tests.support.hostile_records", swarm.join, "test", "60"], tmp_path / "hostile.log")
        swarm.procs.append(hostile)
        swarm.wait(lambda: "against 2 peers" in hostile.text(), 60, "the forger to write against both peers")
        r = min(swarm.round_of("a"), swarm.round_of("b"))
        swarm.add_peer("c")
        swarm.wait(lambda: min(swarm.round_of(p) for p in "abc") >= r + 2, 150, "two rounds with the newcomer")

        statuses = [swarm.status(p) for p in "abc"]
        assert all(p.proc.poll() is None for p in swarm.peers.values()), "an honest peer exited"
        assert hostile.proc.poll() is None, f"the forger stopped early:\n{hostile.text()[-2000:]}"
        assert len({s["spec"] for s in statuses}) == 1, "the newcomer trains with another spec"
        assert all(s["round"] < 1000 for s in statuses), "a forged round was taken for real"
        assert all(not s.get("chain") for s in statuses), "a forged chain assignment was taken for real"
        assert assert_groups_identical(statuses) >= 2
        newcomer = swarm.peers["c"].text()
        assert "ignoring a run spec of run 'test'" in newcomer and "inner lr 50" in newcomer, newcomer[-3000:]
        assert "unauthenticated" not in newcomer
    finally:
        swarm.close()


def test_private_run_admits_only_token_holders(tmp_path):
    """A private run: a late joiner with the token downloads the state and trains in step; a
    peer without it cannot even reach the DHT."""
    swarm = Swarm(tmp_path, strategy="sparseloco", inner_steps=20, join_token="test-join-token-0123456789")
    try:
        swarm.add_peer("a")
        swarm.wait(lambda: swarm.round_of("a") >= 2, 120, "the first peer's rounds")
        outsider = run_cli("peer", "--join", swarm.join, "--run-key", swarm.run_key, "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                           timeout=90)
        assert outsider.returncode == 2 and "could not reach the DHT" in outsider.stderr, outsider.stderr[-2000:]
        assert "--join-token" in outsider.stderr
        swarm.add_peer("b")
        # rounds in one group, not rounds counted from a round the late joiner reached by downloading the state
        # (a late joiner slow to start may download round r + 2, having trained no round with a)
        swarm.wait_shared("ab", 4, 150, "two rounds of a and the late joiner in one group")
        statuses = [swarm.status("a"), swarm.status("b")]
        assert all(p.proc.poll() is None for p in swarm.peers.values()), "a peer exited"
        assert assert_groups_identical(statuses) >= 2
    finally:
        swarm.close()
