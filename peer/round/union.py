"""The union of a round's sets, agreed by the next round's group: θ recomputed when it grows.

θ of round r + 1 is a deterministic function of θ of round r and the union of the signed sets of
round r that a member holds (protocol/round/group_sets.py: ``union``, in canonical order). How long a
member's merge waited for the round's other groups decides which sets it holds, so two members
may conclude round r from different unions. The next round's group settles it:

- a member keeps what concluding round r again takes (``LastRound``: θ and the strategy's shared
  state before the outer step, and the sets it held) and announces in round r + 1's matchmaking
  the hash of that θ (its **base**) and the names of those sets (``announce``);
- every member holds the same announcements and the same agreed payloads, so every member computes
  the same union of round r for the group (``late_union``: every name a counted member announces)
  and the same key for each member's start (``start_keys``);
- a member whose sets lack part of that union fetches the missing sets from the members that
  announced them, checks every envelope, and concludes round r again from its base with the larger
  union (``RoundEngine.redo``: the same bits as a member that held every set the first time; where
  our own payload counts now and did not then, or the other way round, the local buffers give it up
  or take it back) before it concludes round r + 1 (``take_group_union``).

Members of one base then hold one θ whichever of them waited longest, and the start vote counts
them as one. A set that no member of the next round's group holds (the group of a slower group's
peers, which merged ours, formed apart again) is taken before its matchmaking, from the records
of the peers that named it (``take_named_sets``). A name that only one member announced and that member does not serve is left out by
every member that asks (a hostile member naming a set that does not exist costs the group one
fetch, not a state download); a set that several members announced and none of them serves leaves
this member without the θ its key names: it takes the vote winner's state, as a member that
started apart does. A member without a base (a state installed since, a round without a group)
votes with its announced start. Guarded by tests/protocol/test_group_sets.py (the keys) and
tests/round/test_union.py (the recomputation).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Set, Tuple

from peer.outer.engine import Snapshot
from peer.round import draw
from peer.round.adopt import anchors
from peer.round.draw import SetList
from peer.round.draw import fetch_checked_set
from peer.round.merge import TRIES_PER_SET
from protocol.round import group_sets
from protocol.round.named_sets import named_late

logger = logging.getLogger("voloco.peer")


@dataclass
class LastRound:
    """What concluding round ``round`` again takes."""

    round: int
    snapshot: Snapshot  # θ, the shared state and the tables before the round's outer step
    sets: Dict[str, Dict[str, bytes]]  # set name -> sender -> payload: every set the union held
    base: str  # θ's hash before the round's outer step
    after_hash: str = ""  # θ's hash once the round was concluded (a state installed since changes θ)
    # the state digest then: a state installed since with the same θ (a table split's repair) changes it
    after_digest: str = ""
    # with outer.max_contributions: the other sets of the union, by their lists (peer/round/draw.py)
    lists: Optional[Dict[str, SetList]] = None

    def settle(self, engine) -> None:
        """Note θ and the tables as the round's conclusion left them (call with ``engine.lock`` held)."""
        self.after_hash, self.after_digest = engine.hashes()

    def concluded_here(self, engine) -> bool:
        """Whether ``engine`` still holds what concluding this round gave: the next round, the same θ and
        the same tables. A state installed since (even at the same θ) was concluded by another member from
        its own union; concluding ours again would bring our old tables back
        (tests/round/test_union.py ``test_a_union_that_cannot_be_taken_leaves_theta_as_it_was``)."""
        return engine.round == self.round + 1 and engine.hashes() == (self.after_hash, self.after_digest)

    @property
    def names(self) -> Tuple[str, ...]:
        """The names of every set of the union."""
        return tuple(sorted([*self.sets, *(self.lists or {})]))


@dataclass
class GroupUnion:
    """What the group's union of the last round means for this round's start vote."""

    keys: Dict[str, str]  # member -> what its start counts as in the vote (protocol/round/group_sets.py)
    holds: bool  # θ is what our own key names (False: a set of the union could not be had)
    taken: int = 0  # sets taken into the last round's union


def announce(last: Optional[LastRound], engine) -> Tuple[str, Tuple[str, ...]]:
    """(base, set names) to announce in this round's matchmaking; ("", ()) when θ is no longer the
    one the kept round concluded (a state installed since, a round deferred or trained alone)."""
    if last is None or not last.concluded_here(engine):
        return "", ()
    return last.base, last.names


def take_group_union(peer, last: Optional[LastRound], result) -> GroupUnion:
    """Take the group's union of the last round (see the module docstring); never raises."""
    union = group_sets.late_union(result.last_sets, result.present)
    keys = group_sets.start_keys(result.start_hashes, result.last_sets, union)
    base, names = result.last_sets.get(peer.peer_id, ("", ()))
    lacking = sorted(union - set(names))
    if not base or not lacking:
        return GroupUnion(keys, True)
    if last is None or base != last.base or set(names) != set(last.names):
        return GroupUnion(keys, False)  # not what we announced: cannot happen unless θ changed in between
    try:
        symbolic = group_sets.repaired_key(base, set(names) | union)
        return GroupUnion(keys, _take(peer, last, result, lacking, keys[peer.peer_id], symbolic), len(lacking))
    except Exception as e:  # the round stays as concluded; the vote sends us to the winner's state
        logger.warning(f"round {last.round}: could not take the group's sets into its union: {e!r}")
        return GroupUnion(keys, False)


def _take(peer, last: LastRound, result, lacking: List[str], key: str, symbolic: str) -> bool:
    """Fetch ``lacking``, conclude the round again; whether θ is then what ``key`` names (``symbolic``:
    the key of our base and the grown union, which no member had announced as its start)."""
    timing = peer.membership.timing
    listers = {name: [m for m in sorted(result.present) if m != peer.peer_id and m not in result.unservable
                      and name in result.last_sets.get(m, ("", ()))[1]] for name in lacking}
    deadline = time.monotonic() + timing.set_fetch_s  # all of them together: the round ends late by at most this
    got: Dict[str, Dict[str, bytes]] = {}
    got_lists: Optional[Dict[str, SetList]] = None if last.lists is None else {}
    for name in lacking:
        if _fetch_into(peer, last.round, name, listers[name], deadline, got, got_lists):
            continue
        if len(listers[name]) <= 1:  # its one lister does not serve it: every member that asks leaves it out
            logger.warning(f"round {last.round}: left set {name[:12]} out of the round's union: the one member "
                           f"that announced it did not serve it")
            continue
        logger.warning(f"round {last.round}: the group took set {name[:12]} into the round's union and we could "
                       f"not fetch it from {len(listers[name])} members that hold it")
        return False
    _grow(peer, last, got, got_lists, "that our group held")
    # a key that names a start another member announced (the same base, exactly these sets): θ must now
    # be that one, bit for bit (a set left out above leaves it apart)
    if key != symbolic and key != last.after_hash:
        logger.error(f"round {last.round}: the round's union gives θ {last.after_hash} here, not {key} as the "
                     f"member that held it announced")
        return False
    return True


def take_named_sets(peer, last: Optional[LastRound]) -> int:
    """Before this round's matchmaking: the sets of the last round that other groups named after our
    merge stopped waiting for them, fetched and taken into its union (the round concluded again from
    its base, ``_redo``); how many were taken. Never raises.

    A group whose merge gives up on a slower group concludes the round without that group's set, while
    the slower group, naming its set a few seconds later, merged both: the swarm holds two θ. The
    next round's group repairs only what its own members announce, and matchmaking often puts the
    same peers together again, so the two θ went on side by side (8 peers, 4 / 4, under a CPU quota:
    bench/RESULTS.md, seventy-third session). Here each member of the hasty group finds the late set
    in the view (``protocol/round/named_sets.named_late``: named by a peer whose concluded record of the
    round says it was applied to our base), and ends on the θ of the group that held both; members
    that saw it at different reads are evened out by the group's own union (``take_group_union``).

    Only checked sets count: a name nobody serves costs one fetch per namer asked, all of them within
    ``Timing.set_fetch_s``, the sets most peers we know name first. Where a set a peer we know names
    cannot be had, none is taken: a part of them would leave θ where nobody is. Sets that only
    strangers name (no peer we know or with standing in our lineage, ``adopt.anchors``) are asked for
    while our matchmaking admits strangers, for what one grant of the budget for strangers allows
    them all, and a fetch of one that fails is paid from it (``Membership.waited_for_strangers``); one
    of them that fails takes nothing else out. At a run's start every peer is a stranger, and two
    groups that never met would otherwise stay apart (6 hasty peers split 3 / 3 for 8 rounds,
    bench/honest_rounds.py), while new identities naming sets nobody serves cost a bounded share of
    wall time. The senders whose payloads the round then counts came (``Membership.came_late``: the
    barrier waits for them again); the merge's own skip of them (``merge_round``'s ``skip``) stays, so
    a group slower than the merge's wait round after round costs a late take, not a wait, each round.
    Guarded by tests/round/test_late_sets.py."""
    engine, membership = peer.engine, peer.membership
    if last is None or not last.concluded_here(engine):
        return 0
    try:
        named = named_late(membership.others(), last.round, last.base, last.names, peer.role.progress_part,
                           membership.named_sets)
        if not named:
            return 0
        known = anchors(peer)
        if not membership.admits_strangers():  # our matchmaking keeps new identities out now: their names too
            named = {name: namers for name, namers in named.items() if known.intersection(namers)}
        if not named:
            return 0
        now = time.monotonic()
        deadline = now + membership.timing.set_fetch_s
        alone = sorted({p for namers in named.values() if not known.intersection(namers) for p in namers})
        grant = membership.strangers_wait(alone) if alone else None  # one grant for every name only strangers give
        strangers_end = deadline if grant is None else min(deadline, now + grant)
        got: Dict[str, Dict[str, bytes]] = {}
        got_lists: Optional[Dict[str, SetList]] = None if last.lists is None else {}
        missed = []  # sets a peer we know names that could not be had
        # the sets most peers we know name first, each asked of those namers first
        for name, namers in sorted(named.items(), key=lambda item: (-len(known.intersection(item[1])), item[0])):
            namers = sorted(namers, key=lambda p: p not in known)
            strangers = not known.intersection(namers)
            began = time.monotonic()
            ends = strangers_end if strangers else deadline
            if ends <= began:  # (strangers: nothing granted is left; a name we know: out of time)
                missed += [] if strangers else [name]
                continue
            if _fetch_into(peer, last.round, name, namers, ends, got, got_lists):
                continue
            if strangers:
                membership.waited_for_strangers(time.monotonic() - began)  # in vain: paid from their budget
            else:
                missed.append(name)
        if missed:  # a part of the sets would leave θ where nobody is: the next start vote decides instead
            logger.info(f"round {last.round}: not taking the sets other groups named late: {len(missed)} of them, "
                        f"named by peers we know, could not be fetched")
            return 0
        taken = len(got) + len(got_lists or {})
        if taken:
            counted = _grow(peer, last, got, got_lists, "that another group named after our merge")
            late = {s for payloads in got.values() for s in payloads} | \
                {s for listed in (got_lists or {}).values() for s in listed.entries}
            membership.came_late(last.round, late & counted)  # only payloads the round counted
            membership.publish()  # the round's start as it now is: the others' start votes read it
        return taken
    except Exception as e:  # the round stays as concluded; the start vote still repairs a split
        logger.warning(f"round {last.round}: could not take the sets other groups named late: {e!r}")
        return 0


def _grow(peer, last: LastRound, got: Dict[str, Dict[str, bytes]], got_lists: Optional[Dict[str, SetList]],
          whose: str) -> Set[str]:
    """Take the sets ``got`` (and lists ``got_lists``) into ``last``'s union, concluding the round again
    where they hold a payload; sets without one (a group whose members did not send this round: the
    union's payloads, and so θ, are what they were) are only added (tests/round/test_union.py). The
    senders whose payloads the round now counts."""
    if not got and not got_lists:
        return set()
    if not any(got.values()) and not any(listed.entries for listed in (got_lists or {}).values()):
        last.sets = {**last.sets, **got}
        last.lists = None if last.lists is None else {**last.lists, **got_lists}
        logger.info(f"round {last.round}: took {len(got) + len(got_lists or {})} set(s) without a payload into "
                    f"the round's union: θ unchanged")
        history = peer.totals.history
        if history and history[-1].round == last.round + 1:
            history[-1].sets = len(last.names)
        return set()
    return _redo(peer, last, {**last.sets, **got}, len(got) + len(got_lists or {}),
                 None if last.lists is None else {**last.lists, **got_lists}, whose)


def _fetch_into(peer, round_no: int, name: str, sources: List[str], deadline: float,
                got: Dict[str, Dict[str, bytes]], got_lists: Optional[Dict[str, SetList]]) -> bool:
    """The set ``name`` into ``got``, checked, or, in a run that draws its contributions (``got_lists``
    kept), its list into ``got_lists`` (peer/round/draw.py), from the first of ``sources`` (at most
    ``TRIES_PER_SET`` asked) that serves it before ``deadline``; whether it came. The round's empty set
    comes without a fetch, whoever announced it (a client-mode member serves nothing)."""
    if name == group_sets.empty_set_name(peer.gatherer.run_digest, round_no):
        if got_lists is not None:
            got_lists[name] = draw.fetch_checked_list(peer.gatherer, peer.spec, "", name, round_no, 0.0)
        else:
            got[name] = {}
        return True
    if got_lists is not None:
        listed, _ = draw.fetch_list_from(peer.gatherer, peer.spec, sources, name, round_no, deadline, TRIES_PER_SET)
        if listed is not None:
            got_lists[name] = listed
        return listed is not None
    fetched = _first_set(peer, sources[:TRIES_PER_SET], name, round_no, deadline)
    if fetched is not None:
        got[name] = fetched
    return fetched is not None


def _first_set(peer, sources: List[str], name: str, round_no: int, deadline: float) -> Optional[Dict[str, bytes]]:
    """The set ``name`` from the first of ``sources`` that serves it before ``deadline``, checked."""
    for source in sources:
        left = deadline - time.monotonic()
        fetched = fetch_checked_set(peer.gatherer, peer.spec, source, name, round_no, left) if left > 0 else None
        if fetched is not None:
            return fetched
    return None


def _redo(peer, last: LastRound, sets: Dict[str, Dict[str, bytes]], taken: int,
          lists: Optional[Dict[str, SetList]] = None, whose: str = "that our group held") -> Set[str]:
    """Conclude ``last.round`` again from its base with ``sets`` (and ``lists``: the draw made again
    from the grown union, the payloads it newly chose fetched, peer/round/draw.py)."""
    engine = peer.engine
    drawn = None
    if lists is not None:  # fetched before the lock: the next round's steps go on meanwhile
        drawn = draw.take(peer, last.round, last.base, sets, lists, peer.membership.timing.set_fetch_s, last.snapshot.standing, last.snapshot.eligibility)
        if draw.NOT_FETCHED in drawn.excluded.values():  # θ would not be what (base, sets) names
            raise RuntimeError("a payload the union's draw chose could not be fetched")
    with engine.lock:
        if not last.concluded_here(engine):
            raise RuntimeError("θ or the tables changed since the round was concluded")
        old = last.after_hash
        if drawn is None:
            payloads, excluded = group_sets.union(sets[d] for d in sorted(sets))
            chosen, invalid, _ = engine.choose(payloads, last.round, last.base, last.snapshot.standing, last.snapshot.eligibility)  # as drawn then
            count = len(payloads)
        else:
            chosen, invalid, excluded, count = drawn.payloads, dict(drawn.invalid), drawn.excluded, len(drawn.senders)
        decoded, bad = engine.decode_at(chosen, last.round)
        # our own payload, in our group's set: the buffers give it up or take it back where it now counts
        # or no longer does (``RoundEngine.redo``)
        own = next((held[peer.peer_id] for held in sets.values() if peer.peer_id in held), None)
        settled = engine.redo(last.snapshot, decoded, {**excluded, **invalid, **bad}, me=peer.peer_id, own=own)
        last.sets, last.lists = sets, lists
        last.settle(engine)
        counted = set(chosen) - set(settled.excluded)
    logger.info(f"round {last.round}: took {taken} set(s) of the round {whose} into its union "
                f"({count} payloads): θ {old} -> {last.after_hash}")
    history = peer.totals.history
    if history and history[-1].round == last.round + 1:
        history[-1].params_hash, history[-1].sets = last.after_hash, len(last.names)
        history[-1].contributors, history[-1].excluded = settled.contributors, settled.excluded
    return counted
