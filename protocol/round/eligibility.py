"""Which members of a group send their payload at all, when a round takes at most K contributions a part.

With ``outer.max_contributions`` = K the round's draw (protocol/round/choice.py) keeps, of every
part, K senders by weighted keys that only exist once the round starts (the seed is the hash of the
θ it starts from, and the round number). A group need not gather every member's payload for it: each
member **sends** its payload only with a probability, decided by SHA-256 of the seed and its name
(independent of its draw key), so the round's union holds about ``target(K)`` payloads a part
instead of every member's, and the draw takes K of those (docs/scale.md). Every payload sent and not
drawn is a payload some peers downloaded for nothing, hence a margin of a quarter over K (at least
``SPARE`` payloads, so a small K is seldom short), not more: a round that draws fewer than K takes
every sender, and what was not sent stays with its owner.

The probability weighs standing like the draw does: a member of weight w (protocol/round/choice.py
``weight``: 1 to ``TOP`` quarters, 1 for a fresh identity) sends with probability min(1, p × w /
``TOP``), p its part's. A burst of fresh identities so sends a quarter as often as established
members and takes a quarter of their share of the union, before any draw.

p is kept per part in the lineage (``update``), in [1, ``CAP``] units of 2^-20 (``CAP`` = ``TOP``:
everyone sends, fresh members too; a part absent from the table has it). After each round every
member estimates the part's members M, weighed by standing, from the round's candidates (``mass``:
a candidate that was sure to send counts its own weight, one that sent with probability π stands for
w / π of them), adds the standing the round gave or took (a drawn sender that counted weighs a
quarter more next round), and moves p halfway towards target(K) × ``CAP`` / M, so p follows the
swarm's size without anyone counting it; a part with no candidate doubles its p back towards
``CAP``. From ``CAP`` (a part's first round, or one back there) every member sent: M is exact, not
a draw, so p moves the whole way at once, by at most ``MAX_FALL`` (made-up sets of fresh identities
count in M). Counting the standing a round gives matters in a run's first rounds, when the drawn
senders grow heavier round after round: aimed at the round's own candidates, p let about 13 of 32
fresh peers send a round at K = 8 over rounds 2 to 8 instead of the rule's steady 11
(bench/send_rate.py --first-rounds; tests/protocol/test_eligibility.py,
``test_p_counts_the_standing_its_round_gave_so_a_young_swarm_sends_about_the_target``).

Every decision is exact integer arithmetic, so every member of a lineage computes the same on any
machine. Each member decides for itself and announces it (a group reads its senders from the
announcements: peer/exchange/matchmaking.py ``senders_of``); the round's draw checks again with the
round's own seed and tables, so a decision made from another θ (a member whose union was repaired
at the round's start) only ships or holds back one payload. Pure (tests/protocol/test_eligibility.py).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any, Dict, Iterable, Mapping, Optional, Sequence, Set, Tuple

from protocol.errors import ProtocolError
from protocol.round.choice import uniform, weight
from protocol.round.standing import ESTABLISHED
from protocol.wire.payload import Part

__all__ = ["ONE", "TOP", "CAP", "MARGIN", "SPARE", "MAX_PARTS", "MAX_FALL", "EligibilityError", "part_key", "probability",
           "eligible", "may_send", "contributors", "target", "mass", "update", "checked"]

ONE = 1 << 20  # probability 1
TOP = weight(ESTABLISHED)  # an established member's weight (4 quarters); a fresh one's is 1
CAP = ONE * TOP  # p at which every member sends, a fresh one too
MARGIN = Fraction(5, 4)  # contributions a part the union aims at, in units of K ...
SPARE = 2  # ... and at least this many over K
MAX_PARTS = 64  # parts a table keeps (the smallest p first); a part not in it has p = CAP
MAX_FALL = 32  # p falls at most this many times in one step from CAP (below CAP: at most halves)
MAX_KEY_CHARS = 32


class EligibilityError(ProtocolError):
    """A table from another peer (a state, a checkpoint) that is not one."""


def part_key(part: Part) -> str:
    """A part as a table's key: "-1" (the full model), "3" (a slice), "0:4" (a chain stage's blocks)."""
    return f"{part[0]}:{part[1]}" if isinstance(part, tuple) else str(int(part))


def probability(table: Mapping[str, int], part: Part) -> int:
    """p of ``part`` in units of 2^-20 (absent: ``CAP``)."""
    return table.get(part_key(part), CAP)


def eligible(seed: str, sender: str, p: int, w: int) -> bool:
    """Whether ``sender`` of weight ``w`` (quarters) sends its payload in the round of ``seed`` at its
    part's ``p``: U / 2^64 at most p × w / TOP, with U from SHA-256 of the seed, a tag and its name
    (not its draw key), in integers."""
    return p * w >= CAP or uniform(f"{seed}\x00send", sender) * CAP <= (p * w) << 64


def may_send(seed: str, table: Mapping[str, int], standing: Mapping[str, int], sender: str, part: int,
             sends: str = "") -> bool:
    """Whether a peer whose progress record shows ``part`` (and ``sends``: a chain stage's blocks, or
    "") may send its payload in the round of ``seed``: the peers a round of at most K waits for, since
    the draw passes over every other's payload (``RoundEngine.draw``). A record is a claim: a peer may
    send under either part it names (one that names a stage's blocks to look like a non-sender and
    sends a full replica's payload is still waited for), and one that has not chosen its part yet
    (``part`` below -1) may send, as far as anyone can tell (tests/protocol/test_eligibility.py)."""
    if part < -1:
        return True
    w = weight(standing.get(sender, 0))
    return any(eligible(seed, sender, table.get(key, CAP), w) for key in filter(None, (sends, str(int(part)))))


def contributors(parts: Mapping[str, Optional[Part]], seed: str, table: Mapping[str, int],
                 standing: Mapping[str, int]) -> Set[str]:
    """The members (name -> the part it announced) whose payload a group gathers this round, weighed
    by ``standing`` (rounds counted; absent: fresh). A member that announced no part sends none."""
    return {m for m, part in parts.items()
            if part is not None and eligible(seed, m, probability(table, part), weight(standing.get(m, 0)))}


def target(k: int) -> Fraction:
    """Contributions a part the union aims at when a round takes at most ``k``: 5/4 K, at least K + 2."""
    return max(MARGIN * k, Fraction(k + SPARE))


def mass(p: int, weights: Iterable[int]) -> Fraction:
    """The part's members, weighed by standing (in quarters), that a round's candidates of ``weights``
    (each at the draw) stand for at ``p``: a candidate that was sure to send (p × w ≥ ``CAP``) counts its
    own weight; one that sent with probability p × w / ``CAP`` stands for ``CAP`` / p quarters, itself and
    the members like it that did not send (the Horvitz-Thompson estimate). Exact at ``CAP``, where
    everyone sent."""
    unsure = Fraction(CAP, p)
    return sum((Fraction(w) if p * w >= CAP else unsure for w in weights), Fraction(0))


def update(table: Mapping[str, int], candidates: Mapping[str, Sequence[Tuple[int, int]]], k: int) -> Dict[str, int]:
    """The table after a round whose union held ``candidates[part key]``: per candidate, its weight at the
    round's draw and its weight after the round (protocol/round/choice.py ``weight`` of its standing
    before and after ``standing.advance``). p moves halfway towards target(K) × ``CAP`` / M, M the part's
    members by ``mass`` plus the weight the round gave or took (the whole way from ``CAP``, where M is
    exact, by at most ``MAX_FALL``), doubles where no candidate came; parts back at ``CAP`` leave the
    table, which keeps at most ``MAX_PARTS`` (the smallest p, then the smallest key).
    tests/protocol/test_eligibility.py."""
    if k <= 0:
        return {}
    aim = target(k)
    out: Dict[str, int] = {}
    for key in set(table) | {key for key, c in candidates.items() if c}:
        p, cands = table.get(key, CAP), candidates.get(key, ())
        if not cands:
            p = 2 * p
        else:
            members = mass(p, (w for w, _ in cands)) + sum(after - w for w, after in cands)
            aimed = int(aim * CAP // max(members, Fraction(len(cands))))
            p = max(aimed, p // MAX_FALL) if p >= CAP else (p + aimed) // 2
        if p < CAP:
            out[key] = max(p, 1)
    if len(out) > MAX_PARTS:
        out = dict(sorted(out.items(), key=lambda kv: (kv[1], kv[0]))[:MAX_PARTS])
    return dict(sorted(out.items()))


def checked(raw: Any) -> Dict[str, int]:
    """A table read from another peer's state or a checkpoint: at most ``MAX_PARTS`` part keys (str, 1
    to 32 characters) mapped to integers in [1, CAP); absent (None) reads as empty. Raises
    EligibilityError otherwise."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or len(raw) > MAX_PARTS:
        raise EligibilityError(f"an eligibility table is a map of at most {MAX_PARTS} parts")
    for key, p in raw.items():
        if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_CHARS:
            raise EligibilityError("an eligibility table's part must be a name of 1 to 32 characters")
        if isinstance(p, bool) or not isinstance(p, int) or not 0 < p < CAP:
            raise EligibilityError(f"an eligibility table's probability must be an integer in [1, {CAP})")
    return dict(sorted(raw.items()))
