"""The next round's group takes a late set into the last round's union, in a real swarm
(peer/round/union.py): 6 real peers whose merges never wait (tests/support/hasty_peer.py) gather
in groups of at most 3, so a group that gathers before another concludes the round without the
other's set. In the next round, a member that lacked a set two of its groupmates held fetches it,
concludes the round again, and ends on their θ, bit for bit, without a state download; so does a member
that finds the late set named in the view before the next round's matchmaking (``take_named_sets``)."""

from __future__ import annotations

import re

import pytest

from tests.support.swarm_harness import Swarm, TINY_SPEC

NAMES = ("a", "b", "c", "d", "e", "f")
TOOK = re.compile(r"round (\d+): took (\d+) set\(s\) of the round (?:that our group held|that another group named after "
                  r"our merge) into its union .*: "
                  r"θ ([0-9a-f]{16}) -> ([0-9a-f]{16})")


def takes(text: str):
    return [(int(m[1]), m[3], m[4]) for m in TOOK.finditer(text)]


@pytest.mark.slow
def test_a_member_that_lacked_a_late_set_takes_it_and_ends_on_its_groupmates_theta(tmp_path):
    spec = TINY_SPEC.format(run_id="union", strategy="sparseloco", inner_steps=10) + "max_group_size = 3\n"
    swarm = Swarm(tmp_path, spec_text=spec)
    try:
        for name in NAMES:
            swarm.add_peer(name, "--wait-peers", "6", module="tests.support.hasty_peer")

        def taken():
            return [(n, t) for n in NAMES for t in takes(swarm.peers[n].text())]

        def held_by_others(name, rnd, statuses):
            """Round rnd + 1's θ of every other peer (None: no record of it; it installed a state since)."""
            return {o: {r["round"]: r["params_hash"] for r in statuses[o]["history"]}.get(rnd + 1)
                    for o in NAMES if o != name}

        def apart(name, rnd):
            """Whether ``name`` said that the vote of round ``rnd`` outvoted its start."""
            return f"round {rnd}: this peer started from parameters" in swarm.peers[name].text()

        def counted(name, rnd, statuses):
            """Whether the statuses show ``name``'s take of round ``rnd`` whole: its records of rounds
            rnd + 1 and rnd + 2 (the status may have been written before the take, whose exchange writes
            record rnd + 2, or it installed a state since, its records from then gone), every peer two
            rounds on (a groupmate that took the same union writes it in its own next status)."""
            history = {r["round"] for r in statuses[name]["history"]}
            return rnd + 1 in history and rnd + 2 in history and min(statuses[o]["round"] for o in NAMES) > rnd + 2

        seen = {}

        def kept_take():
            """A take counted whole, whose θ another peer's record holds, and not outvoted in the next
            round's start vote (a vote may still outvote a take, see below: the wait goes on until one
            that kept on comes, which is what the test is about). The statuses it was judged on are kept."""
            statuses = {n: swarm.status(n) for n in NAMES}
            if any(s is None for s in statuses.values()):
                return False
            takes = taken()
            if any(counted(name, rnd, statuses) and new in held_by_others(name, rnd, statuses).values()
                   and not apart(name, rnd + 1) for name, (rnd, _, new) in takes):
                seen.update(statuses=statuses, takes=takes)
                return True
            return False

        swarm.wait(kept_take, 600, "a member taking a late set into a round's union, on its groupmates' θ, and keeping on")
        statuses = seen["statuses"]
        names_of = {statuses[n]["peer_id"]: n for n in NAMES}

        kept_on = 0  # takes after which the member's start counted with its group's (no state download)
        for name, (rnd, old, new) in seen["takes"]:
            if not counted(name, rnd, statuses):
                continue
            history = {r["round"]: r for r in statuses[name]["history"]}
            # the round's record (its θ, round rnd + 1's start) names the θ recomputed from the union
            assert history[rnd + 1]["params_hash"] == new, (name, rnd, history[rnd + 1])
            held = held_by_others(name, rnd, statuses)
            # the start vote of the next round counts it with the groupmates it now shares θ with; it may
            # still lose it (a group of several lineages, where its own is the smaller, or a groupmate whose
            # union grew too and that could not fetch a set in time), and then says so and downloads the
            # group's state
            outvoted = apart(name, rnd + 1)
            # round rnd + 1's group, as the record of its conclusion names it (absent: a state installed since)
            group = {names_of.get(m) for m in history.get(rnd + 2, {}).get("group", ())} | {name}
            # a groupmate that took the same union holds the same θ, unless it has no record of the round
            # left to show it (it installed a state since, dropping its later records); or the group's vote
            # was split and a member it outvoted downloaded the winner's state
            assert new in held.values() or None in held.values() or any(apart(m, rnd + 1) for m in group if m), (
                f"{name} recomputed round {rnd} to θ {new}, held by nobody else, and its group's vote was "
                f"not split: {held}")
            assert old != new
            kept_on += not outvoted
        assert kept_on >= 1, taken()
    finally:
        swarm.close()
