"""A peer whose gather of a round failed takes a set of the round (peer/round/adopt.py
``adopt_own_set``, ``adopt_round_set``): the one holding its payload, or its lineage's, and not a
set gathered on another θ; even where its reads show the set's owners only after they have moved on
to the next round: what an earlier read showed of them is kept (protocol/round/named_sets.py). A
late joiner on a loaded host otherwise chased the swarm's state for minutes
(tests/round/test_liveness_swarm.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from peer.round.adopt import adopt_own_set, adopt_round_set, lineage_named
from peer.round.merge import merge_round
from tests.round.test_group_merge import ROUND, Swarm, a_group, member_of, record

OURS = "c" * 16  # our θ of the round: the state we downloaded
SERVED = "e" * 32  # the set our server's group agreed the round before (the state's basis)


def _late_joiner(views):
    mine, theirs = a_group(0, 1, b"g0"), a_group(1, 3, b"g1")
    owners = sorted(theirs[2])
    swarm = Swarm(views(owners, theirs[1]), {owners[0]: {theirs[1]: theirs[0]}})
    swarm.known_peers = {owners[0]}  # its server: with standing in the state it downloaded
    peer, _ = member_of(swarm, mine)
    peer.peer_id, peer.gathered = sorted(mine[2])[0], (ROUND - 7, "d" * 32)  # an old lineage of its own
    return peer, swarm, mine, theirs


def _at_the_round(owners, name, start=OURS, before=SERVED):
    return [record(p, gathered=name, round_no=ROUND + 1, state="training", gathered_before=before,
                   gathered_from=start) for p in owners]


def _moved_on(owners, name):
    return [record(p, gathered="f" * 32, round_no=ROUND + 2, gathered_round=ROUND + 1, gathered_before=name,
                   gathered_from="9" * 16) for p in owners]


def test_a_peer_whose_gather_timed_out_takes_a_set_of_its_lineage():
    # its gather waited for a peer the others had given up on: no set holds its payload, but most of
    # the owners of the round's set applied it to the θ it downloaded
    peer, swarm, mine, theirs = _late_joiner(lambda owners, name: [_at_the_round(owners, name)])
    mine_payload = mine[2][peer.peer_id]
    assert adopt_own_set(peer, ROUND, mine_payload, OURS, wait_s=0.3) is None  # no lineage given: ours only
    result = adopt_own_set(peer, ROUND, mine_payload, OURS, wait_s=0.6, basis=(ROUND - 1, SERVED))
    assert result is not None and result.payloads == theirs[2] and result.set_digest == theirs[1]
    assert peer.peer_id not in result.payloads  # not ours: the round's update stays in the local buffers


def test_a_set_of_another_theta_is_not_taken_after_a_timeout():
    for start, before in (("9" * 16, SERVED), ("", "f" * 32)):  # another θ; or no θ said, another lineage
        peer, swarm, mine, _ = _late_joiner(lambda owners, name: [_at_the_round(owners, name, start, before)])
        assert adopt_own_set(peer, ROUND, mine[2][peer.peer_id], OURS, wait_s=0.3, basis=(ROUND - 1, SERVED)) is None


def test_owners_read_at_the_round_earlier_still_vouch_once_their_records_moved_on():
    # the barrier's read saw the owners at the round; by the time the set is judged their records name
    # the next round's set and θ: what the earlier read showed decides
    for adopt in (lambda peer, mine: adopt_round_set(peer, ROUND, OURS, wait_s=0.6, basis=(ROUND - 1, SERVED)),
                  lambda peer, mine: adopt_own_set(peer, ROUND, mine[2][peer.peer_id], OURS, wait_s=0.6,
                                                   basis=(ROUND - 1, SERVED))):
        peer, swarm, mine, theirs = _late_joiner(lambda owners, name: [_at_the_round(owners, name), _moved_on(owners, name)])
        swarm.view()  # a read before the gather failed (the barrier's)
        result = adopt(peer, mine)
        assert result is not None and result.payloads == theirs[2]
        # never read at the round: nothing vouches for the set
        peer, swarm, mine, theirs = _late_joiner(lambda owners, name: [_moved_on(owners, name)])
        assert adopt(peer, mine) is None and swarm.asked  # fetched, and judged not of our lineage


def test_a_set_fetched_is_judged_again_as_its_owners_records_come_in():
    # the first read names the set before its owners' records say which θ it was applied to
    def views(owners, name):
        unsaid = [record(p, gathered=name, round_no=ROUND + 1, state="training") for p in owners]
        return [unsaid, unsaid, _at_the_round(owners, name)]
    peer, swarm, mine, theirs = _late_joiner(views)
    result = adopt_round_set(peer, ROUND, OURS, wait_s=1.5, basis=(ROUND - 1, SERVED))
    assert result is not None and result.payloads == theirs[2]
    assert len(swarm.asked) == 1  # fetched once, judged at each read


def test_new_identities_claiming_our_theta_do_not_make_us_take_their_set():
    # owners none of which we know, whose records say their set was applied to our θ (a claim anyone
    # reading our record can make): fetched, and not taken
    peer, swarm, mine, theirs = _late_joiner(lambda owners, name: [_at_the_round(owners, name)])
    swarm.known_peers = set()
    assert adopt_round_set(peer, ROUND, OURS, wait_s=0.3, basis=(ROUND - 1, SERVED)) is None
    assert adopt_own_set(peer, ROUND, mine[2][peer.peer_id], OURS, wait_s=0.3, basis=(ROUND - 1, SERVED)) is None
    assert swarm.asked  # judged, not skipped
    peer.engine.standing = {sorted(theirs[2])[1]: 1}  # one owner with standing in our θ's lineage: taken
    assert adopt_round_set(peer, ROUND, OURS, wait_s=0.6, basis=(ROUND - 1, SERVED)) is not None


def test_a_set_holding_our_payload_comes_before_a_set_of_our_lineage():
    ours, theirs = a_group(0, 2, b"g0"), a_group(2, 3, b"g1")
    me, mate = sorted(ours[2])
    owners = sorted(theirs[2])
    views = _at_the_round(owners, theirs[1]) + [record(mate, gathered=ours[1], round_no=ROUND + 1, state="training")]
    swarm = Swarm([views], {owners[0]: {theirs[1]: theirs[0]}, mate: {ours[1]: ours[0]}})
    swarm.known_peers = {owners[0]}
    peer, _ = member_of(swarm, ours)
    peer.peer_id = me
    result = adopt_own_set(peer, ROUND, ours[2][me], OURS, wait_s=1.0, basis=(ROUND - 1, SERVED))
    assert result is not None and result.set_digest == ours[1] and me in result.payloads


def test_a_claim_made_during_the_owners_merge_counts_only_once_they_concluded_the_round():
    # read mid-merge (the round not concluded: a start vote lost after withdraws the θ), then moved on
    def views(owners, name):
        merging = [record(p, gathered=name, round_no=ROUND, state="exchanging", gathered_before=SERVED,
                          gathered_from=OURS) for p in owners]
        return [merging, _moved_on(owners, name)]
    peer, swarm, mine, theirs = _late_joiner(views)
    swarm.view()
    assert adopt_round_set(peer, ROUND, OURS, wait_s=0.3, basis=(ROUND - 1, SERVED)) is None


def test_the_barrier_takes_the_set_path_only_where_a_peer_we_know_names_one():
    def peer_seeing(named_by, known):
        records = [record(p, gathered="1" * 32, round_no=ROUND + 1, state="training") for p in named_by]
        membership = SimpleNamespace(others=lambda: records, known=lambda: frozenset(known))
        return SimpleNamespace(membership=membership, engine=SimpleNamespace(standing={}),
                               role=SimpleNamespace(progress_part=-1))
    assert lineage_named(peer_seeing(["x", "y"], {"x"}), ROUND)
    assert not lineage_named(peer_seeing(["x", "y"], {"z"}), ROUND)  # strangers' sets: defer at once
    assert lineage_named(peer_seeing(["x"], set()), ROUND, lineage=["x"])  # last round's groupmate
    assert not lineage_named(peer_seeing(["x"], {"x"}), ROUND + 1)  # a set of another round


def test_a_set_one_namer_does_not_serve_is_asked_of_another():
    # a stranger names the round's set first in the view and serves nothing: the owner we know is
    # asked first, and were it to fail, the others naming the set would be asked in turn
    peer, swarm, mine, theirs = _late_joiner(lambda owners, name: [
        [record("stranger", gathered=name, round_no=ROUND + 1, state="training")] + _at_the_round(owners, name)])
    owners = sorted(theirs[2])
    result = adopt_round_set(peer, ROUND, OURS, wait_s=1.0, basis=(ROUND - 1, SERVED))
    assert result is not None and swarm.asked == [owners[0]]
    # the owner we know does not serve it either (swarm.serves: another owner does)
    swarm.serves = {owners[2]: swarm.serves[owners[0]]}
    swarm.asked.clear()
    result = adopt_round_set(peer, ROUND, OURS, wait_s=1.0, basis=(ROUND - 1, SERVED))
    assert result is not None and swarm.asked[0] == owners[0] and owners[2] in swarm.asked


# ---- the set taken after a failed gather, from records that still name it --------------------------
def test_a_member_whose_gather_failed_takes_the_set_its_group_completed_with_its_payload():
    ours, theirs = a_group(0, 3, b"g1"), a_group(3, 3, b"g2")
    me, mates = sorted(ours[2])[0], sorted(ours[2])[1:]
    others = sorted(theirs[2])
    views = [record(p, gathered=theirs[1], round_no=ROUND + 1, state="training") for p in others] + [
        record(mates[0], gathered=ours[1], round_no=ROUND + 1, state="training")]
    swarm = Swarm([views], {others[0]: {theirs[1]: theirs[0]}, mates[0]: {ours[1]: ours[0]}})
    peer, _ = member_of(swarm, ours)
    peer.peer_id = me
    result = adopt_own_set(peer, ROUND, ours[2][me], "c" * 16, wait_s=1.0)
    assert result is not None and result.payloads == ours[2] and result.set_digest == ours[1]
    assert result.group == sorted(ours[2]) and result.start_hashes == {me: "c" * 16} and not result.excluded
    # then merged with the other group's set, as any member's
    merged = merge_round(peer, ROUND, result, ready=[])
    assert merged.payloads == {**ours[2], **theirs[2]}


def test_a_failed_member_whose_payload_is_in_no_set_defers_the_round():
    ours, theirs = a_group(0, 3, b"g1"), a_group(3, 3, b"g2")
    me = sorted(ours[2])[0]
    others = sorted(theirs[2])
    swarm = Swarm([[record(p, gathered=theirs[1], round_no=ROUND + 1) for p in others]], {others[0]: {theirs[1]: theirs[0]}})
    peer, _ = member_of(swarm, ours)
    peer.peer_id = me
    t0 = time.monotonic()
    assert adopt_own_set(peer, ROUND, ours[2][me], "c" * 16, wait_s=0.5) is None
    assert adopt_own_set(peer, ROUND, b"another payload of ours", "c" * 16, wait_s=0.3) is None
    assert time.monotonic() - t0 < 2.0 and swarm.asked == [others[0]] * 2  # once a call, however long it waits


def test_a_peer_the_round_gathered_without_takes_a_named_set_and_merges_the_rest():
    # two groups gathered without us; we take one's set (as if our payload had been left out), then the
    # other's is merged as by any member: the same union, so the same θ, without downloading the state
    mine, g1, g2 = a_group(0, 1, b"g0"), a_group(1, 2, b"g1"), a_group(3, 2, b"g2")
    me = sorted(mine[2])[0]
    first, second = sorted(g1[2]), sorted(g2[2])
    before = "e" * 32  # the set our group (we and g1's members) agreed in the round before
    views = ([record(p, gathered=g1[1], round_no=ROUND + 1, state="training", gathered_before=before) for p in first]
             + [record(p, gathered=g2[1], round_no=ROUND + 1, state="training") for p in second])
    swarm = Swarm([views], {first[0]: {g1[1]: g1[0]}, second[0]: {g2[1]: g2[0]}})
    peer, _ = member_of(swarm, mine)
    peer.peer_id, peer.gathered = me, (ROUND - 1, before)
    assert adopt_round_set(peer, ROUND, "c" * 16, wait_s=0.3) is None  # no groupmate of our last round in either
    assert adopt_round_set(peer, ROUND, "c" * 16, wait_s=0.3, lineage=[first[1]]) is None  # one of two owners
    result = adopt_round_set(peer, ROUND, "c" * 16, wait_s=1.0, lineage=first)
    assert result is not None and result.payloads == g1[2]
    assert result.start_hashes == {me: "c" * 16} and not result.excluded
    merged = merge_round(peer, ROUND, result, ready=[])
    assert merged.payloads == {**g1[2], **g2[2]} and me not in merged.payloads


def test_a_groupmate_that_agreed_another_set_last_round_is_not_of_our_lineage():
    # b's link goes down during a round's gather: b decides the round with a set of its own, its
    # groupmates with theirs. Taking their set onto b's θ in the next round would give b a θ nobody
    # holds (repaired only rounds later). Only groupmates whose records name our set of the round
    # before count.
    mine, g1 = a_group(0, 1, b"g0"), a_group(1, 3, b"g1")
    me, first = sorted(mine[2])[0], sorted(g1[2])
    ours, theirs = "e" * 32, "f" * 32
    for mates_before, gathered in [(theirs, (ROUND - 1, ours)),  # they agreed another set than ours
                                   ("", (ROUND - 1, ours)),  # their records no longer name that round
                                   (ours, (ROUND - 2, ours)),  # our last set is older than the round before
                                   (ours, (ROUND - 1, ""))]:
        views = [record(p, gathered=g1[1], round_no=ROUND + 1, state="training", gathered_before=mates_before)
                 for p in first]
        peer, _ = member_of(Swarm([views], {first[0]: {g1[1]: g1[0]}}), mine)
        peer.peer_id, peer.gathered = me, gathered
        assert adopt_round_set(peer, ROUND, "c" * 16, wait_s=0.3, lineage=first) is None, (mates_before, gathered)
    # two of three owners of the set agreed ours: most of its owners are of our lineage
    views = [record(p, gathered=g1[1], round_no=ROUND + 1, state="training", gathered_before=b)
             for p, b in zip(first, (ours, ours, theirs))]
    peer, _ = member_of(Swarm([views], {first[0]: {g1[1]: g1[0]}}), mine)
    peer.peer_id, peer.gathered = me, (ROUND - 1, ours)
    result = adopt_round_set(peer, ROUND, "c" * 16, wait_s=1.0, lineage=first)
    assert result is not None and result.payloads == g1[2]


def test_a_peer_that_installed_a_state_takes_the_set_of_its_servers_lineage():
    # its θ of the round came from a download: no groupmates, and peer.gathered is of a lineage it left.
    # The peers naming the set its server's group agreed the round before are its lineage (Basis);
    # most owners of the round's set must be of it, as for groupmates
    mine, g1 = a_group(0, 1, b"g0"), a_group(1, 3, b"g1")
    me, first = sorted(mine[2])[0], sorted(g1[2])
    served, other = "e" * 32, "f" * 32
    for befores, ok in [((served, served, other), True),  # two of three owners concluded from the served set
                        ((served, other, other), False),  # one of three
                        (("", "", ""), False)]:  # their records no longer name the round before
        views = [record(p, gathered=g1[1], round_no=ROUND + 1, state="training", gathered_before=b)
                 for p, b in zip(first, befores)]
        swarm = Swarm([views], {first[0]: {g1[1]: g1[0]}})
        swarm.known_peers = {first[0]}  # (the server: an owner we may take a set from, test_adopt_lineage.py)
        peer, _ = member_of(swarm, mine)
        peer.peer_id, peer.gathered = me, (ROUND - 7, "d" * 32)  # an old lineage of its own
        assert adopt_round_set(peer, ROUND, "c" * 16, wait_s=0.3, lineage=[]) is None  # without the basis: none
        swarm.asked.clear()
        result = adopt_round_set(peer, ROUND, "c" * 16, wait_s=0.6 if ok else 0.3, basis=(ROUND - 1, served))
        assert (result is not None and result.payloads == g1[2]) == ok, befores
        assert swarm.asked == [first[0]], swarm.asked  # fetched and judged by its owners, not skipped
    # a basis of another round than the one before is no lineage
    swarm = Swarm([[record(p, gathered=g1[1], round_no=ROUND + 1, state="training", gathered_before=served)
                    for p in first]], {first[0]: {g1[1]: g1[0]}})
    swarm.known_peers = {first[0]}
    peer, _ = member_of(swarm, mine)
    peer.peer_id = me
    assert adopt_round_set(peer, ROUND, "c" * 16, wait_s=0.3, basis=(ROUND - 2, served)) is None


def test_a_peer_takes_a_set_whose_owners_applied_it_to_its_own_theta():
    # a downloaded state of a swarm of many groups: the set's owners were in other groups than the
    # server the round before, but their records say the round's set was applied to our θ
    mine, g1 = a_group(0, 1, b"g0"), a_group(1, 3, b"g1")
    me, first = sorted(mine[2])[0], sorted(g1[2])
    ours, theirs = "c" * 16, "9" * 16
    for froms, ok in [((ours, ours, theirs), True),  # two of three owners started the round from our θ
                      ((ours, theirs, theirs), False),  # one of three
                      (("", "", ""), False)]:  # records that do not say (an older peer's)
        views = [record(p, gathered=g1[1], round_no=ROUND + 1, state="training", gathered_before="f" * 32,
                        gathered_from=f) for p, f in zip(first, froms)]
        swarm = Swarm([views], {first[0]: {g1[1]: g1[0]}})
        swarm.known_peers = {first[0]}  # (the server: an owner we may take a set from, test_adopt_lineage.py)
        peer, _ = member_of(swarm, mine)
        peer.peer_id, peer.gathered = me, (ROUND - 7, "d" * 32)
        result = adopt_round_set(peer, ROUND, ours, wait_s=0.6 if ok else 0.3, basis=(ROUND - 1, "e" * 32))
        assert (result is not None and result.payloads == g1[2]) == ok, froms
        # the same holds for a peer whose lineage is its last round's groupmates (none of them here)
        swarm.asked.clear()
        result = adopt_round_set(peer, ROUND, ours, wait_s=0.6 if ok else 0.3, lineage=[])
        assert (result is not None) == ok, froms
    # a record that has moved on names the round's set as the one before, and its θ is the next round's
    later = [record(p, gathered="f" * 32, round_no=ROUND + 2, gathered_round=ROUND + 1, gathered_before=g1[1],
                    gathered_from=ours) for p in first]
    swarm = Swarm([later], {first[0]: {g1[1]: g1[0]}})
    swarm.known_peers = {first[0]}
    peer, _ = member_of(swarm, mine)
    peer.peer_id = me
    assert adopt_round_set(peer, ROUND, ours, wait_s=0.3, basis=(ROUND - 1, "e" * 32)) is None
    assert swarm.asked == [first[0]]  # fetched, and judged not of our lineage
    # owners that say our θ but name another set than the one offered do not vouch for it
    elsewhere = [record(p, gathered="f" * 32, round_no=ROUND + 1, gathered_from=ours) for p in first[1:]]
    swarm = Swarm([[record(first[0], gathered=g1[1], round_no=ROUND + 1, gathered_from=ours)] + elsewhere],
                  {first[0]: {g1[1]: g1[0]}})
    swarm.known_peers = {first[0]}
    peer, _ = member_of(swarm, mine)
    peer.peer_id = me
    assert adopt_round_set(peer, ROUND, ours, wait_s=0.3, basis=(ROUND - 1, "e" * 32)) is None
    # a last round's groupmate whose record names another θ for this round is no longer of our lineage
    mates = [record(p, gathered=g1[1], round_no=ROUND + 1, gathered_before="e" * 32, gathered_from=theirs) for p in first]
    peer, _ = member_of(Swarm([mates], {first[0]: {g1[1]: g1[0]}}), mine)
    peer.peer_id, peer.gathered = me, (ROUND - 1, "e" * 32)
    assert adopt_round_set(peer, ROUND, ours, wait_s=0.3, lineage=first) is None
    older = [record(p, gathered=g1[1], round_no=ROUND + 1, gathered_before="e" * 32) for p in first]  # says no θ
    peer, _ = member_of(Swarm([older], {first[0]: {g1[1]: g1[0]}}), mine)
    peer.peer_id, peer.gathered = me, (ROUND - 1, "e" * 32)
    assert adopt_round_set(peer, ROUND, ours, wait_s=0.6, lineage=first) is not None


def test_a_peer_the_round_gathered_without_defers_when_no_named_set_can_be_had():
    mine, theirs = a_group(0, 1, b"g0"), a_group(1, 2, b"g1")
    others = sorted(theirs[2])
    swarm = Swarm([[record(p, gathered=theirs[1], round_no=ROUND + 1) for p in others]], {})  # nobody serves it
    peer, _ = member_of(swarm, mine)
    peer.peer_id = sorted(mine[2])[0]
    assert adopt_round_set(peer, ROUND, "c" * 16, wait_s=0.3, lineage=others) is None
