"""Whom a peer downloads the swarm's state from, and what the other peers' records vouch for: pure
functions of progress records (``views``: anything with ``peer_id`` and ``progress``), used by
peer/round/state_sync.py. Guarded by tests/round/test_state_sources.py and tests/round/test_resync.py."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace
from typing import AbstractSet, Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Set, Tuple

from protocol.dht.records import Progress
from protocol.round.peer_states import EXCHANGING, NOT_A_SOURCE, STOPPED

ROUND_SPREAD = 2  # honest peers of a swarm are within a round or two of each other


class Source(NamedTuple):
    """A groupmate asked in a repair whose record did not show the round: what is assumed of it."""

    peer_id: str
    progress: Progress
    expires: float = 0.0


class LeftOut:
    """Peers whose records a view leaves out, until when (monotonic seconds, passed in), and which of
    them for lying (a state refused) rather than for silence; entries past their time are dropped."""

    def __init__(self) -> None:
        self._until: Dict[str, float] = {}
        self._lied: Set[str] = set()

    def leave_out(self, peer: str, until: float, now: float, lied: bool) -> None:
        self._until = {p: t for p, t in self._until.items() if t > now}
        self._lied &= set(self._until)
        self._until[peer] = until
        if lied:  # (a liar left out again for silence stays a liar while it is left out)
            self._lied.add(peer)

    def hides(self, peer: str, now: float) -> bool:
        return self._until.get(peer, 0.0) > now

    def lied(self, peer: str, now: float) -> bool:
        return peer in self._lied and self.hides(peer, now)


def order_sources(views: Sequence[Any], target: int, slack: int = 0, spread: int = ROUND_SPREAD) -> List[Any]:
    """The views of peers to download a state of at least ``target`` from, best first: peers from
    ``target - slack`` to ``target + spread`` (one far ahead of that is an outlier, never
    asked), rounds that two or more peers report first, then higher rounds; within a round, the
    parameters (``params_hash``) most of its peers report first (after a round that ended with two
    θ, the majority's lineage, not the pair that stopped waiting for it), and at one θ the tables
    (``state_digest``) most of them report (a union that differed unseen leaves a few peers the
    swarm's θ with other tables: a state of theirs would be installed as the swarm's, its tables
    parting from the swarm's a few rounds later); in random order among equals; peers that others
    cannot dial (``reach`` "client", swarm/access/reachability.py) last
    (tests/round/test_state_sources.py ``test_sources_of_the_parameters_most_peers_of_a_round_report_come_first``)."""
    counts = Counter(v.progress.round for v in views)
    lineages = Counter((v.progress.round, getattr(v.progress, "params_hash", "")) for v in views)
    tables = Counter(_state_of(v) for v in views)
    usable = [v for v in views if target - slack <= v.progress.round <= target + spread]
    random.shuffle(usable)
    return sorted(usable, key=lambda v: (getattr(v.progress, "reach", "") == "client", counts[v.progress.round] < 2,
                                         -v.progress.round,
                                         -lineages[(v.progress.round, getattr(v.progress, "params_hash", ""))],
                                         -tables[_state_of(v)]))


def _state_of(view: Any) -> Tuple[int, str, str]:
    """(round, θ's hash, state digest) that a record reports."""
    p = view.progress
    return p.round, getattr(p, "params_hash", ""), getattr(p, "state_digest", "")


def grouped(views: Sequence[Any], target: int) -> int:
    """How many of ``views`` are at ``target`` or a little later and gathered in a group lately
    (a set named for their last round or the one before: peer/round/merge.py)."""
    return sum(1 for v in views if target <= v.progress.round <= target + ROUND_SPREAD
               and getattr(v.progress, "gathered", "") and getattr(v.progress, "gathered_round", -9) >= v.progress.round - 2)


def repair_sources(shown: Iterable[Any], mates: AbstractSet[str], round_no: int, lied: Callable[[str], bool],
                   digest: str) -> List[Any]:
    """The groupmates a start vote named, as sources of its state of ``round_no``, whatever their records
    say yet (none read, a lagging round, a claim far ahead: announcing that round, reporting no θ), but
    not one stopped or left out for ``lied``; those whose record shows the round first, peers others
    cannot dial last (tests/round/test_resync.py::test_a_repair_asks_the_groupmates_its_view_does_not_show_yet)."""
    seen = {v.peer_id: v for v in shown if v.peer_id in mates}
    out: List[Any] = []
    for mate in [*seen, *sorted(set(mates) - set(seen))]:
        view = seen.get(mate)
        if lied(mate) or view is not None and view.progress.state == STOPPED:
            continue
        if view is None:
            view = Source(mate, Progress(round_no, 0, EXCHANGING, digest, float("nan"), float("nan"), 0, 0.0, 0, 0, ""))
        elif not round_no <= view.progress.round <= round_no + ROUND_SPREAD:
            view = Source(mate, replace(view.progress, round=round_no, params_hash="", state_digest=""), view.expires)
        out.append(view)
    return sorted(out, key=lambda v: (getattr(v.progress, "reach", "") == "client", not v.progress.params_hash))


def finishing(views: Sequence[Any], server: str, round_no: int, among: Optional[AbstractSet[str]], me: str) -> bool:
    """Whether ``server`` and another live peer of ``views`` (of ``among`` only, where given; not
    ``me``) both announce ``round_no``."""
    live = {v.peer_id for v in views if v.progress.round == round_no and v.progress.state not in NOT_A_SOURCE}
    return server in live and bool(live - {server, me} if among is None else (live & set(among)) - {server, me})


def reported_hashes(views: Sequence[Any], excluding: str, among: Optional[AbstractSet[str]] = None) -> Dict[int, Set[str]]:
    """round -> what peers (but ``excluding``; of ``among`` only, where given: ``sync_target``'s
    vouchers) report for it: ``θ hash:state digest``, or θ's hash alone from a record without a
    digest (an older peer's; a training peer reports none while its exchange holds θ)."""
    out: Dict[int, Set[str]] = {}
    for v in views:
        p = v.progress
        if v.peer_id != excluding and (among is None or v.peer_id in among) and p.params_hash:
            out.setdefault(p.round, set()).add(f"{p.params_hash}:{p.state_digest}" if p.state_digest else p.params_hash)
    return out
