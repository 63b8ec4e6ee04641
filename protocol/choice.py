"""Which contributions enter θ in a round, when a round may take at most K of them per part.

A swarm of thousands cannot have every peer download and decode every payload of every round. With
``outer.max_contributions`` = K > 0, at most K contributions of each *part* of the model (the full
model, one parameter slice, one chain stage's block range) enter θ in a round; the others stay with
their senders (their strategy keeps the update for a later round: docs/scale.md).

Every member of a round must pick the same K, and no contributor should be able to buy its way in,
so the choice is a weighted draw without replacement (Efraimidis and Spirakis' keys: the K largest
``log(u) / w``), where

- ``u`` comes from SHA-256 of the round's seed and the sender's name: the seed is the hash of the θ
  the round started from and the round number, known to everyone only once the previous round has
  concluded, after the identities of this round's senders were made, and moved by every
  contribution that entered that θ;
- ``w`` is the sender's standing in this lineage (protocol/standing.py): a fresh identity draws at a
  quarter of an established sender's weight, so a burst of new identities takes few of the K places,
  and those it takes are judged by the direction check like any fresh sender's.

Pure and deterministic: the same candidates, seed and table give the same choice on any machine
(tests/protocol/test_choice.py).
"""

from __future__ import annotations

import hashlib
import math
from typing import Dict, Hashable, List, Mapping

from protocol.standing import ESTABLISHED

__all__ = ["choose", "weight"]


def weight(rounds_counted: int) -> float:
    """A sender's weight in the draw: (1 + rounds counted, at most ESTABLISHED) / (1 + ESTABLISHED)."""
    return (1 + min(max(rounds_counted, 0), ESTABLISHED)) / (1 + ESTABLISHED)


def _key(seed: str, sender: str, w: float) -> float:
    digest = hashlib.sha256(f"{seed}\x00{sender}".encode("utf-8", "surrogatepass")).digest()
    u = (int.from_bytes(digest[:8], "big") + 1) / (2**64 + 1)  # in (0, 1), never 0 or 1
    return math.log(u) / w


def choose(parts: Mapping[str, Hashable], k: int, seed: str, standing: Mapping[str, int]) -> List[str]:
    """The senders whose contributions enter θ, sorted: of every part (``parts``: sender -> the part
    its payload carries), all if it has at most ``k``, else the ``k`` with the largest keys (ties:
    the smaller name). ``k`` <= 0 takes every contribution."""
    if k <= 0:
        return sorted(parts)
    by_part: Dict[Hashable, List[str]] = {}
    for sender, part in parts.items():
        by_part.setdefault(part, []).append(sender)
    chosen: List[str] = []
    for senders in by_part.values():
        if len(senders) <= k:
            chosen.extend(senders)
            continue
        keyed = sorted(senders, key=lambda s: (-_key(seed, s, weight(standing.get(s, 0))), s))
        chosen.extend(keyed[:k])
    return sorted(chosen)
