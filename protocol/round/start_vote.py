"""The start-hash vote of a group after its gather (docs/round.md, "The start-hash check"): which
starting point the group takes. Pure; guarded by tests/round/test_rejoin.py and
tests/protocol/test_start_vote.py.

A group counts its own members' starts, and each member also names, in its matchmaking
announcement, the start most of the round's peers it knows hold (``swarm_lineage``, from its view of
their records). Where the swarm holds two θ (a round whose merge missed a late group's set), a group
that counted its members alone would send a member of the swarm's majority to the minority whenever
the minority outnumbers it in that group: the two lineages trade peers for rounds (a random walk).
Where most of a group names one lineage, every group that holds it sends its other members to the
swarm's majority, and the swarm holds one θ again after about one round; where most do not, the
group counts its members alone, as it always did."""

from __future__ import annotations

import re
from typing import Dict, FrozenSet, Iterable, Mapping, Optional, Tuple

__all__ = ["majority_hash", "swarm_lineage", "table_split"]

_HASH = re.compile(r"[0-9a-f]{16}")  # peer/checkpoints/files.py's params_hash


def majority_hash(hashes: Dict[str, str], excluded: Iterable[str] = (), me: Optional[str] = None,
                  unservable: Iterable[str] = (), named: Optional[Mapping[str, str]] = None,
                  announced: Optional[Mapping[str, str]] = None) -> str:
    """The starting point a group takes. Where most of the voting members name one lineage (``named``:
    member -> ``swarm_lineage`` of its view; a strict majority, members naming none or a malformed one
    counted against it), a start held by a member that announced it, or whose key it is (``announced``:
    member -> the start it announced, which ``hashes`` may count as a repaired key,
    protocol/round/group_sets.py ``start_keys``), and that can serve its state; then the start most
    members hold; then one that a member able to serve its state holds, not only ``unservable`` ones,
    which the others could not download; then the smallest hash: the same on every member.

    Only members whose payload counted vote (``excluded`` do not: a silent, equivocating or invalid
    sender may have announced anything), and only with a well-formed hash; ``me`` always votes with
    its start, and names a lineage only where it is not excluded (every member counts the same
    names). A lineage needs most of the group behind it, so a minority that names its own start (or
    no lineage, or one nobody in the group holds) leaves the vote to the count, as before; a hostile
    member can only move the group to the lineage most of it names. A hash that wins this way is
    still only a name: the state download that follows must produce parameters that hash to it, so a
    forged majority costs a refused download, never θ."""
    excluded, unservable = set(excluded), set(unservable)
    votes = {m: h for m, h in hashes.items() if m == me or (m not in excluded and _HASH.fullmatch(h))}
    counts: Dict[str, int] = {}
    for h in votes.values():
        counts[h] = counts.get(h, 0) + 1
    namers = [m for m, h in hashes.items() if m not in excluded and _HASH.fullmatch(h)]  # ``me`` aside: alike everywhere
    naming: Dict[str, int] = {}
    for m in namers:
        lineage = (named or {}).get(m, "")
        if _HASH.fullmatch(lineage):
            naming[lineage] = naming.get(lineage, 0) + 1
    lineage = next((h for h, n in naming.items() if 2 * n > len(namers)), None)
    backed = {votes[m] for m in namers if lineage is not None and m not in unservable  # (alike on every member)
              and lineage in (votes[m], (announced or {}).get(m, votes[m]))}
    servable = {h for m, h in votes.items() if m not in unservable}
    return min(counts, key=lambda h: (h not in backed, -counts[h], h not in servable, h)) if counts else ""


def swarm_lineage(starts: Iterable[Tuple[str, str]], known: Optional[Iterable[str]] = None) -> str:
    """The start most of the round's peers hold as far as one member's view shows: ``starts`` (peer,
    params hash of the round's start, from the progress records of the peers of its part in the round),
    counting only ``known`` peers where given (seen to come, or with standing: a burst of new identities
    publishing records names no lineage); of two or more that tie, the smallest hash, the same in every
    view that counts the tie (a swarm split evenly, 4 / 4 at 8 peers, otherwise trades peers between
    its halves for rounds: tests/protocol/test_start_vote.py); "" where none is well-formed (no lineage
    named: the group counts its members alone)."""
    known = None if known is None else set(known)
    counts: Dict[str, int] = {}
    for peer, h in starts:
        if _HASH.fullmatch(h) and (known is None or peer in known):
            counts[h] = counts.get(h, 0) + 1
    return min(counts, key=lambda h: (-counts[h], h)) if counts else ""


def table_split(states: Iterable[Tuple[str, str, str]], me: str, theta: str, digest: str,
                known: Optional[Iterable[str]] = None) -> FrozenSet[str]:
    """The peers that hold our θ with other lineage tables than ours, where a strict majority of the
    peers at our θ do; empty otherwise. ``states``: (peer, θ hash, state digest) from the progress
    records of the round's peers of our part; ``me``, ``theta``, ``digest``: ours. Only ``known`` peers
    count, where given (new identities reporting a digest move nothing), and only well-formed hashes.

    Two unions of a round that draws at most K contributions can hold the same drawn payloads and so
    the same θ, while the standing and eligibility tables they feed differ (the state digest,
    peer/checkpoints/files.py). The start vote compares θ only, so such a split shows nowhere until the
    tables weigh a later draw differently and θ parts, rounds later. A peer whose digest the majority
    at its θ does not share takes their state instead (peer/round/loop.py); the majority never moves,
    so the swarm ends on one state. Guarded by tests/protocol/test_start_vote.py."""
    known = None if known is None else set(known)
    holders: Dict[str, set] = {}
    counted = 1  # ourselves
    for peer, h, d in states:
        if peer == me or h != theta or not _HASH.fullmatch(d or "") or (known is not None and peer not in known):
            continue
        holders.setdefault(d, set()).add(peer)
        counted += 1
    best = max(holders, key=lambda d: (len(holders[d]), d), default=None)
    if best is None or best == digest or 2 * len(holders[best]) <= counted:
        return frozenset()
    return frozenset(holders[best])
