"""Robust aggregation: every decoded contribution is checked and clipped before it is averaged,
and the outer step is taken only if it leaves θ finite.

A public run must assume that any groupmate sends well-formed but hostile updates. The codecs
already refuse wire values that are non-finite or of magnitude >= 1e8 (protocol/codecs/fields.py);
here, per round:

1. **check**: every decoded tensor finite and below that bound (a contribution that fails is
   excluded, with the reason; contributions that did not come through a codec are checked too);
2. **direction** (peer/outer/consensus.py): a contribution whose values agree in sign with the
   others' of its round, weighed by the magnitudes both put there, less than ``min_z`` standard
   deviations above chance (the median over the contributions it can be compared with) is
   excluded: a negated or random update of honest size passes the clip, not this. Of one that
   counts, a tensor that points against the others' is left out (``against``): the score counts
   each tensor as one test, and a member negated on its few largest tensors passed it;
3. **clip** (after SparseLoCo's production rule, median-norm clipping): per tensor name, over the
   contributions that carry that tensor (a full replica, a partial slice owner and a chain stage
   carry different sets: like is compared with like), the L2 norm of each; a contribution whose
   norm exceeds ``multiple`` x the median of those norms (``CLIP_MULTIPLE`` = 1.5) is scaled down
   to the median itself (to the limit where ``multiple`` < 1): past the limit an update is no
   honest one, so it weighs what a typical one does, not the most an honest one might. The median
   is the lower one (``torch.median``'s convention): with 4 members it is the second smallest norm,
   so one huge update is clipped to an honest size and one zero update cannot pull the limit to zero.
   Each payload states the inner steps its update covers, and an update is held to the median of the
   round's norms scaled up to its own steps (``medians_at_steps``): beside peers that closed their
   round early after s steps, one that trained H is held to H / s times their norm, not to their
   norm itself (bench/mixed_speed.py);
4. **step**: the strategy's aggregate of the clipped contributions, then its outer step, all or
   nothing (``OuterStrategy.apply`` raises ``NonFiniteStep`` before it changes anything). If the
   step would leave a non-finite value (not reachable from bounded contributions and a finite θ,
   kept as the last line), the largest contribution is excluded and the step retried; with none
   left θ stays as it was. No honest peer ever raises because of what a groupmate sent.

Every member must end bit-identical, so the arithmetic is fixed: norms are sums of float64
squares of the float32 values added in a fixed order (numpy's cumulative sum is a sequential
scan; ``torch.sum`` and BLAS dots split the sum by SIMD width and thread count, which differ
between machines), the median comes from sorting a short list of those exact floats, and the
scale is applied as one float32 multiplication per element. Contributions stay in the canonical
order (by sender) they were decoded in; the inputs are never modified (the simulation hands the
same decoded tensors to every replica).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from peer.outer.consensus import agreement, copies, score_contributions, tensor_scores
from protocol.round.standing import (AGAINST, ESTABLISHED, EVIDENCE_ROUNDS, FRESH_SHARE, MIN_JUDGES, Evidence, convinced,
                                     fresh_bar, weights)
from protocol.codecs.fields import MAX_ABS

__all__ = ["CLIP_MULTIPLE", "PLAIN", "PROJECTED", "REFUSED", "Contributions", "kinds_of", "NonFiniteStep", "Outcome", "Screening", "robust_step", "screen",
           "squared_norm"]

logger = logging.getLogger("voloco.peer.robust")

Tensors = Dict[str, torch.Tensor]

# Clip past 1.5x the round's median norm, not past 1x: with the lower median of 4 contributions, 1x clips two
# honest ones every round, and SparseLoCo's senders have already taken what they sent out of their
# error buffers, so what the clip removes is lost: +1.2 % loss (one seed +5.5 %) at equal tokens from a
# cold start, while 1.5x never clipped an honest SparseLoCo update there and costs nothing measurable
# from a warm start either (bench/clip_cost.py, bench/RESULTS.md). A tensor past the limit is scaled to
# the median, not to the limit: at the limit, an update x1e4 of 1 to 3 senders among 6 honest ones cost
# +3.6 to +5.4 % loss, at the median +0.8 to +1.5 % (10 seeds, bench/trust.py --attacks scale). An
# amplifier must send before it sees the round's median, so aiming near the limit risks the median.
CLIP_MULTIPLE = 1.5
STEP_POWER = 1.0  # an update of s steps suggests one of t > s may weigh (t / s) ** STEP_POWER as much (medians_at_steps)
_CHUNK = 1 << 20  # elements squared and summed at a time (bounds the float64 temporaries)
_NOTABLE = 0.5  # a clip that removes more than half of a tensor's norm is logged
REFUSED = "refused update"  # how every reason these checks give begins (a round record's exclusions)


class NonFiniteStep(ValueError):
    """The outer step would leave a non-finite value in θ or the strategy's state (nothing changed)."""


class Contributions(list):
    """The decoded contributions of a round in the canonical order, with their senders' ids, the
    model each was trained on (``kinds``: ``PLAIN`` θ itself, ``PROJECTED`` θ projected for a chain's
    lossless links, ``OuterStrategy.kind_of``; None: all plain) and the inner steps each covers
    (``steps``, as its payload claims them, at least the round's floor: peer/outer/engine.py; None:
    all alike)."""

    def __init__(self, items: Iterable[Tensors] = (), senders: Optional[Sequence[str]] = None,
                 kinds: Optional[Sequence[int]] = None, steps: Optional[Sequence[int]] = None):
        super().__init__(items)
        self.senders = list(senders) if senders is not None else None
        self.kinds = list(kinds) if kinds is not None else None
        self.steps = list(steps) if steps is not None else None


PLAIN, PROJECTED = 0, 1  # the model a contribution was trained on: θ, or θ projected (chain-local stages)


def kinds_of(decoded: Sequence[Tensors]) -> List[int]:
    """The kind of each of ``decoded`` (a ``Contributions``), or ``PLAIN`` for all of a plain list."""
    kinds = getattr(decoded, "kinds", None)
    if kinds is not None and len(kinds) == len(decoded):
        return list(kinds)
    return [PLAIN] * len(decoded)


def steps_of(decoded: Sequence[Tensors]) -> Optional[List[int]]:
    """The inner steps each of ``decoded`` (a ``Contributions``) covers, or None for a plain list."""
    steps = getattr(decoded, "steps", None)
    return list(steps) if steps is not None and len(steps) == len(decoded) else None


def sender_names(decoded: Sequence[Tensors]) -> List[str]:
    """The senders of ``decoded`` (a ``Contributions``), or "#i" for a plain list."""
    senders = getattr(decoded, "senders", None)
    if senders is not None and len(senders) == len(decoded):
        return list(senders)
    return [f"#{i}" for i in range(len(decoded))]


def squared_norm(t: torch.Tensor) -> Tuple[float, float]:
    """(Σ t², max |t|) of a float32 tensor: the sum in float64, added in a fixed sequential order
    (within each chunk of ``_CHUNK`` elements, then chunk by chunk), so the same bits on every
    machine. A NaN or inf anywhere makes the sum non-finite.

    Zeros are left out of the sum: adding +0.0 to a partial sum of squares (never negative) leaves
    it as it was, so the bits are those of the sum over every element, at a third of the cost for a
    SparseLoCo contribution (1.6 % of it is non-zero; bench/outer_step.py). A NaN is not zero and
    stays in."""
    flat = t.detach().to("cpu", torch.float32).contiguous().reshape(-1).numpy()
    total, peak = 0.0, 0.0
    for start in range(0, flat.size, _CHUNK):
        part = flat[start:start + _CHUNK]
        peak = max(peak, float(part.max()), -float(part.min()))  # max |x|, without a copy of |part|
        kept = part[part != 0].astype(np.float64)
        if kept.size:
            np.multiply(kept, kept, out=kept)
            total += float(np.cumsum(kept)[-1])
    return total, peak


def _check(contribution: Tensors) -> Tuple[Optional[str], Dict[str, float]]:
    """(why the contribution is refused, or None; the L2 norm of each of its tensors)."""
    norms: Dict[str, float] = {}
    for name, t in contribution.items():
        if t.dtype != torch.float32:
            return f"tensor {name!r} is {t.dtype}, not float32", norms
        sq, peak = squared_norm(t)
        if not (math.isfinite(sq) and math.isfinite(peak)):
            return f"tensor {name!r} holds a non-finite value", norms
        if peak >= MAX_ABS:
            return f"tensor {name!r} holds a value of magnitude {peak:.3g}, at or above the bound {MAX_ABS:g}", norms
        norms[name] = math.sqrt(sq)
    return None, norms


@dataclass
class Screening:
    """What ``screen`` made of a round's contributions (positions index the input sequence)."""

    kept: List[int] = field(default_factory=list)  # the contributions that go on, in input order
    contributions: Dict[int, Tensors] = field(default_factory=dict)  # position -> clipped contribution
    norms: Dict[int, float] = field(default_factory=dict)  # position -> its total L2 norm after clipping
    excluded: Dict[int, str] = field(default_factory=dict)  # position -> why it was refused
    clipped: Dict[int, float] = field(default_factory=dict)  # position -> smallest scale applied to a tensor
    limits: Dict[str, float] = field(default_factory=dict)  # tensor name -> the norm past which it was clipped
    scores: Dict[int, float] = field(default_factory=dict)  # position -> its agreement with the others (z)
    copies: Dict[int, int] = field(default_factory=dict)  # position -> the position of the copy that counts
    unconvinced: List[int] = field(default_factory=list)  # positions refused only for too little evidence (z > 0)
    dropped: Dict[int, List[str]] = field(default_factory=dict)  # position -> its tensors left out (``against``)


def _direction(out: Screening, decoded: Sequence[Tensors], min_z: float, established: set, kinds: List[int],
               evidence: Mapping[int, Evidence], fraction: float = 0.0) -> None:
    """The direction check of ``screen``, on ``out.kept``: copies counted once, then every other
    contribution scored. A contribution to θ itself (``PLAIN``) is judged by the others of its kind
    where it can be compared with one: a chain stage trains θ projected onto its links' subspace
    (``PROJECTED``), whose sparse update agrees in sign with a full replica's no more than chance, and
    must not sink an honest full replica's score. A chain stage's is judged by all: θ is the model
    the run trains, and an update that does not agree with the others' (a chain that joined a run
    under way: +2 % loss at equal honest tokens when counted, bench/chains.py --warm-rounds) does
    not count. A fresh contribution below ``min_z`` counts where its sender's evidence (``evidence``:
    position -> its pool, protocol/round/standing.py) pooled with this score reaches it; a fresh full
    replica's bar is ``fraction`` of the round's median full-replica score where that is higher
    (standing.fresh_bar: a chain stage's scores are weaker by nature and keep ``min_z``). Of a
    contribution that counts, the tensors that point against its judges' (``against``) are left out
    (``Screening.dropped``); one whose every tensor does so is refused."""
    checked = list(out.kept)
    contributions = [decoded[i] for i in checked]
    pairs = agreement(contributions)
    out.copies = {checked[p]: checked[first] for p, first in copies(pairs).items()}
    originals = [p for p, i in enumerate(checked) if i not in out.copies]
    settled = {p for p in originals if checked[p] in established}

    judged_by: Dict[int, List[int]] = {}  # position -> the positions that judged it

    def judged(among: List[int], scored: Iterable[int]) -> Dict[int, float]:
        judges = [p for p in among if p in settled]
        judges = judges if len(judges) >= MIN_JUDGES else list(among)
        scores, wanted = score_contributions(contributions, judges, pairs, among), set(scored)
        judged_by.update({p: judges for p in scores if p in wanted})
        return {p: z for p, z in scores.items() if p in wanted}

    plain = [p for p in originals if kinds[checked[p]] == PLAIN]
    scores = judged(plain, plain)
    scores.update(judged(originals, [p for p in originals if p not in scores]))
    out.kept = [i for i in checked if i not in out.copies]  # a copy counts once, as the first of its group
    out.scores = {checked[p]: z for p, z in scores.items()}
    plain_bar = fresh_bar(min_z, fraction, [scores[p] for p in plain if p in scores])
    for p, z in scores.items():
        i = checked[p]
        bar = plain_bar if kinds[i] == PLAIN else min_z
        if i in established and z <= -AGAINST * min_z:
            out.excluded[i] = (f"its direction points against the others' of its round ({z:+.1f} standard "
                               f"deviations from chance; {-AGAINST * min_z:g} or less refuses an established sender)")
        elif i not in established and not convinced(evidence.get(i), z, bar):
            rounds = min(evidence[i][1], EVIDENCE_ROUNDS - 1) + 1 if i in evidence and z > 0 else 1
            why = "" if bar == min_z else f" ({fraction:g} of its round's median full replica's)"
            shown = math.floor(z * 100) / 100  # rounded down: a z just below the bar never reads as the bar
            out.excluded[i] = (f"its direction agrees with the others' of its round {shown:+.2f} standard deviations "
                               f"above chance ({rounds} round{'s' if rounds > 1 else ''} pooled), below the {bar:.3g}{why} "
                               f"that a sender without standing needs")
            if z > 0:
                out.unconvinced.append(i)
        else:
            continue
        out.kept.remove(i)
    # the tensors of what still counts that point against the others' that still count (a refused
    # update judges no tensor: a negated one would pull an honest tensor's median below chance)
    counting = {p for p, i in enumerate(checked) if i in out.kept}
    for p in sorted(scores):
        i = checked[p]
        if i not in out.kept:
            continue
        names = against(pairs, p, [j for j in judged_by[p] if j in counting], min_z)
        if len(names) < len(decoded[i]):
            if names:
                out.dropped[i] = names
            continue
        out.excluded[i] = f"each of its tensors points against the others' ({min_z:g} standard deviations or more below chance)"
        out.kept.remove(i)


def against(pairs, p: int, judges: Iterable[int], bar: float) -> List[str]:
    """The tensors of contribution ``p`` whose (upper) median z over its ``judges`` is ``bar`` or
    more below chance: pointing against the others' there (``screen``'s bar is ``min_z``, the one a
    fresh sender must pass; twice that let a member negated on its largest tensors cost up to
    +2.6 % loss beside 6 honest ones, bench/RESULTS.md "Seventy-sixth session"). The score counts
    each tensor as one test, so such a member (bench/trust.py's ``negate-big``) scored as honest;
    ``screen`` leaves such tensors out of the round. An honest tensor is left out too where most
    of its judges disagree with it: late in a run, an input embedding whose error feedback sends
    residue the chosen average already applied on its behalf (docs/trust.md); measured in
    bench/trust.py at −0.02 %, +0.21 % and +0.15 % loss on clean runs of 3, 6 and 16."""
    return [n for n, z in tensor_scores(pairs, p, judges).items() if z <= -bar]


def medians_at_steps(norms: Sequence[float], steps: Sequence[int], power: float = STEP_POWER) -> Dict[int, float]:
    """For each step count among ``steps``, the lower median of ``norms`` (of updates covering ``steps``
    inner steps, each update's own included) with each scaled to what it suggests an update of that
    many steps may honestly weigh: × (that count / its steps) where above 1 (``STEP_POWER`` = 1: an
    update grows at most in proportion to its steps), never scaled down (error feedback lets an
    update of fewer steps carry as much). Of equal steps, the norms themselves: the clip of a round
    whose peers all trained H steps is what it was before steps were counted
    (tests/outer/test_robust.py::test_an_update_of_more_steps_is_compared_at_its_steps).
    Proportion, not its square root: a full-speed update measured 2.3 to 14 times one of a quarter of
    its steps, and √4 = 2 (× the 1.5 multiple) still clipped it in most rounds (bench/mixed_speed.py
    --clips sqrt); what it grants an amplifier is in docs/trust.md, "Updates of fewer steps".
    IEEE divisions and products only at power 1, so the same bits on every member (another power,
    through ``pow``, is for benchmarks); one vectorised pass per distinct count, so claims of many
    different counts cost a round little."""
    values, counts = np.asarray(norms, dtype=np.float64), np.asarray(steps, dtype=np.float64)
    k = (len(values) - 1) // 2  # standing.lower_median's index
    out: Dict[int, float] = {}
    for own in sorted(set(int(s) for s in steps)):
        ratio = own / counts
        if power != 1:
            ratio = ratio ** power
        scaled = np.where(counts >= own, values, values * ratio)
        out[own] = float(np.partition(scaled, k)[k])
    return out


def screen(decoded: Sequence[Tensors], multiple: float = CLIP_MULTIPLE, min_z: float = 0.0,
           established: Iterable[int] = (), kinds: Optional[Sequence[int]] = None,
           evidence: Optional[Mapping[int, Evidence]] = None, fresh_fraction: float = 0.0,
           steps: Optional[Sequence[int]] = None, step_power: float = STEP_POWER) -> Screening:
    """Check every contribution, screen their directions (``min_z``; 0: no such check), then clip
    each tensor whose norm exceeds ``multiple`` x the median norm of that tensor over the contributions
    that carry it to that median (``math.inf``: no clipping). ``established``: the positions whose
    senders have standing in this lineage (protocol/round/standing.py): once ``MIN_JUDGES`` of them
    are here only they judge, and they are refused only for pointing against the others (score <=
    -AGAINST x min_z); a fresh contribution must show agreement (score >= min_z, or pooled with its
    ``evidence`` by position, standing.convinced; a fresh full replica also ``fresh_fraction`` of
    the round's median full-replica score, standing.fresh_bar). ``kinds``: the
    model each was trained on (``kinds_of``): a full replica is not judged by chain stages
    (``_direction``). ``steps``: the inner steps each covers (``steps_of``; None: all alike): the
    median a contribution is held to is over the round's norms as ``medians_at_steps`` scales them to
    its own steps, so a peer that trained H steps is clipped to no less than H / s times the norm of
    one that closed its round early after s."""
    out = Screening()
    norms: Dict[int, Dict[str, float]] = {}
    for i, contribution in enumerate(decoded):
        why, n = _check(contribution)
        if why is None:
            out.kept.append(i)
            norms[i] = n
        else:
            out.excluded[i] = why
    if min_z > 0 and len(out.kept) >= 2:
        _direction(out, decoded, min_z, set(established), kinds_of(decoded) if kinds is None else list(kinds),
                   evidence or {}, fresh_fraction)
    for i, left_out in out.dropped.items():
        norms[i] = {n: v for n, v in norms[i].items() if n not in left_out}
    covered = list(steps) if steps is not None and len(steps) == len(decoded) else [1] * len(decoded)
    scales: Dict[int, Dict[str, float]] = {i: {} for i in out.kept}
    names = list(dict.fromkeys(name for i in out.kept for name in norms[i]))  # first-seen order
    for name in names:
        carriers = [i for i in out.kept if name in norms[i]]
        medians = medians_at_steps([norms[i][name] for i in carriers], [covered[i] for i in carriers], step_power)
        for i in carriers:
            median = medians[covered[i]]
            limit = multiple * median
            if not math.isfinite(limit):
                continue
            out.limits[name] = max(limit, out.limits.get(name, 0.0))
            to = min(median, limit)  # test_robust.py::test_past_the_limit_an_update_weighs_the_median
            if norms[i][name] > limit:
                scales[i][name] = to / norms[i][name]
    for i in out.kept:
        contribution = {n: t for n, t in decoded[i].items() if n in norms[i]}
        for name, scale in scales[i].items():
            contribution[name] = contribution[name] * torch.tensor(scale, dtype=torch.float32)
        out.contributions[i] = contribution
        total = sum(n * n * scales[i].get(name, 1.0) ** 2 for name, n in norms[i].items())
        out.norms[i] = math.sqrt(total)
        if scales[i]:
            out.clipped[i] = min(scales[i].values())
    return out


@dataclass
class Outcome:
    """What ``robust_step`` did with a round's contributions, by sender."""

    contributors: int  # contributions in the aggregate that was applied
    excluded: Dict[str, str] = field(default_factory=dict)  # sender -> why its contribution did not count
    clipped: Dict[str, float] = field(default_factory=dict)  # sender -> smallest scale applied to one of its tensors
    scores: Dict[str, float] = field(default_factory=dict)  # sender -> its agreement with the others (z)
    # sender -> its weight in the average where not 1: a fresh sender among many (standing.weights)
    weighed: Dict[str, float] = field(default_factory=dict)
    # sender -> the sender whose contribution, a copy of its own, counted in its place (consensus.copies)
    copies: Dict[str, str] = field(default_factory=dict)
    # senders refused only because a fresh sender's evidence fell short (their pools go on: standing.gather)
    unconvinced: List[str] = field(default_factory=list)
    # sender -> its tensors left out for pointing against the others' (``against``); the rest counted
    dropped: Dict[str, List[str]] = field(default_factory=dict)

    @property
    def copied(self) -> set:
        """Every sender of a contribution that had a copy in the round, the one counted included."""
        return set(self.copies) | set(self.copies.values())


def robust_step(strategy, theta: Tensors, decoded: Sequence[Tensors], round_no: int = -1,
                multiple: Optional[float] = None, standing: Optional[Mapping[str, int]] = None,
                evidence: Optional[Mapping[str, Evidence]] = None) -> Outcome:
    """Check, screen by direction, clip, aggregate with ``strategy`` and apply its outer step to
    ``theta`` (in place). The direction check's threshold is the strategy's ``min_agreement``
    (the run spec's ``outer.min_agreement``, and ``outer.fresh_agreement`` for a fresh full replica;
    absent: none); ``standing``: rounds counted per
    sender in this lineage, ``evidence``: fresh senders' pooled scores (protocol/round/standing.py)."""
    names = sender_names(decoded)
    multiple = getattr(strategy, "clip_multiple", CLIP_MULTIPLE) if multiple is None else multiple
    established = {i for i, n in enumerate(names) if (standing or {}).get(n, 0) >= ESTABLISHED}
    pools = {i: (evidence or {})[n] for i, n in enumerate(names) if n in (evidence or {})}
    s = screen(decoded, multiple, getattr(strategy, "min_agreement", 0.0), established, kinds_of(decoded), pools,
               getattr(strategy, "fresh_agreement", 0.0), steps_of(decoded), getattr(strategy, "step_power", STEP_POWER))
    excluded = {names[i]: f"{REFUSED}: {why}" for i, why in s.excluded.items()}
    kept = list(s.kept)
    while kept:
        try:
            flags, counted = [i in established for i in kept], [s.contributions[i] for i in kept]
            strategy.apply(theta, strategy.aggregate(counted, flags), strategy.step_scales(counted))
            break
        except NonFiniteStep as e:  # the largest goes first; ties: the later in canonical order
            worst = max(kept, key=lambda i: (s.norms[i], i))
            kept.remove(worst)
            excluded[names[worst]] = f"{REFUSED}: with it the outer step would leave {e}"
    clipped = {names[i]: s.clipped[i] for i in kept if i in s.clipped}
    weighed = lightest([s.contributions[i] for i in kept], [i in established for i in kept])
    lighter = {names[kept[p]]: w for p, w in weighed.items()}
    copied = {names[i]: names[first] for i, first in s.copies.items()}
    dropped = {names[i]: s.dropped[i] for i in kept if i in s.dropped}
    _log(round_no, multiple, excluded, clipped, lighter, copied, dropped)
    return Outcome(len(kept), excluded, clipped, {names[i]: z for i, z in s.scores.items()}, lighter, copied,
                   [names[i] for i in s.unconvinced], dropped)


def lightest(contributions: Sequence[Tensors], established: Sequence[bool]) -> Dict[int, float]:
    """Position -> the smallest weight ``standing.weights`` gives it in any tensor's average, for the
    contributions weighed below 1 (what the aggregate did, for the log and the round's record)."""
    out: Dict[int, float] = {}
    for name in dict.fromkeys(n for c in contributions for n in c):
        carriers = [p for p, c in enumerate(contributions) if name in c]
        for p, w in zip(carriers, weights([established[q] for q in carriers])):
            if w != 1.0:
                out[p] = min(w, out.get(p, 1.0))
    return out


def _log(round_no: int, multiple: float, excluded: Dict[str, str], clipped: Dict[str, float],
         lighter: Dict[str, float], copied: Dict[str, str], dropped: Dict[str, List[str]]) -> None:
    for sender, left_out in dropped.items():
        shown = ", ".join(left_out[:3]) + (f" and {len(left_out) - 3} more" if len(left_out) > 3 else "")
        logger.warning(f"round {round_no}: left out {len(left_out)} tensor{'s' if len(left_out) > 1 else ''} of the update "
                       f"of {sender} ({shown}): each points against the others' of the round; the rest of it counts")
    for sender, first in copied.items():
        logger.warning(f"round {round_no}: the update of {sender} is a copy of the update of {first}: it counts once, "
                       f"and neither sender gains standing from it")
    if lighter:
        logger.info(f"round {round_no}: {len(lighter)} contributions from senders without standing weigh "
                    f"{min(lighter.values()):.3g} each in the average: {FRESH_SHARE} of it together at most")
    for sender, why in excluded.items():
        logger.warning(f"round {round_no}: excluded the update of {sender}: {why}")
    notable = {s: f for s, f in clipped.items() if f < _NOTABLE}
    for sender, scale in notable.items():
        logger.info(f"round {round_no}: clipped the update of {sender} to {min(1.0, multiple):g}x the round's "
                    f"median norm at its steps (it was over {multiple:g}x that median; scaled by {scale:.2e} at the most)")
