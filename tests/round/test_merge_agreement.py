"""peer/round/merge.agree_with_group: after the merge, a member asks its groupmates which sets they
merged, fetches a set one of them merged and it did not, and never waits long for a groupmate that
does not answer or a set nobody serves. The swarm of records and servers is tests/round/test_group_merge.py's."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Dict

from peer.round.merge import agree_with_group
from protocol.round.group_sets import union
from tests.protocol.test_group_sets import ROUND
from tests.round.test_group_merge import QUIET_WAIT_S, SKIP_ROUNDS, Swarm, a_group, member_of


def agree(peer, round_no, result, ready=(), quiet=None):
    """agree_with_group after a merge that held only our group's set (not wired into merge_round yet)."""
    held = {result.set_digest: dict(result.payloads)}
    agree_with_group(peer, round_no, result, held, {}, wait=0.5, quiet=quiet)
    payloads, _ = union(held[d] for d in sorted(held))
    return SimpleNamespace(sets=len(held), payloads=payloads)


def test_a_set_a_groupmate_merged_and_we_did_not_is_fetched_from_it():
    # our view never showed the other group's set in time; our groupmate's did, and it merged it
    mine, theirs = a_group(0, 2, b"g1"), a_group(2, 2, b"g2")
    mate = sorted(mine[2])[1]
    swarm = Swarm([[]], {mate: {theirs[1]: theirs[0]}})
    swarm.mates_merged = {mate: tuple(sorted([mine[1], theirs[1]]))}
    peer, result = member_of(swarm, mine)
    merged = agree(peer, ROUND, result, ready=[])
    assert merged.sets == 2 and merged.payloads == {**mine[2], **theirs[2]}
    assert swarm.asked == [mate]
    # what we tell our groupmates: first our own list, then the union we ended with
    assert swarm.offers == [(mine[1], (mine[1],)), (mine[1], tuple(sorted([mine[1], theirs[1]])))]


def test_a_set_named_by_a_groupmate_that_nobody_serves_changes_nothing():
    mine = a_group(0, 3, b"g1")
    mates = sorted(mine[2])[1:]
    swarm = Swarm([[]], {})
    swarm.mates_merged = {mates[0]: (mine[1], "f" * 32), mates[1]: None}  # one names a phantom, one never answers
    peer, result = member_of(swarm, mine)
    merged = agree(peer, ROUND, result, ready=[])
    assert merged.sets == 1 and merged.payloads == mine[2]
    assert swarm.asked == [mates[0]]  # asked once, for the phantom


def test_client_mode_groupmates_are_not_asked():
    mine = a_group(0, 2, b"g1")
    mate = sorted(mine[2])[1]
    swarm = Swarm([[]], {})
    asked = []
    swarm.merged_by = lambda waits, digest, round_no=None: asked.extend(waits) or {}
    peer, result = member_of(swarm, mine)
    result.unservable = frozenset([mate])
    agree(peer, ROUND, result, ready=[])
    assert asked == []


def test_a_groupmate_that_does_not_answer_is_not_waited_for_long_again_and_an_excluded_one_is_never_asked():
    mine = a_group(0, 3, b"g1")
    mate, silent = sorted(mine[2])[1:]
    swarm = Swarm([[]], {})
    waits, asked = [], []
    swarm.merged_by = lambda ask, digest, round_no=None: waits.append(dict(ask)) or asked.append(sorted(ask)) or {
        p: (None if p == silent else (mine[1],)) for p in ask}
    peer, result = member_of(swarm, mine)
    quiet: Dict[str, int] = {}
    agree(peer, ROUND, result, ready=[], quiet=quiet)
    assert quiet == {silent: ROUND + SKIP_ROUNDS} and min(waits[-1].values()) >= 1.0
    agree(peer, ROUND + 1, result, ready=[], quiet=quiet)
    assert waits[-1][silent] == QUIET_WAIT_S and waits[-1][mate] > QUIET_WAIT_S  # the others are waited for as before
    agree(peer, ROUND + SKIP_ROUNDS, result, ready=[], quiet={silent: ROUND + SKIP_ROUNDS})
    assert waits[-1][silent] > QUIET_WAIT_S  # forgiven after SKIP_ROUNDS
    result.payloads = {p: v for p, v in result.payloads.items() if p != silent}  # the group excluded it
    result.present = [p for p in result.present if p != silent]
    agree(peer, ROUND + 9, result, ready=[])
    assert asked[-1] == [mate]


def test_a_groupmate_listing_many_sets_nobody_serves_costs_one_failed_fetch():
    mine = a_group(0, 2, b"g1")
    mate = sorted(mine[2])[1]
    swarm = Swarm([[]], {})
    swarm.mates_merged = {mate: tuple(f"{i:032x}" for i in range(200))}
    peer, result = member_of(swarm, mine)
    merged = agree(peer, ROUND, result, ready=[])
    assert merged.sets == 1 and swarm.asked == [mate]



def test_a_groupmate_that_merges_another_set_is_asked_with_the_round_and_not_marked_quiet():
    """A member that took another set for the round answers () at once (peer/exchange/set_server.py
    ``rpc_merged``): nothing is fetched, and it is asked as any member next round."""
    mine = a_group(0, 2, b"g1")
    mate = sorted(mine[2])[1]
    swarm = Swarm([[]], {})
    rounds = []
    swarm.merged_by = lambda ask, digest, round_no=None: rounds.append(round_no) or {mate: ()}
    peer, result = member_of(swarm, mine)
    quiet: Dict[str, int] = {}
    merged = agree(peer, ROUND, result, ready=[], quiet=quiet)
    assert merged.sets == 1 and merged.payloads == mine[2]
    assert rounds == [ROUND] and quiet == {} and swarm.asked == []
