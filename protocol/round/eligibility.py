"""Which members of a group send their payload at all, when a round takes at most K contributions a part.

With ``outer.max_contributions`` = K the round's draw (protocol/round/choice.py) keeps, of every
part, the K senders with the largest keys ``u^(1/w)``. A sender's key is known before any payload
moves: ``u`` comes from the round's seed (the hash of the θ it starts from, and the round number)
and the sender's name, ``w`` from its standing in the lineage. So a group need not gather every
member's payload to learn which ones can be drawn: it gathers only the payloads whose key passes a
**threshold** τ of their part, and the round's union holds about ``MARGIN`` × K of them a part instead
of every member's (docs/scale.md). The draw then takes the K largest keys of that union: the same K
as a draw over every member whenever at least K passed, since the keys that pass τ are the largest.

τ comes from a probability p per part, kept in the lineage (``update``): an established sender
(weight 4) passes with probability p, τ = (1 − p)^(1/4), a sender of weight w with 1 − (1 − p)^(w/4)
(a fresh identity about a quarter as often). After each round every member moves p by the number of
that part's contributions E in the round's union, halfway towards MARGIN × K / E of itself: E
estimates p × (the part's senders), so p follows the swarm's size without anyone counting it. A
part with no contribution in the union doubles its p back towards 1 (everyone sends).

Every decision is exact integer arithmetic (p in units of 2^-20; τ as a 64-bit fraction from integer
square roots), so every member of a lineage computes the same contributors on any machine. A member
whose lineage differs (another θ) may expect other owners; its θ differs already, and the next
round's start vote repairs it. Pure (tests/protocol/test_eligibility.py).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Optional, Set

from protocol.errors import ProtocolError
from protocol.round.choice import D, uniform, weight
from protocol.wire.payload import Part

__all__ = ["ONE", "MARGIN", "MAX_PARTS", "EligibilityError", "part_key", "probability", "eligible", "contributors",
           "update", "checked"]

ONE = 1 << 20  # p = 1: every member of the part sends its payload
MARGIN = 2  # contributions a part the union aims at, in units of K: fewer than K is rare
MAX_PARTS = 64  # parts a table keeps (the smallest p first); a part not in it has p = 1
MAX_KEY_CHARS = 32


class EligibilityError(ProtocolError):
    """A table from another peer (a state, a checkpoint) that is not one."""


def part_key(part: Part) -> str:
    """A part as a table's key: "-1" (the full model), "3" (a slice), "0:4" (a chain stage's blocks)."""
    return f"{part[0]}:{part[1]}" if isinstance(part, tuple) else str(int(part))


def probability(table: Mapping[str, int], part: Part) -> int:
    """p of ``part`` in units of 2^-20 (absent: ``ONE``)."""
    return table.get(part_key(part), ONE)


def _tau(p: int) -> int:
    """T with τ = T / 2^64 = (1 − p)^(1/4), rounded down: two integer square roots."""
    return math.isqrt(math.isqrt(((ONE - p) << 256) // ONE))


def eligible(seed: str, sender: str, rounds_counted: int, p: int) -> bool:
    """Whether ``sender``'s draw key passes the threshold of probability ``p``: u^(1/w) > τ, that is
    U / D > (T / 2^64)^w, compared in integers."""
    if p >= ONE:
        return True
    w = weight(rounds_counted)
    return uniform(seed, sender) << (64 * w) > _tau(max(p, 1)) ** w * D


def contributors(parts: Mapping[str, Optional[Part]], seed: str, standing: Mapping[str, int],
                 table: Mapping[str, int]) -> Set[str]:
    """The members (name -> the part it announced) whose payload a group gathers this round. A member
    that announced no part sends none."""
    return {m for m, part in parts.items()
            if part is not None and eligible(seed, m, standing.get(m, 0), probability(table, part))}


def update(table: Mapping[str, int], counts: Mapping[str, int], k: int) -> Dict[str, int]:
    """The table after a round whose union held ``counts[part key]`` contributions of each part: p
    moves halfway towards MARGIN × K / E of itself (E > 0), doubles where E = 0; parts back at 1 leave
    the table, which keeps at most ``MAX_PARTS`` (the smallest p, then the smallest key)."""
    if k <= 0:
        return {}
    target = MARGIN * k
    out: Dict[str, int] = {}
    for key in set(table) | {key for key, n in counts.items() if n > 0}:
        p, e = table.get(key, ONE), counts.get(key, 0)
        p = 2 * p if e <= 0 else p * (target + e) // (2 * e)
        if p < ONE:
            out[key] = max(p, 1)
    if len(out) > MAX_PARTS:
        out = dict(sorted(out.items(), key=lambda kv: (kv[1], kv[0]))[:MAX_PARTS])
    return dict(sorted(out.items()))


def checked(raw: Any) -> Dict[str, int]:
    """A table read from another peer's state or a checkpoint: at most ``MAX_PARTS`` part keys (str, 1
    to 32 characters) mapped to integers in [1, ONE); absent (None) reads as empty. Raises
    EligibilityError otherwise."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or len(raw) > MAX_PARTS:
        raise EligibilityError(f"an eligibility table is a map of at most {MAX_PARTS} parts")
    for key, p in raw.items():
        if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_CHARS:
            raise EligibilityError("an eligibility table's part must be a name of 1 to 32 characters")
        if isinstance(p, bool) or not isinstance(p, int) or not 0 < p < ONE:
            raise EligibilityError(f"an eligibility table's probability must be an integer in [1, {ONE})")
    return dict(sorted(raw.items()))
