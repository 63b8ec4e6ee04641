"""A peer that holds the swarm's θ with other lineage tables takes the swarm's state (peer/round/loop.py,
protocol/round/start_vote.py ``table_split``), in a real swarm: 3 peers, one of which
(tests/support/skewed_tables_peer.py) counts a sender in its standing table after round 1 that nobody
else counts. θ stays equal everywhere, so the start vote sees nothing; the state digest that the
progress records carry does. Without the check that peer kept its own tables for good, and they
weigh later rounds' contributions differently from everyone else's: a split of θ rounds later."""

from __future__ import annotations

import pytest

from tests.support.skewed_tables_peer import PHANTOM
from tests.support.swarm_harness import Swarm, TINY_SPEC

NOTICED = "with other standing and eligibility tables"


@pytest.mark.slow
def test_a_peer_whose_tables_alone_differ_takes_the_swarms_state(tmp_path):
    spec = TINY_SPEC.format(run_id="tables", strategy="sparseloco", inner_steps=10)
    swarm = Swarm(tmp_path, spec_text=spec)
    try:
        swarm.add_peer("a", "--wait-peers", "3")
        swarm.add_peer("b", "--wait-peers", "3")
        swarm.add_peer("c", "--wait-peers", "3", module="tests.support.skewed_tables_peer")
        swarm.wait(lambda: "skewed: counted" in swarm.peers["c"].text(), 300, "the skewed peer's tables parting after round 1")
        swarm.wait(lambda: NOTICED in swarm.peers["c"].text(), 180, "the skewed peer noticing its tables differ")

        def one_state():
            statuses = [swarm.status(n) for n in "abc"]
            if any(s is None or not s.get("state_digest") for s in statuses):
                return False
            states = {(s["round"], s["params_hash"], s["state_digest"]) for s in statuses}
            return len(states) == 1 and min(s["round"] for s in statuses) >= 4

        swarm.wait(one_state, 180, "all three peers on one round, θ and state digest")
        # the honest peers never took the skewed one's tables
        assert NOTICED not in swarm.peers["a"].text() and NOTICED not in swarm.peers["b"].text()
        assert PHANTOM not in swarm.peers["a"].text() + swarm.peers["b"].text()
    finally:
        swarm.close()
