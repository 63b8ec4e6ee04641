"""A swarm larger than one group stays one model (peer/round/merge.py): 4 real peers whose groups
hold at most 2 gather in two groups a round, and every round in which both groups merged each
other's set ends with one θ on all four."""

from __future__ import annotations

from collections import defaultdict

import pytest

from tests.support.swarm_harness import Swarm, TINY_SPEC

NAMES = ("a", "b", "c", "d")


def rounds_of_two_groups(statuses):
    """round -> (the groups, every peer's θ) for the rounds all four peers trained in groups of two."""
    records = defaultdict(dict)
    for s in statuses:
        for r in (s or {}).get("history", []):
            records[r["round"]][s["peer_id"]] = r
    out = {}
    for rnd, by_peer in records.items():
        groups = {tuple(r["group"]) for r in by_peer.values()}
        if len(by_peer) == 4 and len(groups) == 2 and all(len(g) == 2 for g in groups):
            out[rnd] = (groups, {p: r["params_hash"] for p, r in by_peer.items()}, [r["sets"] for r in by_peer.values()])
    return out


@pytest.mark.slow
def test_two_groups_of_a_round_end_it_with_one_theta(tmp_path):
    spec = TINY_SPEC.format(run_id="merge", strategy="sparseloco", inner_steps=10) + "max_group_size = 2\n"
    swarm = Swarm(tmp_path, spec_text=spec)
    try:
        for name in NAMES:
            swarm.add_peer(name, "--wait-peers", "4")

        def merged_rounds():
            return {rnd: v for rnd, v in rounds_of_two_groups([swarm.status(n) for n in NAMES]).items()
                    if all(sets == 2 for sets in v[2])}

        swarm.wait(lambda: len(merged_rounds()) >= 3, 420, "3 rounds of two groups that merged their sets")
        statuses = [swarm.status(n) for n in NAMES]
        for rnd, (groups, hashes, sets) in merged_rounds().items():
            assert len(set(hashes.values())) == 1, f"round {rnd}: groups {groups} ended with θ {hashes}"
        for s in statuses:  # a group's own members never disagree, merged or not
            assert all(len(r["group"]) <= 2 for r in s["history"])
    finally:
        swarm.close()


@pytest.mark.slow
def test_the_odd_peer_out_of_a_round_does_not_wait_out_round_wait(tmp_path):
    # 3 peers, groups of at most 2: each round one pair gathers and one peer is left over. With a
    # round_wait of 300 s, a leftover that waited for a group that can no longer form would stall
    # for 5 minutes; it gives up once both others have gathered and takes their next state instead.
    spec = (TINY_SPEC.replace("round_wait = 20.0", "round_wait = 300.0")
            .format(run_id="odd", strategy="sparseloco", inner_steps=10) + "max_group_size = 2\n")
    swarm = Swarm(tmp_path, spec_text=spec)
    names = NAMES[:3]
    try:
        for name in names:
            swarm.add_peer(name, "--wait-peers", "3")
        swarm.wait(lambda: min(swarm.round_of(n) for n in names) >= 5, 280,
                   "5 rounds on all three peers, though one of them is left without a group each round")
        logs = {n: swarm.peers[n].text() for n in names}
        assert any("every other peer of the round has gathered without us" in t for t in logs.values()), logs
        statuses = [swarm.status(n) for n in names]
        for s in statuses:
            assert all(len(r["group"]) <= 2 for r in s["history"])
        assert max(r["seconds"] for s in statuses for r in s["history"]) < 150
    finally:
        swarm.close()
