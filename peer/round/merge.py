"""After a round's gather: the sets the round's other groups agreed, fetched, checked and merged.

A swarm larger than ``swarm.max_group_size`` forms several groups in one round (hivemind's
matchmaking bounds them). Each member names its group's agreed set in its progress record
(``gathered_round``, ``gathered``, and the set of the round before in ``gathered_before``: a group
that gathers late, on a loaded host, still finds the set of a peer that has trained on and named
the next round's), then waits for the peers of its round that are not in its group (ready, or
still training, unless the round's barrier already gave up on them), asking each directly to answer
once it has named its set (peer/exchange/ready_notices.py, ``until=SET``: a set is seen when named,
not at the next read of the view, N / 8 s apart): until each has named a set,
or has left the round (found no group and caught up, stopped), or is a stranger (``Membership.known``)
listed in a binding that a set it holds vouches for (group_sets.py ``vouched``: it sent nothing
there, no set of its own is coming), or too few are left to make a group of their own (``swarm.min_group_size``), or
the wait ran out: the straggler allowance or ``swarm.gather_timeout`` (the larger), and two
matchmakings (``Timing.merge_allowance``), past the last set that came in, never more than
``swarm.round_wait``; for strangers alone, what their budget grants (``Membership.strangers_wait``:
a group of new identities that never names its set held every honest merge); both
``Timing.gathering_extra_slots`` gather timeouts longer while a peer it waits for has finished
training (ready or exchanging: its group's set is coming, and a large group on a loaded host
gathers for longer than a small one). Every set named for the round is fetched from one of the
peers that named it (another on failure), checked envelope by envelope
(protocol/round/group_sets.py) and merged: θ is computed from the union, in canonical order, so
groups that hold the same sets hold the same θ. A set that cannot be had in time leaves that round
with a second θ; a member of the minority takes the majority's parameters at the next round's
start-hash check. Guarded by tests/round/test_group_merge.py and tests/round/test_group_merge_waits.py.

Only peers of the same part of the model (``progress.part``: a full replica, a slice, a stage)
are asked: the others gather under another key.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Set

from peer.exchange.ready_notices import SET, ReadyAsks
from peer.round.draw import Bindings, SetList, fetch_into
from protocol.round import group_sets, round_policy
from protocol.dht.records import Progress
from protocol.round.peer_states import IN_ROUND, NOT_IN_ROUNDS

logger = logging.getLogger("voloco.peer")

TRIES_PER_SET = 3  # peers that named a set asked for it, one after the other, before giving it up


@dataclass
class Merged:
    """What a round's merge holds."""

    payloads: Dict[str, bytes]  # sender -> payload, over every set held whole
    excluded: Dict[str, str]  # sender -> why it is left out of the union
    sets: int  # sets held, our group's included
    held: Dict[str, Dict[str, bytes]] = field(default_factory=dict)  # set name -> sender -> payload
    # with outer.max_contributions: the other groups' sets, known by their lists (peer/round/draw.py)
    lists: Optional[Dict[str, SetList]] = None


def merge_round(peer, round_no: int, result, ready: Iterable[str], skip: Optional[Dict[str, int]] = None,
                gave_up: Iterable[str] = (), quiet: Optional[Dict[str, int]] = None, by_list: bool = False,
                awaited: Optional[Callable[[str, Progress], bool]] = None, notices=None) -> Merged:
    """The union of our group's set and every set the round's other groups named in time.

    ``result`` is this peer's GatherResult; ``ready``, the peers its barrier saw ready in the round.

    Peers still training the round are waited for too: a group that formed late (its peers came
    from the round before, or closed the round late) names its set a little after ours, and a
    member that stopped waiting for it while a groupmate merged it would leave the group with two
    θ. ``gave_up``: the peers of the round the barrier stopped waiting for (still training past the
    straggler allowance, or stalled): not waited for a second time while they still train, but
    waited for once they have finished training the round (ready, matchmaking): a group of them is
    about to name its set, and a first pair that merged without them would train a θ of its own
    (tests/round/test_group_merge.py,
    ``test_peers_the_barrier_gave_up_on_that_then_finished_training_are_waited_for``).

    ``skip`` (peer -> round), kept from round to round by the caller: a peer that stayed in the
    round past the wait without naming a set is not waited for again for ``Timing.merge_skip_rounds`` rounds, or
    until it names one (a peer that claims to be in the round and never gathers costs one wait).

    Then the group's members agree on the sets they merged (``agree_with_group``): one θ for the
    group even where one member's fetch of a late set succeeded and another's stopped waiting.
    ``quiet``, kept by the caller: groupmates that did not answer lately (see there).

    ``by_list`` (a run that takes at most ``outer.max_contributions`` a part): the other groups' sets
    are fetched as lists (``Merged.lists``), and only the payloads drawn from them later
    (peer/round/draw.py). ``awaited`` (peer id, record; peer/round/draw.py, judged with the seed after
    the union's repair): where no peer it says may send is still to name a set, the merge does not
    wait for the others (they may not send this round; a set they name in time is still fetched);
    where one is, they all count towards the group it may form; a wait that runs out strikes only the
    peers that may send (tests/round/test_awaited.py). ``notices``: what asks the peers waited for to
    answer once they have named their set (peer/exchange/ready_notices.py ``ReadyAsks``, the peer's
    gatherer; tests/round/test_group_merge.py); None: the view alone."""
    skip = {} if skip is None else skip
    membership, gatherer, spec = peer.membership, peer.gatherer, peer.spec
    own = result.set_digest
    last_round, last = peer.gathered
    peer.gathered_before = last if last_round == round_no - 1 else ""
    peer.gathered_from = peer.engine.params_hash()  # θ after the union's repair: what the round's sets apply to
    peer.gathered = (round_no, own)  # after it: a record naming this set never carries the last one's θ
    membership.publish()
    mine = set(result.group)
    part = peer.role.progress_part
    held: Dict[str, Dict[str, bytes]] = {own: dict(result.payloads)}
    lists: Optional[Dict[str, SetList]] = {} if by_list else None
    tries: Dict[str, int] = {}
    failed: Set[str] = set()  # peers that did not serve the set they named
    outstanding: Set[str] = set(ready) - mine
    gave_up = set(gave_up)
    t0 = last_arrival = time.monotonic()
    seen_naming: Dict[str, List[str]] = {}
    others: Set[str] = set()  # peers of the round outside our group seen in it, or naming a set for it
    # members of the groups whose sets we hold, as far as the sets vouch: a stranger among them that named no
    # set has none to come; a peer we know is still waited for (tests/round/test_group_merge_waits.py)
    acquaintances = membership.known()
    grouped: Bindings = []
    stranger_wait: Optional[float] = None  # once it waits for strangers alone: what their budget granted
    strangers = round_policy.StrangersWait()
    # another group may form and agree as late as a gather's deadline after ours (a loaded host's matchmaking)
    # (matchmaking's wait as stretched on this host for the round's gather: peer/exchange/gatherer.py)
    timing = membership.timing
    allowance = timing.merge_allowance(membership.straggler_allowance(), getattr(gatherer, "matchmaking_wait", 0.0))
    # the peers it waits for are asked to answer once they name their group's set: a set is seen when named,
    # not at the next read of the view (every N / 8 s; peer/exchange/ready_notices.py)
    # (with K, each answer carries the list of the set it names: fetching it then costs no call)
    asks = ReadyAsks(notices, round_no, membership.digest, timing, until=SET, with_list=by_list) \
        if notices is not None else None
    while not peer.stop_event.is_set():
        # the merge ends only on a read of the view begun past our gather (round_policy.merge_wait): taken
        # ``merge_read_after_s`` past it where the view's own schedule (every N / 8 s) has not read by then
        viewed = membership.view(read_since=t0 if time.monotonic() - t0 >= timing.merge_read_after_s else None)
        if asks is not None:
            viewed = asks.overlay(viewed, membership.read_began)
        records = [v for v in viewed if v.peer_id not in mine and v.progress.part == part]
        view = [v for v in records if v.progress.state not in NOT_IN_ROUNDS]
        named: Dict[str, List[str]] = {}
        # a peer that stopped right after concluding the round (its --max-rounds, a Ctrl+C) still names
        # the set it merged, and serves it a while: a merge that dropped it with the peer left the last
        # round of a run on two θ (tests/round/test_group_merge.py)
        for v in records:
            p = v.progress
            name = p.set_of(round_no)
            if name and name not in held and name not in (lists or {}):
                named.setdefault(name, []).append(v.peer_id)
                if v.peer_id not in seen_naming.setdefault(name, []):
                    seen_naming[name].append(v.peer_id)
        asked_known = False  # a set a peer we know named asked for: no wait for strangers alone meanwhile
        for digest, publishers in sorted(named.items()):
            sources = [p for p in publishers if p not in failed]
            if not sources or tries.get(digest, 0) >= TRIES_PER_SET:
                continue
            tries[digest] = tries.get(digest, 0) + 1
            asked_known |= bool(acquaintances.intersection(publishers))
            timeout = min(timing.set_fetch_s, max(timing.set_fetch_min_s, allowance - (time.monotonic() - last_arrival)))
            if fetch_into(held, lists, gatherer, spec, sources, digest, round_no, timeout, grouped):
                last_arrival = time.monotonic()
            else:
                failed.add(sources[0])  # not asked again this round, whatever set it names next
        # whoever is in the round and has named no set yet: those the barrier saw ready, and any the view
        # shows in the round now (the barrier's view may have been a read behind, or they came late)
        by_peer = {v.peer_id: v.progress for v in view}
        accounted = {m for members, owners in grouped if group_sets.vouched(members, owners, acquaintances)
                     for m in members} - acquaintances
        in_round = {v.peer_id for v in view if v.progress.round == round_no and v.progress.state in IN_ROUND} - accounted
        outstanding = (outstanding | in_round) - accounted
        others |= in_round | {p for pubs in named.values() for p in pubs}
        # with K: the merge waits, as it always did, only while a peer that may send is still to name a set
        # (before this peer's own skips: a sender it skips may still form a group with the others it waits
        # for); peers that may not send are struck by no wait (tests/round/test_awaited.py)
        sender_coming = awaited is None or any(
            awaited(p, by_peer[p]) for p in outstanding
            if p in by_peer and by_peer[p].round == round_no and by_peer[p].state in IN_ROUND and not by_peer[p].set_of(round_no))
        for p in list(skip):
            if skip[p] <= round_no or (p in by_peer and by_peer[p].set_of(round_no)):
                del skip[p]
        outstanding = {
            p for p in outstanding - membership.no_shows - set(skip)
            if p in by_peer and by_peer[p].round == round_no and by_peer[p].state in IN_ROUND
            and not (p in gave_up and by_peer[p].state == "training")
            and not by_peer[p].set_of(round_no)
        }
        unfetched = [d for d, pubs in named.items() if tries.get(d, 0) < TRIES_PER_SET and set(pubs) - failed]
        # a peer of the round that has finished training and is matchmaking or gathering names its set
        # once its group's gather ends: a large group on a loaded host gathers for longer than a pair
        # (test_a_large_group_still_gathering_past_round_wait_is_waited_for_and_one_still_training_is_not)
        extra = timing.gathering_extra() if round_policy.still_gathering(by_peer[p].state for p in outstanding) else 0.0
        # strangers alone (a group of new identities that never names its set, or sets only they named): what
        # their budget grants (asked once) past when only they were left, a vain wait paid; else the allowance
        now = time.monotonic()
        due = {p for d in unfetched for p in named[d] if p not in failed}
        alone = round_policy.strangers_alone(outstanding if sender_coming else set(), due, acquaintances,
                                             spec.swarm.min_group_size)
        strangers.check(now, alone, last_arrival, asked_known)
        if alone and stranger_wait is None:
            stranger_wait = membership.strangers_wait(outstanding | due)
        limited = alone and stranger_wait is not None
        clock = round_policy.MergeClock(now=now, started=t0, last_arrival=strangers.since if limited else last_arrival,
                                        allowance=min(allowance, stranger_wait) if limited else allowance,
                                        extra=0.0 if limited else extra, round_wait=timing.round_wait_s)
        decision = round_policy.merge_wait(clock, bool(view), len(outstanding) if sender_coming else 0, len(unfetched),
                                           spec.swarm.min_group_size,
                                           fresh_read=membership.read_began > t0)
        if decision is not round_policy.MergeWait.GO_ON and strangers.vain > 0:
            membership.waited_for_strangers(strangers.vain)
        if decision is round_policy.MergeWait.NOTHING_LEFT:
            break  # alone, or nothing more to wait for in a view read after our group's gather
        if decision is round_policy.MergeWait.TIMED_OUT:
            sending = {p for p in outstanding if awaited is None or awaited(p, by_peer[p])}
            new = " new to us (what the budget for strangers holds)" if limited else ""
            logger.info(f"round {round_no}: merged {len(held) - 1} other groups' sets; not waiting longer for "
                        f"{len(sending)} peers of the round{new} and {len(unfetched)} sets")
            skip.update({p: round_no + timing.merge_skip_rounds for p in sending})
            membership.missed(sending, round_no)  # strikes outlive a set named later (protocol/round/no_shows.py)
            break
        if asks is not None:  # only those the wait is for: peers that may send (with K), else all
            asks.ask([p for p in outstanding if awaited is None or awaited(p, by_peer[p])])
        time.sleep(timing.view_poll_s)
    # each member decided alone which late sets arrived in time: the group agrees on their union. A
    # groupmate answers once its own merge is over. Where the round has other groups, its view may
    # have shown it one still gathering that ours no longer waited for: then its merge runs on, to
    # round_wait (and the gathering extra, and a fetch) past its start, at most a gather slot after
    # ours. Its answer is then waited for that long (it comes as soon as that merge ends), or the two
    # would end the round with two θ, one of them without the late set. A round with no other group
    # in sight waits only the allowance: a groupmate that never answers costs that, not the longest
    # merge (tests/round/test_group_merge_waits.py)
    wait, quiet_wait = allowance, timing.quiet_mate_s
    if others or len(held) > 1:  # a groupmate that left us waiting lately too (our own link may have been down)
        wait, quiet_wait = max(allowance, timing.mate_merge_bound() - (time.monotonic() - t0)), allowance
    agree_with_group(peer, round_no, result, held, seen_naming, wait, quiet, quiet_wait, lists)
    payloads, excluded = group_sets.union(held[d] for d in sorted(held))
    count = len(held) + len(lists or {})
    if count > 1:
        known = "payloads in all" if lists is None else "payloads held whole, the others' by their lists"
        empty = group_sets.empty_set_name(gatherer.run_digest, round_no)
        empty = ", and the round's empty set (groups that sent nothing; known by its name)" \
            if empty in held or empty in (lists or {}) else ""
        logger.info(f"round {round_no}: merged the sets of {count - 1} other group(s) of the round: "
                    f"{len(payloads)} {known}{empty}")
    return Merged(payloads, excluded, count, held, lists)


def agree_with_group(peer, round_no: int, result, held: Dict[str, Dict[str, bytes]],
                     publishers: Dict[str, List[str]], wait: float, quiet: Optional[Dict[str, int]] = None,
                     quiet_wait: Optional[float] = None, lists: Optional[Dict[str, "SetList"]] = None) -> None:
    """Add to ``held`` the sets our groupmates merged for the round and we did not.

    Each member tells the others which sets it holds (``offer_merged``) and asks each of them the
    same (``merged_by``: answered once that member's own merge is over, or after ``wait`` s); a set
    one of them names that we lack is fetched from it (it serves what it fetched), or from the peers
    seen naming it. Members that all answer each other end with the same union, so the same θ.
    A member that does not answer in time, or a set that cannot be had, leaves the group split
    until the next round's start-hash check (a hostile member can still name different sets to
    different members: that costs a round's θ, never a forged payload, every set being checked).
    ``quiet`` (peer -> round), kept by the caller: groupmates that did not answer, asked again for
    ``Timing.merge_skip_rounds`` rounds with a wait of ``quiet_wait`` only (``Timing.quiet_mate_s`` when
    None; the merge's allowance where the round showed another group: a groupmate marked quiet while
    our own link was down may merge another group's set a little after the short wait, which would
    split the group). Guarded by tests/round/test_merge_agreement.py
    (``test_a_groupmate_that_does_not_answer_is_not_waited_for_long_again_and_an_excluded_one_is_never_asked``)
    and tests/round/test_group_merge_waits.py. ``lists``: where the round's sets are held by their
    lists (``merge_round``'s ``by_list``), a lacking set is fetched as its list into it."""
    gatherer, me, own = peer.gatherer, peer.peer_id, result.set_digest
    lists_held = {} if lists is None else lists
    timing = peer.membership.timing
    quiet = {} if quiet is None else quiet
    quiet_wait = timing.quiet_mate_s if quiet_wait is None else quiet_wait
    # members the gather did not exclude (an excluded one misbehaved or went silent; in a round of at
    # most K, members that sent nothing by design merge too), client-mode members aside (they serve nothing)
    mates = [m for m in result.present if m != me and m not in result.unservable]
    gatherer.offer_merged(own, result.group, sorted([*held, *lists_held]))
    if not mates or not own:
        return
    for m in [m for m, until in quiet.items() if until <= round_no]:
        del quiet[m]
    # a member that left us waiting lately is asked, but not waited for long
    answers = gatherer.merged_by({m: quiet_wait if m in quiet else max(timing.mate_answer_min_s, wait) for m in mates}, own,
                                 round_no=round_no)
    for mate, names in answers.items():
        if names is None:
            quiet[mate] = round_no + timing.merge_skip_rounds
        else:
            quiet.pop(mate, None)
    lacking: Dict[str, List[str]] = {}
    for mate, names in sorted(answers.items()):
        for name in names or ():
            if name not in held and name not in lists_held:
                lacking.setdefault(name, []).append(mate)
    # bounded however many names a (hostile) groupmate lists: one source that fails is not asked again
    deadline = time.monotonic() + max(wait, timing.set_fetch_s)
    failed: Set[str] = set()
    for name, holders in sorted(lacking.items()):
        sources = [p for p in holders + publishers.get(name, []) if p not in failed]
        for source in list(dict.fromkeys(sources))[:TRIES_PER_SET]:
            left = deadline - time.monotonic()
            if left > 0 and fetch_into(held, lists, gatherer, peer.spec, [source, *sources], name, round_no,
                                       min(timing.set_fetch_s, left)):
                logger.info(f"round {round_no}: took set {name[:12]} that {holders[0]} of our group merged and we had not")
                break
            failed.add(source)
        else:
            logger.warning(f"round {round_no}: {holders[0]} of our group merged set {name[:12]}, which we could not "
                           f"fetch: this round may end with a second θ")
    if lacking:
        gatherer.offer_merged(own, result.group, sorted([*held, *lists_held]))


def no_group_left(peer, round_no: int, since: float, gave_up: Iterable[str] = ()) -> Callable[[], bool]:
    """A ``give_up`` for the round's gather (peer/exchange/gatherer.py): True once a view read that began
    after ``since`` shows that some group of the round has gathered and no other peer of the round
    is left to gather with (each has named its group's set, or left the round, or is one the
    barrier gave up on, or a no-show). Matchmaking would wait out ``swarm.round_wait`` for nobody:
    the round is deferred at once, and state sync takes the swarm's next state (the odd peer out of
    a round whose other peers all found groups without it)."""
    membership, me, part = peer.membership, peer.peer_id, peer.role.progress_part
    gave_up = set(gave_up)

    def check() -> bool:
        view = membership.view()
        if membership.read_began <= since:
            return False
        records = [(v.peer_id, v.progress.round, v.progress.state, v.progress.part, bool(v.progress.set_of(round_no)))
                   for v in view]
        left = round_policy.nobody_left(records, me, part, round_no, frozenset(gave_up | membership.no_shows))
        if left:
            logger.info(f"round {round_no}: every other peer of the round has gathered without us; not waiting for a group")
            check.fired = True
        return left

    check.fired = False  # True once it gave the gather up: we never sent our payload, no set can hold it
    return check
