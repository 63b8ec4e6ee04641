"""How long a member of a group waits for its groupmates' lists of merged sets (peer/round/merge.py):
as long as a groupmate's merge may run where the round shows another group, the allowance where it
shows none, and a groupmate that left us waiting lately is not waited for long again."""

from __future__ import annotations

from peer.round.merge import merge_round
from protocol.round.timing import Timing
from tests.round.test_group_merge import Swarm, a_group, member_of, record
from tests.protocol.test_group_sets import ROUND


def test_a_groupmate_still_merging_is_waited_for_as_long_as_its_merge_may_run():
    # our view shows one peer of another group in the round, too few to gather: our merge ends at
    # once; a groupmate whose view showed that group gathering merges its set up to round_wait (and
    # more) later, and must be waited for
    mine, theirs = a_group(0, 2, b"g1"), a_group(2, 2, b"g2")
    mate = sorted(mine[2])[1]
    swarm = Swarm([[record(sorted(theirs[2])[0], state="training")]], {mate: {theirs[1]: theirs[0]}})
    waits = []

    def merged_by(ask, digest, round_no=None):
        waits.append(dict(ask))
        return {mate: tuple(sorted([mine[1], theirs[1]]))}

    swarm.merged_by = merged_by
    peer, result = member_of(swarm, mine)
    merged = merge_round(peer, ROUND, result, ready=[])
    assert merged.sets == 2 and merged.payloads == {**mine[2], **theirs[2]}
    assert waits[0][mate] >= Timing.from_spec(peer.spec).mate_merge_bound() - 1.0 > peer.spec.swarm.round_wait


def test_with_no_other_group_in_sight_a_silent_groupmate_costs_only_the_allowance():
    mine = a_group(0, 2, b"g1")
    mate = sorted(mine[2])[1]
    swarm = Swarm([[]], {})
    waits = []
    swarm.merged_by = lambda ask, digest, round_no=None: waits.append(dict(ask)) or {mate: None}
    peer, result = member_of(swarm, mine)
    assert merge_round(peer, ROUND, result, ready=[]).sets == 1
    assert waits[0][mate] < peer.spec.swarm.round_wait


def test_a_quiet_groupmate_is_waited_for_the_allowance_where_the_round_shows_another_group():
    mine, theirs = a_group(0, 2, b"g1"), a_group(2, 2, b"g2")
    mate = sorted(mine[2])[1]
    waits = []
    for view in ([record(sorted(theirs[2])[0], state="training")], []):
        swarm = Swarm([view], {}, allowance=3.0)
        swarm.merged_by = lambda ask, digest, round_no=None: waits.append(dict(ask)) or {mate: (mine[1],)}
        peer, result = member_of(swarm, mine)
        merge_round(peer, ROUND, result, ready=[], quiet={mate: ROUND + 3})
    assert waits[0][mate] >= 3.0 and waits[1][mate] == Timing.quiet_mate_s
