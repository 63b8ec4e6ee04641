"""What peers' progress records said of their groups' sets, kept across reads of the view.

A record names its group's set of ``gathered_round`` with the θ that set was applied to
(``gathered_from``) and the set of the round before. One round later it names the next set, and
what it said of the θ is gone. A peer that missed a round's gather looks for a set of its lineage
(peer/round/adopt.py ``adopt_round_set``): where its first reads after the gather show the others
already at the next round, it can no longer tell whether their set of the round was applied to its
θ. On a loaded host the others are often that far ahead (a late joiner chased the swarm for minutes,
bench/RESULTS.md, 2026-12-03). Each peer's last ``ROUNDS`` gathers, as its records said them, are kept
here: a few records per peer of the view, replaced as they come.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional

ROUNDS = 4  # gathers remembered per peer: the one a late peer asks about is at most a round or two back


def settled(progress: Any) -> bool:
    """Whether a record's gather is concluded: its peer has gone on to a later round. During its merge
    a peer's record names the θ its set applies to, and a start vote lost after withdraws that
    (peer/round/loop.py): only a concluded record speaks for the round."""
    return bool(progress.gathered) and progress.round > progress.gathered_round


class NamedSets:
    """peer id -> {gathered_round: the record (``Progress``) that named that round's set}, for the
    peers of the last read (tests/protocol/test_named_sets.py)."""

    def __init__(self, rounds: int = ROUNDS):
        self.rounds = max(1, rounds)
        self._by_peer: Dict[str, Dict[int, Any]] = {}

    def note(self, views: Iterable[Any]) -> None:
        """Remember what each concluded record of a fresh read names (``views``: objects with ``peer_id``
        and ``progress``; only records the view shows: of this run, none of a peer ignored for lying);
        peers absent from it are forgotten, so the memory is bounded by the view."""
        kept: Dict[str, Dict[int, Any]] = {}
        for v in views:
            p = v.progress
            gathers = kept.setdefault(v.peer_id, self._by_peer.get(v.peer_id, {}))
            if settled(p):
                gathers[p.gathered_round] = p
                for old in sorted(gathers)[:-self.rounds]:
                    del gathers[old]
        self._by_peer = kept

    def record(self, peer_id: str, round_no: int, name: str) -> Optional[Any]:
        """The latest record of ``peer_id`` that named ``name`` as its group's set of ``round_no``, or None."""
        p = self._by_peer.get(peer_id, {}).get(round_no)
        return p if p is not None and p.gathered == name else None


def named_late(views: Iterable[Any], round_no: int, base: str, held: Iterable[str], part: int,
               kept: Optional[NamedSets] = None) -> Dict[str, List[str]]:
    """The sets of ``round_no`` that the round's other groups named and a merge that concluded the round
    from ``base`` with the sets ``held`` lacks: name -> the peers naming it, in the order of ``views``.

    A peer's name counts where it is of our ``part`` (whoever it is: the caller bounds what names only
    new identities give cost it), and where its record of the round, concluded (``settled``: a start vote lost
    after the merge withdraws the claim), says the set was applied to ``base``: as the view shows it, or
    as ``kept`` remembers it once the peer has named a later set. Guarded by
    tests/protocol/test_named_sets.py and tests/round/test_late_sets.py."""
    held = set(held)
    named: Dict[str, List[str]] = {}
    for v in views:
        p = v.progress
        name = p.set_of(round_no)
        if not name or name in held or p.part != part:
            continue
        record = p if p.gathered_round == round_no and settled(p) else \
            kept.record(v.peer_id, round_no, name) if kept is not None else None
        if record is not None and base and record.gathered_from == base:
            named.setdefault(name, []).append(v.peer_id)
    return named
