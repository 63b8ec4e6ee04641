"""A member that joins groups and then holds every request (tests/support/hostile_exchange.py ``silent``)
among three honest peers on loopback: every group it joins stops waiting for it a grace after the
others' payloads came (protocol/round/fetch_clock.py), not at the gather's deadline; the group agrees it
sent nothing, and its matchmaking refuses it for a while; honest peers keep every honest update, end
every round on one θ and keep training. The pause of an overlapped peer's steps during that grace is
tests/round/test_pause_for_no_shows.py's; the refusal alone, tests/exchange/test_refused_peers.py's.
The member takes part in one round: once cut, its matchmaking is refused for minutes, and each
further round it asked for cost this test a 20 s matchmaking timeout (144 s in all for three)."""

from __future__ import annotations

import re

import pytest

from protocol.round.reconcile import SILENT
from tests.support.swarm_harness import assert_groups_identical, honest_swarm_with_liars

pytestmark = pytest.mark.slow

HONEST = ("a", "b", "c")


def test_a_silent_member_is_cut_a_grace_after_the_others_and_changes_nothing_else(tmp_path):
    statuses, logs, log = honest_swarm_with_liars(tmp_path, HONEST, 1, ["silent"], inner_steps=40)

    assert "LIED (silent)" in log, f"the silent member never joined a group:\n{log[-3000:]}"
    honest = {s["peer_id"] for s in statuses}
    attacked = [(s["peer_id"], rec) for s in statuses for rec in s["history"] if set(rec["group"]) - honest]
    assert attacked, "no round had the silent member in its group"
    assert assert_groups_identical(statuses) >= 3
    cut = set()
    ids = [s["peer_id"] for s in statuses]
    for peer, rec in attacked:
        (member,) = set(rec["group"]) - honest
        # left out: it sent nothing (it holds every request, even one that comes before it has opened
        # the group); no honest update was lost with it
        assert rec["excluded"].get(member) == SILENT, (peer, rec)
        assert not {m for m in rec["excluded"] if m in honest}, (peer, rec)
        # (a status record's round is the one its exchange concluded into: the gather's, plus one)
        if re.search(rf"round {rec['round'] - 1}: stopped waiting for the payload of {member}", logs[ids.index(peer)]):
            cut.add(rec["round"])
    # the members it held cut it a grace after the others' payloads came, not at the gather's deadline
    assert cut, f"no honest peer stopped waiting for the silent member: {attacked}"
    for s in statuses:
        assert s["val_loss"] < s["initial_val_loss"] - 0.05, (s["peer_id"], s["initial_val_loss"], s["val_loss"])
