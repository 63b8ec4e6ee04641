"""How long a member of a group waits (peer/round/merge.py): for its groupmates' lists of merged sets
as long as a groupmate's merge may run where the round shows another group, the allowance where it
shows none, and a groupmate that left us waiting lately is not waited for long again; for a stranger
of the round that sent nothing in a group whose set it holds, not at all."""

from __future__ import annotations

import time

from peer.round.merge import merge_round
from protocol.round.group_sets import pack_set, set_digest
from protocol.round.timing import Timing
from tests.round.test_group_merge import Swarm, a_group, b58, member_of, record
from tests.protocol.test_group_sets import ROUND, agreed_set
from tests.support.agreement_sim import signer


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


def test_a_stranger_that_sent_nothing_in_a_group_whose_set_we_hold_is_not_waited_for_but_a_peer_we_know_is():
    # the other group (keys 2-5) agreed the payloads of 2 and 3; 4 and 5 (new identities every round,
    # which join groups and send nothing) still say "ready" and name no set (two: one alone could form
    # no group, and is not waited for anyway). Its group's set is held:
    # no set of its own is coming, so a stranger is not waited for (6 honest peers and 3 such identities
    # waited round_wait for them in every round they met in two groups: bench/RESULTS.md). The binding
    # is signed by its group's owners only (2 and 3, peers we know), and a hostile group may name any
    # member: a peer we know is still waited for, and struck when it does not come
    mine, theirs, silent, view = _a_set_with_silent_members()
    owners = set(theirs[2])
    for known in (owners, owners | silent):
        swarm = Swarm([view], {sorted(theirs[2])[0]: {theirs[1]: theirs[0]}}, allowance=2.0)
        swarm.known_peers = known
        swarm.merged_by = lambda ask, digest, round_no=None: {p: None for p in ask}
        peer, result = member_of(swarm, mine)
        t0 = time.monotonic()
        merged = merge_round(peer, ROUND, result, ready=sorted(silent))
        took = time.monotonic() - t0
        assert merged.sets == 2 and merged.payloads == {**mine[2], **theirs[2]}
        if known & silent:
            assert swarm.no_shows == silent and took >= 2.0  # waited the allowance, then struck
        else:
            assert not swarm.no_shows and took < 2.0


def _a_set_with_silent_members(signed=(2, 3), silent=(4, 5)):
    """Our group (keys 0, 1); another (keys ``signed`` and ``silent``) whose set holds the payloads of
    ``signed`` only; the records of ``silent`` say "ready" and name no set."""
    mine = a_group(0, 2, b"g1")
    sent = {signer(i).peer_id: b"payload of %d" % i for i in signed}
    binding, envelopes, payloads = agreed_set(min(signed), len(signed) + len(silent), group_id=b"g2", payloads=sent)
    theirs = (pack_set(binding, envelopes), set_digest(binding.context, payloads), {b58(o): p for o, p in payloads.items()})
    quiet = {b58(signer(i).peer_id) for i in silent}
    view = [record(p, gathered=theirs[1]) for p in sorted(theirs[2])] + [record(p, state="ready") for p in sorted(quiet)]
    return mine, theirs, quiet, view


def test_a_binding_only_strangers_signed_vouches_for_nobody():
    # the same set, its owners (2, 3) new to us: its binding may list anyone (honest newcomers kept out
    # of our wait so), so 4 and 5 are waited for as any peer of the round; in our first round (we know
    # nobody but ourselves) a set most of whose members signed it still vouches: 3 of 5, not 2 of 4
    our_group = {b58(signer(0).peer_id), b58(signer(1).peer_id)}
    for known, signed, vouched in ((our_group, (2, 3), False), (set(), (2, 3), False), (set(), (2, 3, 4), True)):
        mine, theirs, silent, view = _a_set_with_silent_members(signed, (5, 6))
        swarm = Swarm([view], {sorted(theirs[2])[0]: {theirs[1]: theirs[0]}}, allowance=1.0)
        swarm.known_peers = known
        swarm.merged_by = lambda ask, digest, round_no=None: {p: None for p in ask}
        peer, result = member_of(swarm, mine)
        t0 = time.monotonic()
        assert merge_round(peer, ROUND, result, ready=sorted(silent)).sets == 2
        assert (time.monotonic() - t0 >= 1.0) is not vouched and (swarm.no_shows == silent) is not vouched, (known, signed)


def test_the_merge_waits_for_strangers_alone_what_the_budget_grants():
    # two new identities say they are exchanging the round and never name a set (a group of them that
    # never ends its gather: bench/hostile.py --attacks lurk-fresh held every honest merge to its
    # allowance, and two honest groups that stopped waiting at different times ended on two θ). With
    # the budget for strangers applying, the wait lasts what it grants, and is paid from it; with a
    # peer we know among them, the whole allowance
    mine = a_group(0, 2, b"g1")
    lurkers = {b58(signer(i).peer_id) for i in (6, 7)}
    view = [record(p) for p in sorted(lurkers)]
    for known, longest in ((set(), 0.3), ({sorted(lurkers)[0]}, None)):
        swarm = Swarm([view], {}, allowance=1.5)
        swarm.known_peers, swarm.stranger_grant = known, 0.3
        swarm.merged_by = lambda ask, digest, round_no=None: {p: None for p in ask}
        peer, result = member_of(swarm, mine)
        t0 = time.monotonic()
        assert merge_round(peer, ROUND, result, ready=[]).sets == 1
        took = time.monotonic() - t0
        if longest is None:
            assert took >= 1.5 and not swarm.paid_for_strangers
        else:
            assert 0.3 <= took < 1.0 and swarm.no_shows == lurkers
            assert len(swarm.paid_for_strangers) == 1 and 0.3 <= swarm.paid_for_strangers[0] < 1.0



def test_a_named_set_still_to_fetch_gets_the_whole_allowance_beside_strangers():
    # a group we know named its set and the first peer asked answered nothing for longer than the
    # strangers' grant: with only strangers left to wait for, the set is still asked of its other
    # owner (the grant cut it short, and that group ended the round on another θ: review)
    mine, theirs = a_group(0, 2, b"g1"), a_group(2, 2, b"g2")
    slow, other = sorted(theirs[2])
    lurkers = {b58(signer(i).peer_id) for i in (6, 7)}
    view = [record(p, gathered=theirs[1]) for p in (slow, other)] + [record(p) for p in sorted(lurkers)]
    swarm = Swarm([view], {other: {theirs[1]: theirs[0]}}, allowance=1.5)
    swarm.known_peers, swarm.stranger_grant = {slow, other}, 0.05
    swarm.merged_by = lambda ask, digest, round_no=None: {p: None for p in ask}
    served = swarm.fetch_set
    swarm.fetch_set = lambda peer, digest, timeout: time.sleep(0.4) if peer == slow else served(peer, digest, timeout)
    peer, result = member_of(swarm, mine)
    merged = merge_round(peer, ROUND, result, ready=[])
    assert merged.sets == 2 and merged.payloads == {**mine[2], **theirs[2]} and swarm.no_shows == lurkers
    assert len(swarm.paid_for_strangers) == 1 and swarm.paid_for_strangers[0] < 0.4  # only the wait for them alone


def test_strangers_that_leave_the_round_naming_no_set_were_waited_for_in_vain():
    # a group of new identities that gathers among themselves and names no set leaves the round once its
    # gather ends: the merge's wait for them ends then (nothing left to wait for), and is paid from the
    # budget all the same (unpaid, it held every merge the whole grant, ~18 s a round, in bench/hostile.py
    # --attacks silent-fresh against 6 honest peers)
    mine = a_group(0, 2, b"g1")
    lurkers = [record(b58(signer(i).peer_id)) for i in (6, 7)]
    swarm = Swarm([lurkers] * 4 + [[]], {}, allowance=3.0)
    swarm.stranger_grant = 2.0
    swarm.merged_by = lambda ask, digest, round_no=None: {p: None for p in ask}
    peer, result = member_of(swarm, mine)
    t0 = time.monotonic()
    assert merge_round(peer, ROUND, result, ready=[]).sets == 1
    took = time.monotonic() - t0
    assert took < 2.0 and not swarm.no_shows  # they left: nobody struck
    assert len(swarm.paid_for_strangers) == 1 and 0.0 < swarm.paid_for_strangers[0] <= took


def test_a_slow_fetch_of_a_set_a_peer_we_know_named_is_not_paid_by_the_strangers():
    # while two new identities lurk, a peer we know names its group's set a few reads in, and serves it
    # slowly (0.4 s): that fetch was not a wait for strangers alone, and is not paid from their budget
    mine, theirs = a_group(0, 2, b"g1"), a_group(2, 2, b"g2")
    lurkers = [record(b58(signer(i).peer_id)) for i in (6, 7)]
    late = [record(p, state="training") for p in sorted(theirs[2])]
    named = [record(p, gathered=theirs[1]) for p in sorted(theirs[2])]
    swarm = Swarm([lurkers + late] * 2 + [lurkers + named] * 3 + [named], dict.fromkeys(theirs[2], {theirs[1]: theirs[0]}),
                  allowance=3.0)
    swarm.known_peers, swarm.stranger_grant = set(theirs[2]), 5.0
    served = swarm.fetch_set
    swarm.fetch_set = lambda peer, digest, timeout: time.sleep(0.4) or served(peer, digest, timeout)
    swarm.merged_by = lambda ask, digest, round_no=None: {p: None for p in ask}
    peer, result = member_of(swarm, mine)
    merged = merge_round(peer, ROUND, result, ready=[])
    assert merged.sets == 2 and not swarm.no_shows
    assert sum(swarm.paid_for_strangers) < 0.4 + Timing.view_poll_s  # the lurkers' reads after the set came, not the fetch
