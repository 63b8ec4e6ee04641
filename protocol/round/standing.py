"""Standing: how many rounds a sender's contribution has counted in this θ lineage.

Influence is earned. The direction check (peer/outer/consensus.py) judges each contribution against
the others of its round; standing decides who judges and how much benefit of the doubt a sender gets:

- a sender is *established* once its contributions have counted on their own agreement in
  ``ESTABLISHED`` rounds of this lineage (a refused one starts it again from 0; ``advance``);
- only established senders' contributions judge the others, once a round has ``MIN_JUDGES`` of
  them: a burst of fresh identities can vote nobody out, whatever its size, and is itself judged
  by the established ones;
- where ``MIN_JUDGES`` established contributions carry a tensor, the fresh ones that pass the check
  weigh together at most ``FRESH_SHARE`` of that tensor's average (``weights``, applied by
  peer/outer/strategies.average): a burst of new identities whose updates agree enough to pass
  still moves θ by a bounded share;
- an established sender's contribution is refused only when it points *against* the others
  (score ≤ −``AGAINST`` × min_z: twice the evidence a fresh sender must show for); one with no
  clear direction (|score| < min_z: a slow peer that closed its round
  early, a peer with unusual data, rounds in which its error feedback sent old residue) counts. A
  fresh sender must show agreement: a score ≥ min_z, or its *evidence* pooled over its rounds ≥
  min_z (below); a fresh full replica must also reach a share of its round's median full-replica
  score (``fresh_bar``, the run spec's ``outer.fresh_agreement``): honest replicas agree with each
  other in proportion to what they learned, +18 to +26 in the first rounds of real peers, while a
  peer trained on random ASCII agreed with them at +2 to +4 and, in rounds 0-1, before anyone was
  established, passed the fixed bar of 3 (three beside 6 honest real peers: +4.64 % loss over 4
  rounds, bench/RESULTS.md "Seventy-eighth session").

Standing follows agreement, not mere counting (``advance`` with the round's scores): a round that
counted on pooled evidence earns no standing (a sender gains a round only with a score ≥ min_z),
and an established sender whose contribution agreed with the others no better than chance (score
≤ 0) counts that round and loses one round of standing: trust earned over many rounds is spent a
round at a time, not on one bad round (resetting it to 0 refused an honest peer on other data once
in 8 seeds, late in a run, bench/RESULTS.md "Seventy-eighth session"). A peer
trained on random ASCII agrees weakly with honest ones in a run's first rounds (byte statistics:
+2 to +4), earned standing on pooled rounds, and then counted round after round at scores of −1.4
to +1.4 while it raised the honest loss; three such peers beside 6 honest ones cost +2.45 % over 3
seeds, and +0.93 % with standing earned so (bench/trust.py --attacks garbage-ascii, bench/RESULTS.md
"Seventy-eighth session"). An honest chain stage that only ever passes on pooled evidence stays
fresh: it counts, judges nobody and weighs within the fresh share.

Evidence: one round's score of an honest sender with a weak signal (a chain stage, compared on its
slice of the model, trained on fewer tokens a round: +0.6 to +9.1 in bench/direction_scores.py's
chain arm, a third of its rounds below 3) can sit below min_z
round after round, and a refusal would leave it fresh for ever. So a fresh sender's positive scores
are pooled over its consecutive rounds (Stouffer's z: Σ z / √n, the same statistic over more
tests), and a round in which the pooled score reaches min_z counts. A score ≤ 0 starts the
pool again; it holds the last ``EVIDENCE_ROUNDS`` rounds at most (older ones fade, ``gather``), and
it fades in each round its sender is not scored, so a departed sender's pool does not stay. An
update without direction (noise: scores symmetric about 0) must string positive rounds together
above chance to pass (two rounds: a sum of 3√2): scores drawn N(0, 1) count in 0.47 % of rounds
against 0.13 % for one round above 3, and rounds counted so never make it established
(tests/protocol/test_standing.py). Scores are kept in integer
thousandths, so every member pools the same numbers.

Standing is a function of the lineage's concluded rounds, so every member of the lineage holds
the same table; it travels with θ in a downloaded state and in a checkpoint. A table from another
peer is input like any other: ``checked`` bounds and validates it. What a patient attacker can do:
contribute honestly for ``ESTABLISHED`` rounds per identity, then judge as one established voter
among the others, and send updates without a clear direction, which count while its standing lasts:
each one at or below chance spends a round of it and none earns any (noise at an honest norm:
bench/trust.py --attacks turncoat-noise); updates pointing against the others stay refused
whatever its standing.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from protocol.errors import ProtocolError

__all__ = ["ABSENT_ROUNDS", "AGAINST", "ESTABLISHED", "EVIDENCE_ROUNDS", "FRESH_SHARE", "MIN_JUDGES", "MAX_SENDERS", "MAX_COUNT",
           "StandingError", "advance", "checked", "checked_evidence", "convinced", "fresh_bar", "gather", "weights"]

ESTABLISHED = 3  # rounds counted before a sender judges and gets the benefit of the doubt
# An established sender is refused at a score of -AGAINST x min_agreement or below. Not 1: an honest
# slow peer (a quarter of H a round) scored -3.4 once in 36 rounds under the pooled statistic before
# (+5.3 at least per tensor, peer/outer/consensus.py); established senders that turn to negated updates
# score -15 or lower and are refused every round (bench/trust.py --attacks turncoat); fresh negators
# judged by all, their own kind among the judges, as high as -5.3 (bench/direction_scores.py)
AGAINST = 2.0
MIN_JUDGES = 2  # established contributions a round needs before only they judge (fewer: all judge)
# Once MIN_JUDGES established contributions are in a round, its fresh ones weigh at most this share of
# its average together: a third, so established senders keep twice the weight of any burst
FRESH_SHARE = Fraction(1, 3)
MAX_SENDERS = 4096  # senders a table keeps; the lowest standing (then the greatest name) goes first
MAX_COUNT = 1 << 20  # a count stops growing here
MAX_NAME_CHARS = 128
EVIDENCE_ROUNDS = 8  # rounds a fresh sender's evidence pools at most
MILLI = 1000  # evidence is kept in thousandths of a standard deviation: integers, the same everywhere
MAX_MILLI = 10**9 * EVIDENCE_ROUNDS  # a pool's sum at most (a score is far below 10^6)

# rounds without a score after which the largest pool (MAX_MILLI) has faded to nothing, at 7/8 a round
ABSENT_ROUNDS = math.ceil(math.log(MAX_MILLI) / math.log(EVIDENCE_ROUNDS / (EVIDENCE_ROUNDS - 1))) + 1

Evidence = Tuple[int, int]  # (the sum of a fresh sender's pooled scores in thousandths, the rounds pooled)


class StandingError(ProtocolError):
    """A standing table from another peer (a state, a checkpoint) that is not one."""


def advance(standing: Mapping[str, int], counted: Iterable[str], refused: Iterable[str],
            scores: Optional[Mapping[str, float]] = None, min_z: float = 0.0) -> Dict[str, int]:
    """The table after a round: +1 for every sender whose contribution counted, 0 for every sender
    whose contribution the round's checks refused, the others unchanged; at most ``MAX_SENDERS``
    entries. With the round's direction ``scores`` and its bar ``min_z`` > 0, standing is earned by
    agreement alone: a sender gains a round only with a score ≥ ``min_z`` (a fresh one that counted
    on its pooled evidence, an established one that counted with a weak direction, keep their
    count), and an established one whose contribution agreed with the others' no better than chance
    (a score ≤ 0) loses one, though its contribution counted. Deterministic
    (tests/protocol/test_standing.py)."""
    out, scores = dict(standing), (scores or {}) if min_z > 0 else {}
    for sender in counted:
        had, z = out.get(sender, 0), scores.get(sender)
        if z is None or z >= min_z:
            out[sender] = min(had + 1, MAX_COUNT)
        elif had >= ESTABLISHED and z <= 0:
            out[sender] = had - 1  # it counted on the benefit of the doubt: one round of it is spent
    for sender in refused:
        out[sender] = 0
    out = {s: n for s, n in out.items() if n > 0}
    if len(out) > MAX_SENDERS:
        keep = sorted(out, key=lambda s: (-out[s], s))[:MAX_SENDERS]
        out = {s: out[s] for s in keep}
    return dict(sorted(out.items()))


def _milli(z: float) -> int:
    return max(-MAX_MILLI, min(MAX_MILLI, math.floor(z * MILLI)))


def _faded(entry: Optional[Evidence]) -> Evidence:
    """A pool before a round is added: full (``EVIDENCE_ROUNDS``), it keeps the share of its sum its
    newest rounds would hold, so a sender cannot live on long-past rounds."""
    total, rounds = entry if entry else (0, 0)
    if rounds >= EVIDENCE_ROUNDS:
        total, rounds = total * (EVIDENCE_ROUNDS - 1) // EVIDENCE_ROUNDS, EVIDENCE_ROUNDS - 1
    return total, rounds


def fresh_bar(min_z: float, fraction: float, peer_scores: Sequence[float]) -> float:
    """The score a fresh full replica's contribution must reach: ``min_z``, or ``fraction`` of the
    lower median of the round's full-replica scores (``peer_scores``) where that is higher. Honest
    replicas agree with each other in proportion to what they learned (+18 to +26 in the first
    rounds of bench/hostile.py's real peers); a peer trained on random ASCII agrees with them by byte
    statistics alone (+2 to +4), above a fixed bar of 3 but far below a quarter of theirs. The lower
    median: a minority, however it scores, cannot raise the bar past an honest majority's scores.
    Deterministic (tests/protocol/test_standing.py)."""
    if fraction <= 0 or not peer_scores:
        return min_z
    return max(min_z, fraction * lower_median(peer_scores))


def lower_median(values: Sequence[float]) -> float:
    """The lower median (of 4 values the second smallest): exact floats sorted, so deterministic on every
    member. Used for the fresh bar above; the clip's median norm (peer/outer/robust.py) takes the same
    element."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def convinced(entry: Optional[Evidence], z: float, min_z: float) -> bool:
    """Whether a fresh sender's contribution of score ``z`` counts: ``z`` ≥ ``min_z`` alone, or pooled
    with the sender's evidence so far (``entry``, from ``gather``) ≥ ``min_z``. Never stricter than
    the round alone (tests/protocol/test_standing.py)."""
    if z >= min_z:
        return True
    if z <= 0:
        return False
    total, rounds = _faded(entry)
    return (total + _milli(z)) / MILLI / math.sqrt(rounds + 1) >= min_z


def gather(evidence: Mapping[str, Evidence], scores: Mapping[str, float], refused: Iterable[str],
           copied: Iterable[str], after: Mapping[str, int], unconvinced: Iterable[str] = ()) -> Dict[str, Evidence]:
    """The evidence table after a round: every sender scored this round (``scores``, not a copy) and
    fresh in the table ``after`` it pools a positive score and loses its pool with a score ≤ 0; a
    sender ``refused`` for another reason than too little evidence (``unconvinced``: refused by
    ``convinced`` alone) loses it too, and an established one needs none. A sender not scored this
    round keeps 7/8 of its sum (a departed sender's pool is gone within ``ABSENT_ROUNDS``, not left to
    fill the table). At most ``MAX_SENDERS`` entries (the smallest sums go first). Deterministic
    (tests/protocol/test_standing.py)."""
    out, copies, doubted = dict(evidence), set(copied), set(unconvinced)
    for sender, (total, rounds) in evidence.items():
        if sender not in scores:  # not scored this round: the pool fades, and is gone within ABSENT_ROUNDS
            out[sender] = (total * (EVIDENCE_ROUNDS - 1) // EVIDENCE_ROUNDS, rounds)
    for sender, z in scores.items():
        if sender in copies:
            continue
        if z > 0:
            total, rounds = _faded(out.get(sender))
            out[sender] = (min(MAX_MILLI, total + _milli(z)), rounds + 1)
        else:
            out.pop(sender, None)
    for sender in refused:
        if sender not in doubted:
            out.pop(sender, None)
    out = {s: e for s, e in out.items() if after.get(s, 0) < ESTABLISHED and e[0] > 0}
    if len(out) > MAX_SENDERS:
        out = {s: out[s] for s in sorted(out, key=lambda s: (-out[s][0], s))[:MAX_SENDERS]}
    return dict(sorted(out.items()))


def weights(established: Sequence[bool]) -> List[float]:
    """The weight of each contribution in its round's average (``established[i]``: whether the
    sender of the i-th has standing): 1 each, unless the round holds at least ``MIN_JUDGES``
    established ones (E) and its F fresh ones would weigh more than ``FRESH_SHARE`` of the total;
    then each fresh one weighs E x s / (F x (1 - s)), so that together they weigh exactly that share.
    Exact rational arithmetic rounded once: the same floats on every machine
    (tests/protocol/test_standing.py)."""
    e = sum(1 for x in established if x)
    f = len(established) - e
    if e < MIN_JUDGES or f == 0 or Fraction(f, e + f) <= FRESH_SHARE:
        return [1.0] * len(established)
    fresh = float(Fraction(e) * FRESH_SHARE / (f * (1 - FRESH_SHARE)))
    return [1.0 if x else fresh for x in established]


def checked(raw: Any) -> Dict[str, int]:
    """A table read from another peer's state or from a checkpoint: a map of at most
    ``MAX_SENDERS`` names (str, 1 to 128 characters) to counts in [1, MAX_COUNT]; absent (None)
    reads as empty. Raises StandingError otherwise."""
    table = _senders(raw, "a standing table")
    for count in table.values():
        if isinstance(count, bool) or not isinstance(count, int) or not 0 < count <= MAX_COUNT:
            raise StandingError(f"a standing table's count must be an integer in [1, {MAX_COUNT}]")
    return dict(sorted(table.items()))


def _senders(raw: Any, what: str) -> Dict[Any, Any]:
    """``raw`` as a map of at most ``MAX_SENDERS`` sender names (str, 1 to 128 characters) to values
    the caller checks; None reads as empty. Raises StandingError naming ``what`` otherwise."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or len(raw) > MAX_SENDERS:
        raise StandingError(f"{what} is a map of at most {MAX_SENDERS} senders")
    for sender in raw:
        if not isinstance(sender, str) or not 0 < len(sender) <= MAX_NAME_CHARS:
            raise StandingError(f"{what}'s sender must be a name of 1 to {MAX_NAME_CHARS} characters")
    return raw


def checked_evidence(raw: Any) -> Dict[str, Evidence]:
    """An evidence table read from another peer's state or a checkpoint: a map of at most
    ``MAX_SENDERS`` names to pairs (sum in (0, ``MAX_MILLI``], rounds in [1, ``EVIDENCE_ROUNDS``]);
    absent (None) reads as empty. Raises StandingError otherwise."""
    out: Dict[str, Evidence] = {}
    for sender, entry in _senders(raw, "an evidence table").items():
        if not isinstance(entry, (list, tuple)) or len(entry) != 2 or any(isinstance(x, bool) or not isinstance(x, int) for x in entry):
            raise StandingError("an evidence table's entry must be a pair of integers")
        total, rounds = entry
        if not (0 < total <= MAX_MILLI and 0 < rounds <= EVIDENCE_ROUNDS):
            raise StandingError(f"an evidence table's entry must be a sum in (0, {MAX_MILLI}] over 1 to {EVIDENCE_ROUNDS} rounds")
        out[sender] = (total, rounds)
    return dict(sorted(out.items()))
