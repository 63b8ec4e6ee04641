"""Does a contribution point the way the others of its round point? A score every member computes alike.

Clipping (peer/outer/robust.py) bounds the size of an update, not its direction: a hostile member
that sends the negated pseudo-gradient of honest training, or noise, at an honest norm, passes it.
What honest updates share is their direction: trained from one θ on the same kind of data, their
signs agree far more often than chance, coordinate by coordinate. So, for every pair of
contributions (i, j) over the tensors both carry (a full replica, a slice owner and a chain stage
are compared on what they share, never on what only one of them sends):

    A_ij = Σ sign(u_i) · sign(u_j)          (agreements minus disagreements)
    O_ij = Σ |sign(u_i)| · |sign(u_j)|      (coordinates both set)
    z_ij = A_ij / √O_ij                      (0 where they set no coordinate in common)

For signs drawn at random, A_ij has mean 0 and standard deviation √O_ij: z_ij is how many
standard deviations the pair agrees above chance. A contribution's score is the median of its z
over the others it can be compared with (of an even count, the upper of the two middle values): with
R honest members and K hostile ones that agree with each other and not with the honest, an honest
score stays high while K < R and a hostile one stays low while K <= R, so hostile members that are
fewer than the honest can neither raise their own scores nor sink an honest one. A contribution
counts only with a score of at least ``min_z``; where K = R nobody's direction wins and nothing
counts (no step is better than half a step backwards).

Measured with ``python bench/trust.py`` (the simulation's small model, SparseLoCo, 3 seeds;
bench/RESULTS.md, "Direction check"): honest updates score 7.1 to 28, noise −2.0 to +2.5, updates
trained on random tokens −3.6 to +2.3, negated honest updates down to −27. A contribution that
shares no coordinate with the others scores 0: carrying nothing in common with the round is no
information.

A copy carries no information of its own: two contributions whose signs agree on at least
``COPY_FRACTION`` of the coordinates they share, and which share at least that fraction of the
coordinates each sets, are copies of one another (``copies``; honest pairs agree on 10 to 30 % more
coordinates than they disagree on, and their supports differ). A copy is counted once and earns its
senders no standing (peer/outer/robust.py).

Every member must decide alike: the counts are exact integers on any machine. Signs are written
as float32 in blocks of at most ``_BLOCK`` coordinates and multiplied as a matrix; every partial sum
of ±1 and 0 over fewer than 2^24 terms is an integer that float32 holds exactly, whatever order a
BLAS adds in, and the blocks are added in float64, exact below 2^53. z, the sort and the median are
IEEE operations on those integers. Cost: bench/outer_step.py ("no check" arm), bench/RESULTS.md.
"""

from __future__ import annotations

import math
from fractions import Fraction
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

__all__ = ["COPY_FRACTION", "Agreement", "agreement", "copies", "score_contributions"]

Tensors = Mapping[str, torch.Tensor]
_BLOCK = 1 << 20  # coordinates per block: exact in float32 below 2^24, and n x 4 MiB of signs at a time
# a pair whose signs agree on 90 % of the coordinates they share, sharing 90 % of each one's coordinates,
# is a copy: A / O = 0.8 or more, where honest pairs measured z = A / sqrt(O) of 7 to 28 over O of 10^4
# coordinates and more (A / O below 0.3)
COPY_FRACTION = Fraction(9, 10)


@dataclass
class Agreement:
    """Pairwise sign counts of a round's contributions (positions index the input)."""

    agree: Dict[Tuple[int, int], int] = field(default_factory=dict)  # (i, j), i < j -> A_ij
    overlap: Dict[Tuple[int, int], int] = field(default_factory=dict)  # (i, j), i < j -> O_ij
    present: Dict[int, int] = field(default_factory=dict)  # i -> the coordinates i sets, over all its tensors

    def z(self, i: int, j: int) -> float:
        key = (i, j) if i < j else (j, i)
        o = self.overlap[key]
        return self.agree[key] / math.sqrt(o) if o else 0.0

    def neighbours(self) -> Dict[int, List[int]]:
        """Position -> the positions it shares a tensor with, sorted, in one pass over the pairs (ask
        it once per round: scanning every pair for each position made 1,000 contributions O(N^3))."""
        out: Dict[int, set] = {}
        for a, b in self.overlap:
            out.setdefault(a, set()).add(b)
            out.setdefault(b, set()).add(a)
        return {i: sorted(js) for i, js in out.items()}


def agreement(contributions: Sequence[Tensors]) -> Agreement:
    """A_ij and O_ij for every pair that carries at least one tensor name in common."""
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
                _count(out, group, [flats[i] for i in group])
            else:  # compared with nobody, but part of what the contribution sets
                out.present[group[0]] = out.present.get(group[0], 0) + int(torch.count_nonzero(flats[group[0]]))
    return out


def _count(out: Agreement, carriers: List[int], flats: List[torch.Tensor]) -> None:
    """Add one tensor's A and O of every pair of ``carriers`` (their flat values ``flats``) to ``out``.

    Block by block: the signs are written into one buffer, the coordinates no carrier sets are
    dropped when they are most of the block (a SparseLoCo round: about 78 % of them with 16
    members), and two products give A and O; each block's counts are exact in float32 (fewer than
    2^24 terms of ±1 and 0) and are added in float64, exact below 2^53."""
    n, size = len(carriers), flats[0].numel()
    signs = torch.empty((n, min(_BLOCK, size)), dtype=torch.float32)
    agree = torch.zeros((n, n), dtype=torch.float64)
    overlap = torch.zeros((n, n), dtype=torch.float64)
    for start in range(0, size, _BLOCK):
        end = min(start + _BLOCK, size)
        block = signs[:, : end - start]
        for row, flat in enumerate(flats):
            torch.sign(flat[start:end], out=block[row])
        set_somewhere = block.any(0).nonzero().squeeze(1)
        if set_somewhere.numel() == 0:
            continue
        if set_somewhere.numel() < block.shape[1] // 2:
            block = block.index_select(1, set_somewhere)
        agree += (block @ block.T).double()
        present = block.abs()
        overlap += (present @ present.T).double()
    a, o = agree.tolist(), overlap.tolist()
    for x, i in enumerate(carriers):
        out.present[i] = out.present.get(i, 0) + int(o[x][x])
        for y in range(x + 1, n):
            key = (i, carriers[y])
            out.agree[key] = out.agree.get(key, 0) + int(a[x][y])
            out.overlap[key] = out.overlap.get(key, 0) + int(o[x][y])


def upper_median(values: Sequence[float]) -> float:
    """The median; of an even count the upper middle value (of 2 values the larger)."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


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
