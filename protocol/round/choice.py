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
- ``w`` is the sender's standing in this lineage (protocol/round/standing.py), in quarters: 1 + rounds
  counted, at most 4; a fresh identity draws at a quarter of an established sender's weight, so a
  burst of new identities takes few of the K places, and those it takes are judged by the direction
  check like any fresh sender's.

Keys are compared exactly, in integers (u = U / D, so u_a^(1/w_a) > u_b^(1/w_b) exactly when
U_a^(w_b) D^(w_a) > U_b^(w_a) D^(w_b)): no floating-point logarithm, whose last bit may differ
between C libraries, decides who enters θ.

Pure and deterministic: the same candidates, seed and table give the same choice on any machine
(tests/protocol/test_choice.py).
"""

from __future__ import annotations

import functools
import hashlib
from typing import Dict, Hashable, List, Mapping, Tuple

from protocol.round.standing import ESTABLISHED

__all__ = ["D", "choose", "uniform", "weight"]

D = 2**64 + 1  # u = U / D with U in [1, 2^64]: never 0 or 1


def weight(rounds_counted: int) -> int:
    """A sender's weight in the draw, in quarters: 1 + rounds counted, at most 1 + ESTABLISHED (= 4)."""
    return 1 + min(max(rounds_counted, 0), ESTABLISHED)


def uniform(seed: str, sender: str) -> int:
    digest = hashlib.sha256(f"{seed}\x00{sender}".encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") + 1


def _order(a: Tuple[str, int, int], b: Tuple[str, int, int]) -> int:
    """-1 if ``a`` (sender, U, w) draws before ``b``: the larger key u^(1/w), then the smaller name."""
    (name_a, u_a, w_a), (name_b, u_b, w_b) = a, b
    left, right = u_a**w_b * D**w_a, u_b**w_a * D**w_b
    if left != right:
        return -1 if left > right else 1
    return -1 if name_a < name_b else (1 if name_a > name_b else 0)


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
        keyed = [(s, uniform(seed, s), weight(standing.get(s, 0))) for s in senders]
        keyed.sort(key=functools.cmp_to_key(_order))
        chosen.extend(s for s, _, _ in keyed[:k])
    return sorted(chosen)
