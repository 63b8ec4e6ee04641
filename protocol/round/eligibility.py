"""Which members of a group send their payload at all, when a round takes at most K contributions a part.

With ``outer.max_contributions`` = K the round's draw (protocol/round/choice.py) keeps, of every
part, K senders by weighted keys that only exist once the round starts (the seed is the hash of the
θ it starts from, and the round number). A group need not gather every member's payload for it: each
member **sends** its payload only with probability p, its part's, decided by SHA-256 of the seed and
its name (independent of its draw key), so the round's union holds about ``MARGIN`` × K payloads a
part instead of every member's, and the draw takes K of those by the same weighted keys as before
(docs/scale.md): a weighted draw from a uniform sample of the senders, so standing counts as much as
it did.

p is kept per part in the lineage (``update``): after each round every member moves it halfway
towards MARGIN × K / E of itself, E that part's candidates in the round's union. E / p estimates the
part's senders, so p follows the swarm's size without anyone counting it; a part with no candidate
doubles its p back towards 1 (everyone sends).

Every decision is exact integer arithmetic (p in units of 2^-20), so every member of a lineage
computes the same on any machine. Each member decides for itself and announces it (a group reads
its senders from the announcements: peer/exchange/matchmaking.py ``senders_of``); the round's draw
checks again with the round's own seed and table, so a decision made from another θ (a member
whose union was repaired at the round's start) only ships or holds back one payload. Pure
(tests/protocol/test_eligibility.py).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Set

from protocol.errors import ProtocolError
from protocol.round.choice import uniform
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


def eligible(seed: str, sender: str, p: int) -> bool:
    """Whether ``sender`` sends its payload in the round of ``seed`` at probability ``p``: U / 2^64 at
    most p, with U from SHA-256 of the seed, a tag and its name (not its draw key), in integers."""
    return p >= ONE or uniform(f"{seed}\x00send", sender) * ONE <= p << 64


def contributors(parts: Mapping[str, Optional[Part]], seed: str, table: Mapping[str, int]) -> Set[str]:
    """The members (name -> the part it announced) whose payload a group gathers this round. A member
    that announced no part sends none."""
    return {m for m, part in parts.items() if part is not None and eligible(seed, m, probability(table, part))}


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
