"""After a gather of the round that found no group of ours: a set of the round taken instead of the state.

A peer that misses its round's gather (its timeout fired while its group completed, every other peer
gathered without it, or they had gone on to the next round when it came) would otherwise defer the
round and download the swarm's state: 3.7 MB at the 0.87M model of bench/wan.py, against a set's 57 KB,
after which a late joiner beside peers whose rounds overlap whole arrives late at the next gather
the same way. It takes instead a set the round's peers named: the one that holds its own payload
(``adopt_own_set``), or one most of whose owners are of its lineage (``adopt_round_set``), merged
then with the round's other sets as any member's (peer/round/merge.py). Each set is fetched and
checked envelope by envelope (peer/round/draw.py ``fetch_checked_set``). Guarded by
tests/round/test_adopt_lineage.py.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Dict, Iterable, Optional, Set, Tuple

from peer.exchange.results import GatherResult
from peer.round.draw import fetch_checked_set
from protocol.round.named_sets import settled

logger = logging.getLogger("voloco.peer")

OURS, KIN = 0, 1  # what makes a set ours to take, best first: it holds our payload; it is our lineage's
Verdict = Optional[Tuple[int, str]]  # (OURS or KIN, why, to log), None: not taken


def anchors(peer, lineage: Iterable[str] = ()) -> Set[str]:
    """The peers whose set we may take at all: ones we know (seen to come, ourselves included), with
    standing in our θ's lineage (a downloaded state carries it), or of ``lineage``. What a record says
    of the θ a set was applied to is its owner's claim: new identities naming a set of their own
    payloads, said to be applied to our θ, would move us onto a θ nobody else holds. A set's envelopes
    are sealed for its group, so a set with a known owner is that owner's group's real set."""
    return set(peer.membership.known()) | set(peer.engine.standing) | set(lineage)


def lineage_named(peer, round_no: int, lineage: Iterable[str] = ()) -> bool:
    """Whether a peer we may take a set from (``anchors``) names one for ``round_no`` in the view: the
    barrier found nobody of our round left to meet, and the round loop then takes that set rather
    than the state (protocol/round/round_policy.py ``after_barrier``); otherwise it defers at once."""
    known, part = anchors(peer, lineage), peer.role.progress_part
    return any(v.peer_id in known and v.progress.part == part and v.progress.set_of(round_no)
               for v in peer.membership.others())


def adopt_own_set(peer, round_no: int, payload: bytes, start_hash: str, wait_s: float,
                  lineage: Iterable[str] = (), basis: Optional[Tuple[int, str]] = None):
    """After our gather of ``round_no`` failed: the set our group agreed without us knowing, if one
    holds our ``payload`` (a timeout on our side can end a gather the other members completed with
    our payload counted). Peers that finished the round name its set (``gathered``); a set that
    holds our payload, signed by us for this round, is our group's outcome: taking it keeps us on
    our groupmates' θ, where deferring the round would leave us apart from them.

    With a ``lineage`` or ``basis`` (``adopt_round_set``), a set of our lineage is taken too, where no
    set named in that read holds our payload: the others gathered without us while our gather still
    waited for a peer they had given up on (a staller announcing the round, to a late joiner that has
    not met it yet), and taking their set keeps us in step where deferring costs a download of the
    state, after which the next round's gather is missed the same way
    (tests/round/test_adopt_lineage.py ``test_a_peer_whose_gather_timed_out_takes_a_set_of_its_lineage``).
    None if no set named within ``wait_s`` is either: the round is deferred as before."""
    me = peer.peer_id
    kin = of_lineage(peer, round_no, start_hash, lineage, basis) if lineage or basis is not None else None

    def accept(got, view, name) -> Verdict:
        if got.get(me) == payload:
            return OURS, "our gather failed, but our group completed it with our payload"
        if kin is not None and kin(got, view, name):
            return KIN, "our gather failed; the peers of our lineage gathered without us: taking their set"
        return None

    return _adopt(peer, round_no, start_hash, wait_s, accept, keep=anchors(peer, lineage) | {me})


def adopt_round_set(peer, round_no: int, start_hash: str, wait_s: float, lineage: Iterable[str] = (),
                    basis: Optional[Tuple[int, str]] = None):
    """After our gather of ``round_no`` was given up because every other peer of the round gathered
    without us (``no_group_left``): a set they named, as if our group had left our payload out. Its
    outcome (then merged with the round's other sets, as any member's) puts us on the swarm's θ at
    the price of fetching one set, where deferring the round costs a download of the whole state
    (3.7 MB at the 0.87M model of bench/wan.py, against a set's 57 KB). Our round's update stays in
    the local buffers, as when a round is deferred. Only a set with a member of ``lineage`` (our
    last round's groupmates, whose θ we took then) counts: a set gathered on another θ would give
    us a θ nobody has (a peer that trained its last round alone, or on a lineage of its own, defers
    and downloads as before); the next round's start-hash vote still catches a groupmate that has
    changed θ since. Most of the set's owners must be of ``lineage``: only owners vote in their
    group's start-hash check, so that group then took our θ as its start, and the set's outcome from
    our θ is the group's. One of two is not enough: with one owner of each lineage the tied vote may
    go to the other θ, our groupmate then downloads it, and we would end the round on a θ nobody
    else holds. None if no such set can be had within ``wait_s`` (tests/round/test_adopt_lineage.py,
    ``test_a_peer_the_round_gathered_without_takes_a_named_set_and_merges_the_rest``).

    A groupmate of our last round counts only where its record names, for that round, the set our
    group agreed (``peer.gathered``): a member cut off in the middle of the round's gather decided it
    with a set of its own, and its θ is then apart from theirs: their next set taken onto that θ
    would leave it apart until a later start-hash vote. Such a peer, or one whose groupmates'
    records no longer name that round, defers and downloads instead (tests/round/test_adopt_lineage.py,
    ``test_a_groupmate_that_agreed_another_set_last_round_is_not_of_our_lineage``).

    ``basis`` (round_no - 1, a set's name), for a peer whose θ of this round is a state it downloaded
    (peer/round/state_sync.py ``Basis``: the set its server's group agreed in the round before): it
    has no groupmates, and its lineage is every peer whose record names that set for that round.
    Without this such a peer stays apart when the others' rounds overlap: it has its θ only when they
    are ready for the round, arrives after their group has gathered, defers, downloads the next state,
    and again; taking their set keeps the steps it took meanwhile, so it is in step with them by the
    next round (``test_a_peer_that_installed_a_state_takes_the_set_of_its_servers_lineage``).

    Whatever the lineage, a peer whose record says its group's set of ``round_no`` was applied to our
    θ (``gathered_from == start_hash``) is of it: in a swarm of many groups a lineage of one group
    is rarely most of any set's owners
    (``test_a_peer_takes_a_set_whose_owners_applied_it_to_its_own_theta``).

    The barrier's round loop takes this path too where the others had gone on to the next round when
    it came, their set of ours named (``lineage_named``). Only a set with an owner among ``anchors``
    is judged (tests/round/test_adopt_lineage.py
    ``test_new_identities_claiming_our_theta_do_not_make_us_take_their_set``)."""
    kin = of_lineage(peer, round_no, start_hash, lineage, basis)
    why = "every other peer gathered without us: taking their set instead of their state"
    return _adopt(peer, round_no, start_hash, wait_s, lambda got, view, name: (KIN, why) if kin(got, view, name) else None,
                  keep=anchors(peer, lineage))


def of_lineage(peer, round_no: int, start_hash: str, lineage: Iterable[str] = (),
               basis: Optional[Tuple[int, str]] = None) -> Callable[[Dict[str, bytes], list, str], bool]:
    """``adopt_round_set``'s test of a set of ``round_no`` named ``name``: an owner (``got``) is among
    ``anchors``, and most of them are of our lineage, as the records of ``view`` say, or as an earlier
    read's did (``Membership.named_sets``). A record counts once its owner has concluded the round
    (``settled``): during its merge it says the θ its set applies to, which a start vote lost after
    withdraws."""
    lineage = set(lineage)
    before, ours = basis if basis is not None else peer.gathered
    named_sets, known = peer.membership.named_sets, anchors(peer, lineage)

    def kin(view, name: str) -> Set[str]:
        # owners that name this very set for the round, and whose record says it was applied to our θ;
        # in a swarm of many groups a lineage of one group is rarely most of a set's owners (at 32 peers
        # a downloaded state's holder missed one gather after another: bench/RESULTS.md, 2026-12-01).
        # A record that names another θ for the round is of another lineage whatever it named before.
        # The record of the round itself says that: where the view shows one that has moved on to the
        # next round, the one an earlier read kept (a late joiner on a loaded host always read them late)
        said = {}
        for v in view:
            if v.progress.set_of(round_no) == name:
                said[v.peer_id] = v.progress if v.progress.gathered_round == round_no and settled(v.progress) \
                    else named_sets.record(v.peer_id, round_no, name)
        same = {p for p, r in said.items() if r is not None and r.gathered_from == start_hash}
        if before != round_no - 1 or not ours:
            return same
        return same | {p for p, r in said.items() if r is not None and r.gathered_from in ("", start_hash)
                       and (basis is not None or p in lineage) and r.gathered_before == ours}

    return lambda got, view, name: bool(known & set(got)) and 2 * len(kin(view, name) & set(got)) > len(got)


def _adopt(peer, round_no: int, start_hash: str, wait_s: float,
           accept: Callable[[Dict[str, bytes], list, str], Verdict], keep: Set[str]):
    """The best set named for ``round_no`` that ``accept(set, records, its name)`` takes in one read of
    the view (``records``: that read), as a GatherResult; None past ``wait_s``. A set fetched is judged
    again at each fresh read (its owners' records change, and what ``Membership.named_sets`` keeps of
    them grows), and kept for that only where an owner is in ``keep``: a set no rule can take is
    judged once and not held. Peers in ``keep`` are asked first, and a set one peer naming it did not
    serve is asked of the next: a stranger naming a real set it does not serve costs one try, not the
    set (tests/round/test_adopt_lineage.py ``test_a_set_one_namer_does_not_serve_is_asked_of_another``)."""
    membership, gatherer, spec, me = peer.membership, peer.gatherer, peer.spec, peer.peer_id
    timing = membership.timing
    part = peer.role.progress_part
    tried: Set[Tuple[str, str]] = set()  # (name, peer asked) that failed; bounded by the view's records
    fetched: Dict[str, Dict[str, bytes]] = {}  # name -> the checked set, where an owner is in keep
    dropped: Set[str] = set()  # names of sets fetched whose owners no rule can take (a name fixes its set)
    judged = None  # the read whose records the fetched sets were last judged by
    deadline = time.monotonic() + wait_s
    while not peer.stop_event.is_set():
        view = membership.view()
        fresh, judged = membership.read_began != judged, membership.read_began
        best, seen = None, set()
        for v in sorted(view, key=lambda v: v.peer_id not in keep):
            p = v.progress
            name = p.set_of(round_no)
            if v.peer_id == me or p.part != part or not name or name in seen or name in dropped:
                continue
            got = fetched.get(name)
            if got is None:
                if (name, v.peer_id) in tried:
                    continue
                if time.monotonic() >= deadline:
                    break  # (a set taken in this read still counts)
                tried.add((name, v.peer_id))
                timeout = min(timing.set_fetch_s, max(timing.set_fetch_min_s, deadline - time.monotonic()))
                got = fetch_checked_set(gatherer, spec, v.peer_id, name, round_no, timeout)
                if got is None:
                    continue  # another peer naming it may serve it
                if keep & set(got):
                    fetched[name] = got
                else:
                    dropped.add(name)
            elif not fresh:
                continue
            seen.add(name)  # (judged once a read, however many peers name it)
            verdict = accept(got, view, name)
            if verdict is not None and (best is None or verdict[0] < best[0][0]):
                best = (verdict, name, v.peer_id, got)
                if verdict[0] == OURS:
                    break
        if best is not None:
            (_, why), name, source, got = best
            logger.info(f"round {round_no}: {why} (set {name[:12]}, from {source})")
            return GatherResult(group=sorted(got), payloads=got, excluded={}, start_hashes={me: start_hash},
                                set_digest=name)
        if time.monotonic() >= deadline:
            return None
        time.sleep(timing.view_poll_s)
    return None
