"""A peer whose gather of a round failed takes a set of its lineage (peer/round/merge.py
``adopt_own_set``, ``adopt_round_set``) even where its reads show the set's owners only after they
have moved on to the next round: what an earlier read showed of them is kept
(protocol/round/named_sets.py). A late joiner on a loaded host otherwise chased the swarm's state
for minutes (tests/round/test_liveness_swarm.py)."""

from __future__ import annotations

from types import SimpleNamespace

from peer.round.adopt import adopt_own_set, adopt_round_set, lineage_named
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
