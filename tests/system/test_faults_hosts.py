"""Faults over real links (tests/support/fault_scenarios.py), in one swarm of peers on hosts of their own
(network namespaces on a bridge, tests/support/netns_hosts.py): a peer SIGKILLed mid-gather, a peer
SIGSTOPped past the round's deadline, a host's link down past it, two peers restarted at once and
a few SIGKILLs at random instants. Each must end with every member in one group with one θ, the
returning peers identical after their first round back, the survivors having trained on, and no
fault moving the gap between the validation loss and the undisturbed run's at equal tokens by
more than 5 % here (bench/faults.py: at most +2 %) (the faults share one swarm: the gap adds up); every
checkpoint must load.

The coordinator's restart, the late joiner and 100 random kills are bench/faults.py's. About six
minutes on a loaded 2-core machine. Needs root and ``ip netns``; skips cleanly without them.
"""

from __future__ import annotations

import pytest

from bench.faults import report, summary
from tests.support.fault_scenarios import run_faults
from tests.support.netns_hosts import needs_netns_fixture

pytestmark = pytest.mark.slow

SCENARIOS = ["kill_mid_gather", "sigstop", "link_down", "two_restarts", "random_kills"]

_needs_netns = needs_netns_fixture()


def test_survivors_train_on_and_returning_peers_rejoin_identical_through_each_fault(tmp_path):
    result = run_faults(tmp_path, SCENARIOS, kills=3)
    print(report(result), summary(result), sep="\n")
    rows = {r["scenario"]: r for r in result["rows"]}
    # groupmates apart for longer than the next rounds' start-hash checks, a checkpoint that does not load
    assert not result["problems"], result["problems"]
    assert result["groupmate_pairs_checked"] >= 20
    # a member cut off mid-gather may end a round alone, rarely (0-1 a run in this session's runs)
    assert len(result["repaired_splits"]) * 20 <= result["groupmate_pairs_checked"], result["repaired_splits"]
    for name in SCENARIOS:
        row = rows[name]
        assert "failed" not in row, row
        assert row["returning_ok"], row  # identical to its group after its first round back
        if name != "random_kills":
            assert row["survivor_rounds"] >= 1, row  # the others trained on meanwhile
        # what this fault added to the gap to the undisturbed run at equal tokens: bench/faults.py
        # judges it at the 2 %; with 3 kills and fewer rounds it moves by a few points from
        # run to run (-2.5 % to +1.4 % in one bench run), so the test allows 5 % either way: a
        # recovery that loses the swarm's progress shows far more
        assert abs(row["loss_cost"]) <= 0.05, row
    assert rows["kill_mid_gather"]["burst_bytes"] > 0, rows["kill_mid_gather"]  # it died while sending its payload
