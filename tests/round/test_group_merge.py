"""peer/round/merge.py against a swarm's records: a member waits for the round's other groups to
name their sets, fetches each from a peer that named it (another when one serves a bad set),
merges them, and never waits past its allowance for a set that does not come."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Dict, List, Optional

from hivemind.p2p import PeerID

from peer.exchange.ready_notices import SET
from peer.round.merge import merge_round, no_group_left
from protocol.round.group_sets import pack_set, set_digest
from protocol.dht.records import Progress, encode_body
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
    def view(self, read_since=None):
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


def test_the_set_of_a_group_that_stopped_right_after_the_round_is_still_merged():
    """The last round of a run (every peer's --max-rounds): a group that concluded the round with both
    sets stops at once, and its records say "stopped" by the other group's next read. The merge no
    longer waits for those peers, but still takes the set they named (a 32-peer run ended its last
    round on two θ: bench/RESULTS.md, eighty-second session)."""
    mine, theirs = a_group(0, 3, b"g1"), a_group(3, 3, b"g2")
    others = sorted(theirs[2])
    stopped = [record(p, state="stopped", gathered=theirs[1]) for p in others]
    swarm = Swarm([[record(p) for p in others], stopped], {others[0]: {theirs[1]: theirs[0]}}, allowance=5.0)
    peer, result = member_of(swarm, mine)
    t0 = time.monotonic()
    merged = merge_round(peer, ROUND, result, ready=others)
    assert merged.sets == 2 and merged.payloads == {**mine[2], **theirs[2]}
    assert time.monotonic() - t0 < 3.0  # not waited for: only their set counts
    # a stopped peer that no longer serves its set costs one fetch, not a wait
    swarm = Swarm([stopped], {}, allowance=5.0)
    peer, result = member_of(swarm, mine)
    t0 = time.monotonic()
    merged = merge_round(peer, ROUND, result, ready=others)
    assert merged.sets == 1 and time.monotonic() - t0 < 3.0


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


class AskedSwarm(Swarm):
    """A swarm whose records never show the other group's set, and whose peers answer a merge's question
    (peer/exchange/ready_notices.py, ``until=SET``) with the record that names it."""

    digest = ""  # the run spec the records name

    def __init__(self, *args, answers: Dict[str, Progress], **kwargs):
        super().__init__(*args, **kwargs)
        self.answers, self.questions = answers, []

    def ask_ready(self, peer, round_no, wait, until=b"", with_list=False):
        self.questions.append((peer, round_no, until))
        body = encode_body(self.answers[peer].to_wire()) if peer in self.answers else None
        return SimpleNamespace(done=lambda: True, result=lambda: body)


def test_a_set_named_is_seen_in_the_answer_to_our_question_not_at_the_next_read():
    mine, theirs = a_group(0, 4, b"g1"), a_group(4, 4, b"g2")
    others = sorted(theirs[2])
    named = record(others[0], gathered=theirs[1]).progress
    views = [SimpleNamespace(**vars(record(p)), expires=0.0) for p in others]
    swarm = AskedSwarm([views], {others[0]: {theirs[1]: theirs[0]}}, answers={others[0]: named})
    peer, result = member_of(swarm, mine)
    merged = merge_round(peer, ROUND, result, ready=others, notices=swarm)
    assert merged.payloads == {**mine[2], **theirs[2]} and merged.sets == 2
    assert {(p, r, until) for p, r, until in swarm.questions} >= {(p, ROUND, SET) for p in others}
