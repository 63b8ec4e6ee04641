"""Pipeline chains in a real swarm: low-resource peers grouped by the coordinator into a chain
that trains beside a full replica, over TCP stage links, and re-forms when a stage dies."""

from __future__ import annotations

import threading

import pytest

from peer.round.early_close import min_steps
from tests.support.cpu_limit import throttle
from tests.support.swarm_harness import Swarm, assert_groups_identical, refused_by_checks

pytestmark = pytest.mark.slow

SMALL = ("--max-memory-gb", "0.009")  # the tiny run's full replica needs ~12 MB; a stage ~5-7 MB


def chain_of(status):
    return (status or {}).get("chain")


def test_chain_trains_beside_a_full_replica_and_reforms_after_a_stage_dies(tmp_path):
    # rounds of about a second: a lone full replica at 20 steps ran ~5 rounds/s, and two stages that
    # caught up with it at different moments kept refusing each other's round in the hello
    swarm = Swarm(tmp_path, strategy="sparseloco", inner_steps=80)
    try:
        swarm.add_peer("full")
        swarm.add_peer("s1", *SMALL)
        swarm.add_peer("s2", *SMALL)
        # a chain's stages are not waited for while they link (the full replica may go ahead alone, and
        # the stages catch up by download): wait for rounds the chain trained with the full replica
        shared = lambda: [r for r in (swarm.status("full") or {}).get("history", [])  # noqa: E731
                          if len(r["group"]) == 3]
        swarm.wait(lambda: chain_of(swarm.status("s1")) is not None and len(shared()) >= 2, 150, "a chain's first rounds")
        s1, s2, full = swarm.status("s1"), swarm.status("s2"), swarm.status("full")
        assert chain_of(s1) == chain_of(s2)
        assert sorted([tuple(s1["part"]), tuple(s2["part"])]) == [(0, 1), (1, 2)]
        # the stages and the full replica end every shared round with the same parameters
        assert assert_groups_identical([full, s1, s2]) >= 3
        # a stage's update that does not count was refused by the direction check, which every member,
        # the stage too, decides alike (the chain trains θ projected onto its links' subspace, and joined
        # a full replica already under way: its update may not agree with the full replica's)
        for r in shared():
            assert all(refused_by_checks(r, p) for p in r["excluded"]), r["excluded"]
        rec = full["history"][-1]
        assert {s1["peer_id"], s2["peer_id"]} <= set(rec["group"]), rec
        # activations crossed the link, compressed: rank 6 of 64 -> about 16 bytes a token each way
        assert s1["link_bytes_sent"] > 0 and s2["link_bytes_sent"] > 0

        swarm.peers["s2"].kill()
        r = swarm.round_of("full")
        swarm.wait(lambda: swarm.round_of("full") >= r + 2, 120, "the full replica going on without the chain")
        swarm.add_peer("s3", *SMALL)
        swarm.wait(lambda: chain_of(swarm.status("s3")) is not None and swarm.round_of("s3") >= 1
                   and (swarm.status("s3") or {}).get("rounds", 0) >= 2, 180, "a re-formed chain training")
        s1, s3 = swarm.status("s1"), swarm.status("s3")
        assert chain_of(s1) == chain_of(s3) != chain_of(s2)
        assert "broke" in swarm.peers["s1"].text()
        assert assert_groups_identical([swarm.status("full"), s1, s3]) >= 1
    finally:
        swarm.close()


def test_a_slow_chain_closes_its_rounds_early_as_one_replica_and_shares_them(tmp_path):
    """A chain slower than the full peers (both stages throttled to a third of their speed): its first
    stage closes the chain's round once the full peers are ready, the other stage stops at the same
    step (a ``close`` frame: peer/chain/gpipe.py ``close_round``), and the chain's rounds end in one group
    with the full peers, on one θ. Before, a chain never closed early: on a GPU at 125m its rounds took
    4x a full peer's, and it concluded them in a group of its own (bench/RESULTS.md, seventy-second session)."""
    H = 60  # rounds long enough that the first stage sees the full peers ready (early close reads once a second)
    swarm = Swarm(tmp_path, strategy="sparseloco", inner_steps=H)
    stop = threading.Event()
    try:
        swarm.add_peer("a")
        swarm.add_peer("b")
        stages = [swarm.add_peer("s1", *SMALL), swarm.add_peer("s2", *SMALL)]
        swarm.wait(lambda: chain_of(swarm.status("s1")) is not None and swarm.round_of("s1") >= 1, 180,
                   "the chain's first round")
        for stage in stages:
            throttle(stage.proc.pid, stop, run_s=0.1, pause_s=0.2)
        first = swarm.round_of("s1")

        def shared(name: str) -> list:  # the chain's rounds since the throttle, in one group with both full peers
            return [r for r in (swarm.status(name) or {}).get("history", []) if r["round"] > first and len(r["group"]) == 4]

        swarm.wait(lambda: sum(r["steps"] < H for r in shared("s1")) >= 2, 300,
                   "two rounds the throttled chain closed early and shared with the full peers")
        stop.set()
        statuses = [swarm.status(n) for n in ("a", "b", "s1", "s2")]
        steps = [{r["round"]: r["steps"] for r in shared(n)} for n in ("s1", "s2")]
        both = sorted(set(steps[0]) & set(steps[1]))
        assert both and all(steps[0][r] == steps[1][r] for r in both), steps  # the chain stopped as one
        assert all(min_steps(H, 0.25) <= steps[0][r] <= H for r in both), steps
        assert assert_groups_identical(statuses) >= 2
        for name in ("s1", "s2"):
            assert "Traceback" not in swarm.peers[name].text()
            assert "broke" not in swarm.peers[name].text()
    finally:
        stop.set()
        swarm.close()
