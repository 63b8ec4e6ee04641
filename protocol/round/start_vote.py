"""The start-hash vote of a group after its gather (docs/round.md, "The start-hash check"): which
starting point most of the group shares. Pure; guarded by tests/round/test_rejoin.py."""

from __future__ import annotations

import re
from typing import Dict, Iterable, Optional

__all__ = ["majority_hash"]

_HASH = re.compile(r"[0-9a-f]{16}")  # peer/checkpoints/files.py's params_hash


def majority_hash(hashes: Dict[str, str], excluded: Iterable[str] = (), me: Optional[str] = None,
                  unservable: Iterable[str] = ()) -> str:
    """The starting point most of a group shares (ties: one that a member able to serve its state
    holds, not only ``unservable`` ones, which the others could not download; then the smallest
    hash: the same on every member).

    Only members whose payload counted vote (``excluded`` do not: a silent, equivocating or invalid
    sender may have announced anything), and only with a well-formed hash; ``me`` always votes.
    A hash that wins this way is still only a name: the state download that follows must produce
    parameters that hash to it, so a forged majority costs a refused download, never θ."""
    votes = {m: h for m, h in hashes.items() if m == me or (m not in set(excluded) and _HASH.fullmatch(h))}
    counts: Dict[str, int] = {}
    for h in votes.values():
        counts[h] = counts.get(h, 0) + 1
    servable = {h for m, h in votes.items() if m not in set(unservable)}
    return min(counts, key=lambda h: (-counts[h], h not in servable, h)) if counts else ""
