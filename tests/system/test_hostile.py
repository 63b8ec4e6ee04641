"""Hostile and failing members inside a real exchange: honest peers never crash, never take a bad
payload into their parameters, and end every round bit-identical."""

from __future__ import annotations

import sys

import pytest

from protocol.round.reconcile import SILENT
from tests.support.swarm_harness import Proc, Swarm, assert_groups_identical

pytestmark = pytest.mark.slow


def run_with_hostile(tmp_path, mode: str, rounds: int):
    swarm = Swarm(tmp_path, strategy="sparseloco", inner_steps=40)
    try:
        for name in ("a", "b"):
            swarm.add_peer(name)
        swarm.wait(lambda: min(swarm.round_of("a"), swarm.round_of("b")) >= 1, 120, "a first round")
        hostile = Proc([sys.executable, "-m", "tests.support.hostile_peer", swarm.join, mode, str(rounds)], tmp_path / "hostile.log")
        swarm.procs.append(hostile)
        try:
            hostile.proc.wait(timeout=150)
        except Exception:
            pass
        r = min(swarm.round_of("a"), swarm.round_of("b"))
        swarm.wait(lambda: min(swarm.round_of("a"), swarm.round_of("b")) >= r + 2, 120, "two rounds after the hostile peer")
        statuses = [swarm.status("a"), swarm.status("b")]
        assert all(p.proc.poll() is None for p in swarm.peers.values()), "an honest peer exited"
        assert assert_groups_identical(statuses) >= 2
        return statuses, hostile.text()
    finally:
        swarm.close()


def hostile_rounds(statuses, honest_ids):
    """Round records of honest peers whose group had a third member (a record lists every member of
    its group, excluded ones too). A round of the two honest peers alone is not one, even where one
    of them timed out (a loaded run: b's payload missed a's deadline and b took a's set)."""
    return [rec for s in statuses for rec in s["history"] if set(rec["group"]) - honest_ids]


def test_garbage_payload_is_rejected_and_its_sender_excluded(tmp_path):
    statuses, log = run_with_hostile(tmp_path, "garbage", rounds=3)
    honest = {s["peer_id"] for s in statuses}
    recs = hostile_rounds(statuses, honest)
    assert recs, f"the hostile peer never joined a group:\n{log}"
    for rec in recs:
        reasons = [why for pid, why in rec["excluded"].items() if pid not in honest]
        # refused as invalid; or, on a loaded machine, its payload missed the deadline: either way excluded
        assert reasons and all("invalid payload" in why or why == SILENT for why in reasons), rec
        # nothing of the hostile payload was aggregated (an honest member may have timed out too)
        assert rec["contributors"] == len(rec["group"]) - len(rec["excluded"]) <= 2
    assert any("invalid payload" in why for rec in recs for why in rec["excluded"].values()), recs


def test_equivocating_sender_is_excluded_by_every_member(tmp_path):
    statuses, log = run_with_hostile(tmp_path, "equivocate", rounds=2)
    honest = {s["peer_id"] for s in statuses}
    recs = hostile_rounds(statuses, honest)
    assert recs, f"the hostile peer never joined a group:\n{log}"
    for rec in recs:
        assert any(pid not in honest for pid in rec["excluded"]), rec
        assert rec["contributors"] == len(rec["group"]) - len(rec["excluded"]) <= 2


def test_member_killed_mid_gather_leaves_survivors_identical(tmp_path):
    statuses, log = run_with_hostile(tmp_path, "die", rounds=1)
    honest = {s["peer_id"] for s in statuses}
    recs = hostile_rounds(statuses, honest)
    assert recs, f"the hostile peer never joined a group:\n{log}"
    by_round = {}
    for rec in recs:
        by_round.setdefault(rec["round"], []).append(rec)
    for rnd, pair in by_round.items():
        # both survivors took the same decision about the dead member's payload
        assert len({r["contributors"] for r in pair}) == 1, pair
        assert len({r["params_hash"] for r in pair}) == 1, pair
