"""Entropy-coded positions of the top-k entries of each block: Rice codes of the gaps.

A block of ``n`` entries keeps ``k`` positions ``p_0 < p_1 < ... < p_{k-1}``. What is sent is the
gaps ``g_0 = p_0``, ``g_i = p_i - p_{i-1} - 1`` (every gap >= 0, their sum <= n - k), each as a
Rice code of parameter ``r``: its low ``r`` bits verbatim and its high part ``q = g >> r`` in
unary. The field, one byte string for all the blocks of a tensor, in block order:

* byte 0: ``r``, chosen by the encoder for the tensor (the smallest ``r`` giving the fewest bytes),
  at most ``max_param(n, k)``;
* the low parts: ``r`` bits per position, packed little-endian as ``fields.pack_bits`` packs
  (``ceil(count * r / 8)`` bytes, zero padding bits);
* the high parts: for each position in order, ``q`` zero bits and then a one bit, packed
  least-significant bit first; the stream ends with the byte that holds the last one (its bits
  above that one are zero padding, no byte follows).

At 64 of 4096 a position costs about 7.5 bits (r = 5; the entropy bound log2(C(4096, 64)) / 64
is 7.36 bits), against 12 for a plain position. A block costs at most ``k * (r + 1) + ((n - k) >>
r)`` bits: the ``q`` of a block sum to at most ``(n - k) >> r``.

Gaps cannot express a duplicate or a decreasing position, so a decoded block is strictly
increasing by construction; the decoder checks the rest: the parameter, the exact stream lengths
and padding, exactly one terminating one bit per position, every unary run within its block's
bound and the last position of every block below ``n``. What it allocates is bounded by the
shape, never by a peer's claims: a byte per bit of a field no longer than ``max_bytes`` of the
shape, and a few int64 arrays of one entry per kept position. Both directions are whole-array
numpy/torch operations, never a loop over positions.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import numpy as np
import torch

from protocol.codecs.fields import pack_bits, packed_len, unpack_bits
from protocol.errors import PayloadError


def entropy_bound_bits(n: int, k: int) -> float:
    """log2 C(n, k): the fewest bits, on average, that tell k positions of n apart."""
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)


def max_param(n: int, k: int) -> int:
    """The largest useful Rice parameter: beyond it every gap's high part is zero already (at most
    16, ``pack_bits``'s limit, for blocks of up to 65536 entries)."""
    return max(0, n - k).bit_length()


def _worst_bytes(nblocks: int, k: int, n: int, r: int) -> int:
    """The longest field with parameter r: every block's high parts summing to (n - k) >> r."""
    return 1 + packed_len(nblocks * k, r) + packed_len(nblocks * (k + ((n - k) >> r)), 1)


@functools.lru_cache(maxsize=1024)
def max_bytes(nblocks: int, k: int, n: int) -> int:
    """An upper bound of the field's length for ``nblocks`` blocks of ``n`` keeping ``k`` each.

    The encoder picks the ``r`` of fewest bytes, so its field is never longer than the worst case
    of the best single ``r``; the decoder refuses anything longer (a field whose unary stream
    overruns its own ``r``'s worst case is longer still, since no ``r``'s worst case is shorter)."""
    return min(_worst_bytes(nblocks, k, n, r) for r in range(max_param(n, k) + 1))


def encode_positions(idx: torch.Tensor, n: int, r: Optional[int] = None) -> bytes:
    """``idx`` (nblocks, k), on any device, strictly increasing within each row, values < n; with
    the Rice parameter that gives the fewest bytes, or ``r`` (a poor one may exceed ``max_bytes``)."""
    nblocks, k = idx.shape
    if idx.numel() == 0:
        return bytes([0])
    idx = idx.to(torch.int64)
    gaps = torch.diff(idx, dim=1, prepend=idx.new_full((nblocks, 1), -1)).reshape(-1) - 1
    best = _best_param(gaps, nblocks, k, n)  # one small device-to-CPU copy, the sizes for every r
    r = best if r is None else r
    low = (gaps & ((1 << r) - 1)).to(torch.int32).cpu().numpy()
    high = (gaps >> r).to(torch.int32).cpu().numpy()
    ends = np.cumsum(high + 1, dtype=np.int64) - 1  # where each unary code's one bit lies
    bits = np.zeros(packed_len(int(ends[-1]) + 1, 1) * 8, dtype=np.uint8)
    bits[ends] = 1
    return bytes([r]) + pack_bits(low, r) + np.packbits(bits, bitorder="little").tobytes()


def _best_param(gaps: torch.Tensor, nblocks: int, k: int, n: int) -> int:
    """The smallest r whose field is shortest; ValueError if the gaps are not those of sorted,
    distinct positions below n (a local bug: the encoder's positions come from top-k)."""
    candidates = range(max_param(n, k) + 1)
    stats = torch.stack([gaps.min(), gaps.max(), *((gaps >> r).sum() for r in candidates)]).tolist()
    lo, hi, sums = stats[0], stats[1], stats[2:]
    if lo < 0 or hi > n - k:
        raise ValueError(f"positions must increase strictly within blocks of {n} (gaps in [{lo}, {hi}])")
    count = gaps.numel()
    sizes = [packed_len(count, r) + packed_len(count + s, 1) for r, s in zip(candidates, sums)]
    return sizes.index(min(sizes))


def decode_positions(data: bytes, nblocks: int, k: int, n: int, what: str) -> np.ndarray:
    """The inverse of ``encode_positions``: (nblocks, k) int64 positions, strictly increasing
    within each row and below n. PayloadError for any field the encoder could not have sent
    (bar the choice of r, which changes no position)."""
    count = nblocks * k
    limit = max_bytes(nblocks, k, n)
    if not 1 <= len(data) <= limit:
        raise PayloadError(f"{what} field of {len(data)} bytes, expected 1 to {limit}")
    r = data[0]
    if r > max_param(n, k):
        raise PayloadError(f"{what} Rice parameter {r} is above {max_param(n, k)} (blocks of {n}, {k} kept)")
    low_len = packed_len(count, r)
    if len(data) < 1 + low_len + (count > 0):
        raise PayloadError(f"{what} truncated: {len(data)} bytes, the low bits alone need {1 + low_len}")
    high = np.frombuffer(data, dtype=np.uint8)[1 + low_len:]
    if count == 0:
        if high.size:
            raise PayloadError(f"{what} has {high.size} bytes after an empty tensor's parameter")
        return np.zeros((nblocks, k), dtype=np.int64)
    bits = np.unpackbits(high, bitorder="little")
    ones = int(np.count_nonzero(bits))
    if ones != count:
        raise PayloadError(f"{what} unary stream holds {ones} codes, expected {count}")
    ends = np.nonzero(bits.view(bool))[0]  # 8x faster than on uint8
    if ends[-1] // 8 != high.size - 1:
        raise PayloadError(f"{what} has bytes after its last code")
    quotients = np.diff(ends, prepend=-1) - 1
    if int(quotients.max()) > (n - k) >> r:
        raise PayloadError(f"{what} unary run of {int(quotients.max())} overruns a block of {n} (r={r})")
    low = unpack_bits(data[1:1 + low_len], count, r, what)
    steps = (quotients << r) + low + 1  # p_i - p_{i-1}, with p_{-1} = -1 in every block
    positions = np.cumsum(steps.reshape(nblocks, k), axis=1) - 1
    if int(positions[:, -1].max()) >= n:
        raise PayloadError(f"{what} index out of range (block of {n} entries)")
    return positions
