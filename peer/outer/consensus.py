"""Does a contribution point the way the others of its round point? A score every member computes alike.

Clipping (peer/outer/robust.py) bounds the size of an update, not its direction: a hostile member
that sends the negated pseudo-gradient of honest training, or noise, at an honest norm, passes it.
What honest updates share is their direction: trained from one θ on the same kind of data, their
values agree in sign far more often than chance, coordinate by coordinate, and most where they are
largest. So, for every pair of contributions (i, j) and every tensor t both carry (a full replica, a
slice owner and a chain stage are compared on what they share, never on what only one of them
sends), with l(u) a contribution's magnitudes on t as integers (|u| / max_t |u| × ``LEVELS``,
rounded):

    W_ij,t = Σ sign(u_i) l(u_i) · sign(u_j) l(u_j)   (where their mass points alike, minus where not)
    V_ij,t = Σ l(u_i)² · l(u_j)²
    z_ij,t = W_ij,t / √V_ij,t                           (tensors with V = 0 are left out)
    z_ij   = Σ_t clamp(z_ij,t, ±TENSOR_Z) / √T_ij       (T_ij: the tensors with V > 0; 0 where there is none)

For signs drawn at random, W_ij,t has mean 0 and standard deviation √V_ij,t, so each z_ij,t and
their combination z_ij (Stouffer's) are standard normal: z_ij is how many standard deviations the
pair agrees above chance. Weighing each coordinate by the magnitudes both put there makes the test
ask where a contribution's mass points, which is what moves θ: counting signs alone let a member
keep honest signs on three quarters of its coordinates at a tiny magnitude and put its whole norm,
negated, on the quarter that was largest (``covert`` in bench/trust.py): its signs agreed (z +4 to
+12) while its mass pointed back, and with one such member among 3 honest ones the loss ended
5.4 % higher, with two 18.6 % (bench/RESULTS.md, "Seventy-sixth session"). The same member now
scores −6 to −9. Of equal magnitudes the test is the sign test: W = A and V = O below.

Each tensor is one test of equal weight, not each coordinate, and none
counts past ``TENSOR_Z``: the coordinates of one tensor are not independent. An input embedding's
rows move together in a round's first steps, so a pair's signs there agree or disagree on nearly
every coordinate they share (one coin flip counted hundreds of times): pooled over coordinates, that
one tensor made an honest slice owner score −0.3 in round 0 where its other tensors all agreed, and a
replica that trains a quarter of H score −4.2 (bench/RESULTS.md, "Per-tensor scores"). By chance a
tensor passes 6 standard deviations once in 5 x 10^8: past that it has said all a test can, and what
is left is how many coordinates moved together. A contribution's score is the median of its z over the others it can be compared with (of
an even count, the upper of the two middle values): with R honest members and K hostile ones that
agree with each other and not with the honest, an honest score stays high while K < R and a hostile
one stays low while K <= R, so hostile members that are fewer than the honest can neither raise
their own scores nor sink an honest one. A contribution counts only with a score of at least
``min_z``; where K = R nobody's direction wins and nothing counts (no step is better than half a
step backwards).

Measured with ``python bench/direction_scores.py`` (bench/RESULTS.md, "Per-tensor scores"): honest
updates score +5.3 to +27, noise −1.6 to +2.3, updates trained on random tokens −3.7 to +2.2,
negated honest updates −19 to −5.3. A contribution that shares no coordinate with the others
scores 0: carrying nothing in common with the round is no information. What equal weights give up:
an update negated on a minority of its tensors, honest on the rest, scores as honest; so each
tensor's own median (``tensor_scores``) is read too, and peer/outer/robust.py leaves out the tensors
that point against the others' (``against``; docs/trust.md).

A copy carries no information of its own: two contributions whose signs agree on at least
``COPY_FRACTION`` of the coordinates they share, and which share at least that fraction of the
coordinates each sets, are copies of one another (``copies``; honest pairs agree on 10 to 30 % more
coordinates than they disagree on, and their supports differ). A copy is counted once and earns its
senders no standing (peer/outer/robust.py).

Every member must decide alike: the counts are exact integers on any machine. Signs are written
as float32 in blocks of at most ``_BLOCK`` coordinates and multiplied as a matrix; every partial sum
of ±1 and 0 over fewer than 2^24 terms is an integer that float32 holds exactly, whatever order a
BLAS adds in, and the blocks are added in float64, exact below 2^53. The signed levels are
integers below 2^7, multiplied in float64: a block's W and V stay below 2^53, so exact in any
order, and are added across blocks in int64. The sign counts (A: agreements minus
disagreements, O: the coordinates both set) serve ``copies``. z, the sort and the median are
IEEE operations on those integers, and a pair's per-tensor z are added by ``math.fsum`` (exactly
rounded: the same bits in any order). Cost: bench/outer_step.py ("no check" arm), bench/RESULTS.md.
"""

from __future__ import annotations

import math
from fractions import Fraction
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

__all__ = ["COPY_FRACTION", "TENSOR_Z", "Agreement", "agreement", "copies", "score_contributions", "tensor_scores"]

Tensors = Mapping[str, torch.Tensor]
_BLOCK = 1 << 18  # coordinates per block: n x 1 MiB of signs and n x 2 MiB of levels at a time, sums exact
# a pair whose signs agree on 90 % of the coordinates they share, sharing 90 % of each one's coordinates,
# is a copy: A / O = 0.8 or more, where honest pairs measured A / O below 0.3 over O of 10^4 coordinates and more
COPY_FRACTION = Fraction(9, 10)
# the most one tensor's z adds to a pair's: 4, 6 and 8 separated honest from hostile alike on the
# probes, 6 kept a negated update lowest (bench/RESULTS.md, "Per-tensor scores")
TENSOR_Z = 6.0
# a contribution's magnitudes on a tensor, as integers up to this (``_levels_of``): W and V of a block
# stay below 2^53 (LEVELS^4 x _BLOCK < 2^46), and a value below half a level of the tensor's largest
# (0.4 %) weighs nothing
LEVELS = 127


@dataclass
class Agreement:
    """Pairwise sign counts of a round's contributions (positions index the input)."""

    agree: Dict[Tuple[int, int], int] = field(default_factory=dict)  # (i, j), i < j -> A_ij
    overlap: Dict[Tuple[int, int], int] = field(default_factory=dict)  # (i, j), i < j -> O_ij
    present: Dict[int, int] = field(default_factory=dict)  # i -> the coordinates i sets, over all its tensors
    # (i, j), i < j -> tensor name t -> z_ij,t clamped, for each tensor both put some mass on
    tests: Dict[Tuple[int, int], Dict[str, float]] = field(default_factory=dict)

    def z(self, i: int, j: int) -> float:
        """Stouffer's z of the pair over the tensors both set a coordinate of (module docstring); the
        sum is ``math.fsum``'s, exactly rounded, so the same bits whatever order the tensors came in."""
        zs = self.tests.get((i, j) if i < j else (j, i))
        return math.fsum(zs.values()) / math.sqrt(len(zs)) if zs else 0.0

    def neighbours(self) -> Dict[int, List[int]]:
        """Position -> the positions it shares a tensor with, sorted, in one pass over the pairs (ask
        it once per round: scanning every pair for each position made 1,000 contributions O(N^3))."""
        out: Dict[int, set] = {}
        for a, b in self.overlap:
            out.setdefault(a, set()).add(b)
            out.setdefault(b, set()).add(a)
        return {i: sorted(js) for i, js in out.items()}


def agreement(contributions: Sequence[Tensors]) -> Agreement:
    """A_ij and O_ij for every pair that carries at least one tensor name in common, summed over those
    tensors, and each tensor's own clamped z_ij,t (``Agreement.tests``)."""
    out = Agreement()
    names = list(dict.fromkeys(name for c in contributions for name in c))  # first-seen order
    for name in names:
        carriers = [i for i, c in enumerate(contributions) if name in c]
        flats = {i: contributions[i][name].detach().to("cpu", torch.float32).reshape(-1) for i in carriers}
        by_size: Dict[int, List[int]] = {}
        for i in carriers:  # decoders give one name one shape; were they ever to differ, those are not compared
            by_size.setdefault(flats[i].numel(), []).append(i)
        for group in by_size.values():
            if len(group) >= 2:
                _count(out, name, group, [flats[i] for i in group])
            else:  # compared with nobody, but part of what the contribution sets
                out.present[group[0]] = out.present.get(group[0], 0) + int(torch.count_nonzero(flats[group[0]]))
    return out


def _count(out: Agreement, name: str, carriers: List[int], flats: List[torch.Tensor]) -> None:
    """Add one tensor's (``name``) A, O and z of every pair of ``carriers`` (their flat values ``flats``) to ``out``.

    Block by block: the signs are written into one buffer, the coordinates no carrier sets are
    dropped when they are most of the block (a SparseLoCo round: about 78 % of them with 16
    members), and two products give A and O; each block's counts are exact in float32 (fewer than
    2^24 terms of ±1 and 0) and are added in float64, exact below 2^53. Two more products of the
    signed levels give W and V (module docstring): terms below ``LEVELS``^4, fewer than 2^53 / LEVELS^4
    of them a block, so exact in float64, added across blocks in int64."""
    n, size = len(carriers), flats[0].numel()
    signs = torch.empty((n, min(_BLOCK, size)), dtype=torch.float32)
    agree = torch.zeros((n, n), dtype=torch.float64)
    overlap = torch.zeros((n, n), dtype=torch.float64)
    mass = torch.zeros((n, n), dtype=torch.int64)
    spread = torch.zeros((n, n), dtype=torch.int64)
    tops = [flat.abs().max() if size else flat.new_zeros(()) for flat in flats]
    for start in range(0, size, _BLOCK):
        end = min(start + _BLOCK, size)
        block = signs[:, : end - start]
        for row, flat in enumerate(flats):
            torch.sign(flat[start:end], out=block[row])
        set_somewhere = block.any(0).nonzero().squeeze(1)
        if set_somewhere.numel() == 0:
            continue
        compact = set_somewhere.numel() < block.shape[1] // 2
        if compact:
            block = block.index_select(1, set_somewhere)
        agree += (block @ block.T).double()
        present = block.abs()
        overlap += (present @ present.T).double()
        weighted = torch.stack([_levels_of(flat[start:end], top, set_somewhere if compact else None)
                                for flat, top in zip(flats, tops)]) * block.double()
        squared = weighted.square()
        mass += (weighted @ weighted.T).to(torch.int64)  # exact integers below 2^53: converted exactly
        spread += (squared @ squared.T).to(torch.int64)
    a, o, mass, spread = agree.tolist(), overlap.tolist(), mass.tolist(), spread.tolist()
    for x, i in enumerate(carriers):
        out.present[i] = out.present.get(i, 0) + int(o[x][x])
        for y in range(x + 1, n):
            key, ax, ox = (i, carriers[y]), int(a[x][y]), int(o[x][y])
            out.agree[key] = out.agree.get(key, 0) + ax
            out.overlap[key] = out.overlap.get(key, 0) + ox
            if spread[x][y]:  # this tensor's own test of the pair: some mass both set
                z = mass[x][y] / math.sqrt(spread[x][y])
                out.tests.setdefault(key, {})[name] = max(-TENSOR_Z, min(TENSOR_Z, z))


def _levels_of(part: torch.Tensor, top: torch.Tensor, keep: Optional[torch.Tensor]) -> torch.Tensor:
    """A contribution's magnitudes on a block of one tensor (at the columns ``keep``, None: all) as
    integers 0..``LEVELS`` in float64: |u| / ``top`` (the tensor's largest |u|) times ``LEVELS``,
    rounded half to even. IEEE division, product and rounding: the same integers on any machine."""
    part = part if keep is None else part.index_select(0, keep)
    mags = part.abs().double()
    return torch.round(mags / top.double() * LEVELS) if float(top) else mags


def upper_median(values: Sequence[float]) -> float:
    """The median; of an even count the upper middle value (of 2 values the larger)."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def tensor_scores(pairs: Agreement, i: int, judges: Iterable[int]) -> Dict[str, float]:
    """Tensor name -> the (upper) median of z_ij,t over the ``judges`` j that put mass on tensor t
    beside i: where each of i's tensors points, against the others' (robust.py weighs what it
    carries by these). Guarded by tests/outer/test_consensus.py."""
    by_name: Dict[str, List[float]] = {}
    for j in judges:
        if j != i:
            for name, z in pairs.tests.get((i, j) if i < j else (j, i), {}).items():
                by_name.setdefault(name, []).append(z)
    return {name: upper_median(zs) for name, zs in by_name.items()}


def copies(pairs: Agreement) -> Dict[int, int]:
    """Position -> the first position (the smallest) of the group of copies it belongs to, for every
    contribution that copies an earlier one (see the module docstring); a copy of a copy is in the
    same group. Guarded by tests/outer/test_consensus.py."""
    first: Dict[int, int] = {}

    def root(i: int) -> int:
        while i in first:
            i = first[i]
        return i

    for (i, j) in sorted(pairs.overlap):
        o, a = pairs.overlap[(i, j)], pairs.agree[(i, j)]
        sets = max(pairs.present.get(i, 0), pairs.present.get(j, 0))
        # agreements (o + a) / 2 at least COPY_FRACTION of o; exact rational comparisons of integers
        if o and a >= (2 * COPY_FRACTION - 1) * o and o >= COPY_FRACTION * sets:
            ri, rj = root(i), root(j)
            if ri != rj:
                first[max(ri, rj)] = min(ri, rj)
    return {i: root(i) for i in sorted(first)}


def score_contributions(contributions: Sequence[Tensors], judges: Optional[Iterable[int]] = None,
                        pairs: Optional[Agreement] = None, among: Optional[Iterable[int]] = None) -> Dict[int, float]:
    """Position -> the (upper) median of its z over the others it can be compared with, among
    ``judges`` (positions; None: every contribution judges); a contribution comparable with no
    judge is not scored (it is absent from the result). ``pairs``: the contributions' ``agreement``
    if already counted; ``among``: score only these positions, compared only with each other (None:
    all). Guarded by tests/outer/test_consensus.py."""
    pairs = agreement(contributions) if pairs is None else pairs
    scored = set(range(len(contributions)) if among is None else among)
    judging = set(scored if judges is None else judges) & scored
    scores: Dict[int, float] = {}
    neighbours = pairs.neighbours()
    for i in sorted(scored):
        others = [j for j in neighbours.get(i, []) if j in judging]
        if others:
            scores[i] = upper_median([pairs.z(i, j) for j in others])
    return scores
