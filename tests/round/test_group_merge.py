"""peer/round/merge.py against a swarm's records: a member waits for the round's other groups to
name their sets, fetches each from a peer that named it (another when one serves a bad set),
merges them, and never waits past its allowance for a set that does not come."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Dict, List, Optional

from hivemind.p2p import PeerID

from peer.round.adopt import adopt_own_set, adopt_round_set
from peer.round.merge import merge_round, no_group_left
from protocol.round.group_sets import pack_set, set_digest
from protocol.dht.records import Progress
from protocol.round.named_sets import NamedSets
from protocol.round.timing import Timing
from tests.support.agreement_sim import MAX_PAYLOAD, RUN, signer
from tests.protocol.test_group_sets import ROUND, agreed_set


def b58(owner: bytes) -> str:
    return PeerID(owner).to_base58()


def a_group(first: int, n: int, group_id: bytes):
    binding, envelopes, payloads = agreed_set(first, n, group_id=group_id)
    return pack_set(binding, envelopes), set_digest(binding.context, payloads), {b58(o): p for o, p in payloads.items()}


def record(peer: str, state: str = "exchanging", gathered: str = "", round_no: int = ROUND, start: str = "a" * 16,
           gathered_round: Optional[int] = None, gathered_before: str = "", gathered_from: str = ""):
    if gathered_round is None:
        gathered_round = ROUND if gathered else 0
    progress = Progress(round=round_no, step=0, state=state, spec="", loss=0.0, val_loss=0.0, tokens=0, tokens_per_s=0.0,
                        bytes_sent=0, bytes_received=0, params_hash=start, part=-1, gathered_round=gathered_round,
                        gathered=gathered, gathered_before=gathered_before, gathered_from=gathered_from)
    return SimpleNamespace(peer_id=peer, progress=progress)


QUIET_WAIT_S, SKIP_ROUNDS = Timing.quiet_mate_s, Timing.merge_skip_rounds  # the merge's defaults


class Swarm:
    """The records a member reads (``views`` in turn, the last one for ever) and the sets peers serve."""

    def __init__(self, views: List[list], serves: Dict[str, Dict[str, bytes]], allowance: float = 1.0):
        self.views, self.serves, self.allowance = views, serves, allowance
        self.no_shows: set = set()
        self.known_peers: set = set()  # no strangers to this member (Membership.known)
        self.asked: List[str] = []
        self.published = 0
        self.read_began = float("-inf")
        self.mates_merged: Dict[str, Optional[tuple]] = {}  # groupmate -> the sets it says it merged
        self.offers: List[tuple] = []
        self.named_sets = NamedSets()  # Membership's memory of what the records read named

    # membership
    def view(self):
        self.read_began = time.monotonic()  # every call reads afresh
        view = self.views.pop(0) if len(self.views) > 1 else self.views[0]
        self.named_sets.note(view)
        return view

    def publish(self):
        self.published += 1

    def missed(self, peers, round_no):
        self.no_shows |= set(peers)

    def straggler_allowance(self) -> float:
        return self.allowance

    me: str = ""  # set by member_of: Membership.known counts ourselves

    def known(self) -> frozenset:
        return frozenset(self.known_peers | {self.me})

    stranger_grant: Optional[float] = None  # where set: the budget for strangers applies and grants this
    paid_for_strangers: List[float] = []

    def strangers_wait(self, peers) -> Optional[float]:
        return None if self.stranger_grant is None or set(peers) & self.known_peers else self.stranger_grant

    def waited_for_strangers(self, seconds: float) -> None:
        self.paid_for_strangers = [*self.paid_for_strangers, seconds]

    # gatherer
    run_digest, max_payload_bytes = RUN, MAX_PAYLOAD

    def fetch_set(self, peer: str, digest: str, timeout: float) -> Optional[bytes]:
        self.asked.append(peer)
        return self.serves.get(peer, {}).get(digest)

    def keep_checked_set(self, peer: str, digest: str) -> None:
        self.checked = [*getattr(self, "checked", []), (peer, digest)]

    def offer_merged(self, set_digest: str, members, names) -> None:
        self.offers.append((set_digest, tuple(names)))

    def merged_by(self, waits, set_digest: str, round_no=None):
        return {p: self.mates_merged.get(p) for p in waits}


def member_of(swarm: Swarm, mine):
    packed, digest, payloads = mine
    spec = SimpleNamespace(swarm=SimpleNamespace(matchmaking_time=0.1, gather_timeout=0.1, round_wait=10.0, heartbeat_period=0.5,
                                                 max_group_size=16, min_group_size=2))
    swarm.timing, swarm.me = Timing.from_spec(spec), sorted(payloads)[0]
    peer = SimpleNamespace(membership=swarm, gatherer=swarm, spec=spec, stop_event=threading.Event(),
                           role=SimpleNamespace(progress_part=-1), gathered=(0, ""), peer_id=sorted(payloads)[0],
                           engine=SimpleNamespace(params_hash=lambda: "a" * 16, standing={}))
    result = SimpleNamespace(group=sorted(payloads), present=sorted(payloads), payloads=payloads, set_digest=digest, unservable=frozenset())
    return peer, result


def test_two_groups_merge_into_the_union_of_their_sets():
    mine, theirs = a_group(0, 4, b"g1"), a_group(4, 4, b"g2")
    others = sorted(theirs[2])
    swarm = Swarm([[record(p) for p in others], [record(p, gathered=theirs[1], start="b" * 16) for p in others]],
                  {others[0]: {theirs[1]: theirs[0]}})
    peer, result = member_of(swarm, mine)
    merged = merge_round(peer, ROUND, result, ready=others)
    assert merged.payloads == {**mine[2], **theirs[2]} and merged.sets == 2 and not merged.excluded
    assert peer.gathered == (ROUND, mine[1]) and swarm.published == 1
    assert swarm.asked == [others[0]]  # one fetch of the set, however many named it


def test_a_late_group_finds_the_set_of_peers_that_already_named_the_next_rounds():
    # 32 peers on 2 cores: a pair merged, trained on and named its round-2 set before a trio of round 1
    # finished gathering; the trio must still find the pair's round-1 set, now the record's gathered_before
    mine, theirs, later = a_group(0, 3, b"g1"), a_group(3, 2, b"g2"), a_group(3, 2, b"g3")
    others = sorted(theirs[2])
    moved_on = [record(p, state="training", round_no=ROUND + 2, gathered=later[1], gathered_round=ROUND + 1,
                       gathered_before=theirs[1]) for p in others]
    swarm = Swarm([moved_on], {others[0]: {theirs[1]: theirs[0]}})
    peer, result = member_of(swarm, mine)
    peer.gathered = (ROUND - 1, "c" * 32)
    merged = merge_round(peer, ROUND, result, ready=others)
    assert merged.payloads == {**mine[2], **theirs[2]} and merged.sets == 2
    assert peer.gathered == (ROUND, mine[1]) and peer.gathered_before == "c" * 32  # what our record names now
    # a set two rounds back is not this round's: never fetched for it
    gone = [record(p, state="training", round_no=ROUND + 3, gathered=later[1], gathered_round=ROUND + 2,
                   gathered_before=theirs[1]) for p in others]
    swarm = Swarm([gone], {others[0]: {theirs[1]: theirs[0]}})
    peer, result = member_of(swarm, mine)
    assert merge_round(peer, ROUND, result, ready=others).sets == 1 and swarm.asked == []
    assert peer.gathered_before == ""  # our group agreed no set the round before


def test_a_bad_set_from_one_peer_is_refused_and_another_peer_serves_the_named_one():
    mine, theirs, forged = a_group(0, 3, b"g1"), a_group(3, 3, b"g2"), a_group(6, 3, b"g3")
    others = sorted(theirs[2])
    swarm = Swarm([[record(p, gathered=theirs[1]) for p in others]],
                  {others[0]: {theirs[1]: forged[0]}, others[1]: {theirs[1]: theirs[0]}})
    peer, result = member_of(swarm, mine)
    merged = merge_round(peer, ROUND, result, ready=others)
    assert merged.payloads == {**mine[2], **theirs[2]}
    assert swarm.asked == [others[0], others[1]]


def test_peers_that_never_name_a_set_are_waited_for_only_the_allowance():
    mine = a_group(0, 3, b"g1")
    silent = [b58(signer(9).peer_id), b58(signer(10).peer_id)]  # two of them could have made a group
    swarm = Swarm([[record(p) for p in silent]], {}, allowance=0.5)
    peer, result = member_of(swarm, mine)
    t0 = time.monotonic()
    merged = merge_round(peer, ROUND, result, ready=silent)
    assert merged.payloads == mine[2] and merged.sets == 1
    assert 0.5 <= time.monotonic() - t0 < 3.0


def test_one_ready_peer_outside_every_group_is_not_waited_for():
    mine = a_group(0, 3, b"g1")
    late = b58(signer(9).peer_id)  # alone it can make no group: it will find none and catch up
    swarm = Swarm([[record(late)]], {}, allowance=5.0)
    peer, result = member_of(swarm, mine)
    t0 = time.monotonic()
    merge_round(peer, ROUND, result, ready=[late])
    assert time.monotonic() - t0 < 1.0


def test_nobody_else_in_the_round_ends_the_merge_at_once():
    mine = a_group(0, 3, b"g1")
    swarm = Swarm([[]], {})
    peer, result = member_of(swarm, mine)
    t0 = time.monotonic()
    merged = merge_round(peer, ROUND, result, ready=[])
    assert merged.payloads == mine[2] and time.monotonic() - t0 < 0.5 and swarm.asked == []


def test_a_peer_that_leaves_the_exchange_is_not_waited_for_and_a_set_named_later_still_counts():
    mine, theirs = a_group(0, 3, b"g1"), a_group(3, 3, b"g2")
    others = sorted(theirs[2])
    gone = b58(signer(9).peer_id)
    later = [record(p) for p in others] + [record(gone)]
    named = [record(p, gathered=theirs[1], round_no=ROUND + 1, state="training") for p in others] + [
        record(gone, state="training")]  # found no group: back to training, named nothing
    swarm = Swarm([later, later, named], {others[2]: {theirs[1]: theirs[0]}}, allowance=5.0)
    swarm.serves.update({o: {theirs[1]: theirs[0]} for o in others})
    peer, result = member_of(swarm, mine)
    t0 = time.monotonic()
    merged = merge_round(peer, ROUND, result, ready=others + [gone])
    assert merged.sets == 2 and merged.payloads == {**mine[2], **theirs[2]}
    assert time.monotonic() - t0 < 3.0


def test_peers_waited_for_in_vain_are_not_waited_for_the_next_rounds():
    mine = a_group(0, 3, b"g1")
    silent = [b58(signer(9).peer_id), b58(signer(10).peer_id)]
    swarm = Swarm([[record(p) for p in silent]], {}, allowance=0.5)
    peer, result = member_of(swarm, mine)
    skip: dict = {}
    merge_round(peer, ROUND, result, ready=silent, skip=skip)
    assert skip == {p: ROUND + 8 for p in silent}
    swarm.views = [[record(p, round_no=ROUND + 1) for p in silent]]  # they claim to be ready again the next round
    t0 = time.monotonic()
    merge_round(peer, ROUND + 1, result, ready=silent, skip=skip)
    assert time.monotonic() - t0 < 0.5


def test_a_group_still_training_the_round_is_waited_for_and_its_set_merged():
    # the round's other group came from the round before and still trains when our group has gathered:
    # a groupmate that read it a moment later as ready merges its set, so we must wait for it too
    mine, theirs = a_group(0, 3, b"g1"), a_group(3, 3, b"g2")
    others = sorted(theirs[2])
    training = [record(p, state="training") for p in others]
    swarm = Swarm([training, training, training, [record(p, gathered=theirs[1]) for p in others]],
                  {others[0]: {theirs[1]: theirs[0]}}, allowance=5.0)
    peer, result = member_of(swarm, mine)
    merged = merge_round(peer, ROUND, result, ready=[])
    assert merged.sets == 2 and merged.payloads == {**mine[2], **theirs[2]}


def test_peers_the_barrier_gave_up_on_are_not_waited_for_again():
    mine = a_group(0, 3, b"g1")
    stalled = [b58(signer(9).peer_id), b58(signer(10).peer_id)]  # they claim to train the round, and never come
    swarm = Swarm([[record(p, state="training") for p in stalled]], {}, allowance=5.0)
    peer, result = member_of(swarm, mine)
    t0 = time.monotonic()
    merged = merge_round(peer, ROUND, result, ready=[], gave_up=stalled)
    assert merged.sets == 1 and time.monotonic() - t0 < 1.0


def test_peers_the_barrier_gave_up_on_that_then_finished_training_are_waited_for():
    # 30 peers were still training when the first pair's barrier gave up on them; by the pair's merge
    # they are matchmaking: their group's set comes, and the pair merges it instead of training apart
    mine, theirs = a_group(0, 2, b"g1"), a_group(2, 3, b"g2")
    others = sorted(theirs[2])
    matchmaking = [record(p, state="exchanging") for p in others]
    named = [record(p, gathered=theirs[1]) for p in others]
    swarm = Swarm([matchmaking] * 3 + [named], {others[0]: {theirs[1]: theirs[0]}}, allowance=5.0)
    peer, result = member_of(swarm, mine)
    merged = merge_round(peer, ROUND, result, ready=[], gave_up=others)
    assert merged.sets == 2 and merged.payloads == {**mine[2], **theirs[2]}


def test_the_merge_waits_as_long_as_matchmaking_was_stretched_on_this_host():
    # another group is still matchmaking for about 1.5 s (6 polls); the spec's times allow 0.3 s
    mine, theirs = a_group(0, 2, b"g1"), a_group(2, 3, b"g2")
    others = sorted(theirs[2])

    def merged_with(wait):
        views = [[record(p, state="exchanging") for p in others]] * 6 + [[record(p, gathered=theirs[1]) for p in others]]
        swarm = Swarm(views, {others[0]: {theirs[1]: theirs[0]}}, allowance=0.1)
        swarm.matchmaking_wait = wait
        peer, result = member_of(swarm, mine)
        return merge_round(peer, ROUND, result, ready=[]).sets

    assert merged_with(0.0) == 1  # the spec's 0.1 s matchmaking: gave up on them
    assert merged_with(1.0) == 2  # a loaded host's 1 s matchmaking: 2.1 s of allowance


def test_a_large_group_still_gathering_past_round_wait_is_waited_for_and_one_still_training_is_not():
    # 32 peers on 2 cores: a pair gathered, then stopped waiting at round_wait 7 s before the group of
    # 16 (matchmaking and gathering all along) named its set, and the round ended with two θ
    mine, theirs = a_group(0, 2, b"g1"), a_group(2, 3, b"g2")
    others = sorted(theirs[2])

    def merged_while(state):
        views = [[record(p, state=state) for p in others]] * 6 + [[record(p, gathered=theirs[1]) for p in others]]
        swarm = Swarm(views, {others[0]: {theirs[1]: theirs[0]}}, allowance=0.1)
        peer, result = member_of(swarm, mine)
        peer.spec.swarm.gather_timeout, peer.spec.swarm.round_wait = 0.5, 0.7  # 0.7 s without the extra 1 s
        swarm.timing = Timing.from_spec(peer.spec)
        t0 = time.monotonic()
        sets = merge_round(peer, ROUND, result, ready=others).sets
        return sets, time.monotonic() - t0

    sets, took = merged_while("exchanging")
    assert sets == 2 and took < 1.7
    sets, took = merged_while("training")  # stragglers: the allowance and round_wait as they are
    assert sets == 1 and took < 1.2


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


def test_a_gather_gives_up_once_every_other_peer_of_the_round_has_gathered():
    mine, theirs = a_group(0, 1, b"g1"), a_group(1, 2, b"g2")
    others = sorted(theirs[2])
    still = [record(p, state="ready") for p in others]
    done = [record(p, gathered=theirs[1], round_no=ROUND + 1, state="training") for p in others]
    swarm = Swarm([still, done], {})
    peer, _ = member_of(swarm, mine)
    peer.peer_id = "me"
    give_up = no_group_left(peer, ROUND, since=time.monotonic())
    assert not give_up() and not give_up.fired  # they may still gather with us
    assert give_up() and give_up.fired  # both named their group's set: no group is left for us to join


def test_a_gather_keeps_waiting_while_a_peer_of_the_round_can_still_join_it():
    mine, theirs = a_group(0, 1, b"g1"), a_group(1, 2, b"g2")
    others = sorted(theirs[2])
    slow = b58(signer(9).peer_id)
    views = [record(p, gathered=theirs[1], round_no=ROUND + 1, state="training") for p in others]
    swarm = Swarm([views + [record(slow, state="training")]], {})
    peer, _ = member_of(swarm, mine)
    peer.peer_id = "me"
    assert not no_group_left(peer, ROUND, since=time.monotonic())()  # the slow peer will be ready soon
    assert no_group_left(peer, ROUND, since=time.monotonic(), gave_up=[slow])()  # ... unless it stalled
    stale = no_group_left(peer, ROUND, since=time.monotonic() + 60)  # a view read before the gather began
    assert not stale()


def test_a_gather_with_nobody_else_in_the_round_does_not_give_up():
    mine = a_group(0, 1, b"g1")
    behind = b58(signer(9).peer_id)  # it will reach our round and gather with us
    swarm = Swarm([[record(behind, round_no=ROUND - 1, state="training")]], {})
    peer, _ = member_of(swarm, mine)
    peer.peer_id = "me"
    assert not no_group_left(peer, ROUND, since=time.monotonic())()
