"""SparseLoCo's codec: per-block top-k, values quantized to a few bits (ALGORITHMS.md section 2).

Each block (see chunking.py) keeps its ``k`` largest magnitudes. The kept values of the whole
tensor share one quantizer: subtract their mean, cut +-3 sigma into 2**bits equal bins, and send
for each bin the mean of the values that fell in it (a lookup table of 2**bits float32 values).
A kept entry then costs a 12-bit position inside its block plus a ``bits``-bit code: 14 bits at
the defaults, about 146x less than fp32 at 64 of 4096.

Fields, all bytes (block geometry and k follow from the shape and the codec's parameters):

* ``idx``: the within-block positions, 12 bits each, packed little-endian (two in three bytes),
  block after block, strictly increasing inside a block;
* ``codes``: one ``bits``-bit code per kept entry, in the same order, packed the same way;
* ``lut``: 2**bits little-endian float32 values.

Encoding runs on the pseudo-gradient's device (a GPU peer's included, see base.py); decoding, on
the CPU from the bytes, is a table lookup and a scatter: no arithmetic at all, hence bit-reproducible.
Requiring increasing positions rejects duplicates, which would otherwise count an entry twice.
"""

from __future__ import annotations

from typing import Any, Mapping, Tuple

import numpy as np
import torch

from protocol.codecs.base import Fields, Shape, TensorCodec
from protocol.codecs.chunking import Blocking, check_positions, select_top_k, top_k_geometry
from protocol.codecs.fields import (
    check_encodable,
    check_floats,
    expect_fields,
    pack_bits_tensor,
    packed_len,
    unpack_bits,
)

INDEX_BITS = 12
_MAX_CHUNK = 64  # 64*64 = 2**INDEX_BITS positions per block
_SIGMAS = 3.0  # the bins span +-3 sigma around the mean of the kept values
_MSGPACK_OVERHEAD = 32  # fixmap header, three short keys, three bin32 headers


class SparseLoCoCodec(TensorCodec):
    def __init__(self, chunk: int = 64, topk: int = 64, bits: int = 2):
        if not 1 <= chunk <= _MAX_CHUNK:
            raise ValueError(f"chunk must lie in [1, {_MAX_CHUNK}] (positions are packed in 12 bits)")
        if not 1 <= topk <= chunk * chunk:
            raise ValueError("topk must lie in [1, chunk*chunk]")
        if not 1 <= bits <= 8:
            raise ValueError("bits must lie in [1, 8]")
        self.chunk, self.topk, self.bits = chunk, topk, bits
        self.name = f"sparseloco-c{chunk}-k{topk}-b{bits}"

    # --- geometry --------------------------------------------------------------------------------
    def _geometry(self, shape: Shape) -> Tuple[Blocking, int]:
        return top_k_geometry(shape, self.chunk, self.topk)

    def _lengths(self, count: int) -> dict:
        return {
            "idx": packed_len(count, INDEX_BITS),
            "codes": packed_len(count, self.bits),
            "lut": 4 << self.bits,
        }

    def max_encoded_bytes(self, shape: Shape) -> int:
        blocking, k = self._geometry(shape)
        return sum(self._lengths(blocking.nblocks * k).values()) + _MSGPACK_OVERHEAD

    # --- encode ----------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> Tuple[Fields, torch.Tensor]:
        """Top-k and quantization on x's device; only the packed fields come to the CPU."""
        check_encodable(x)
        shape = tuple(x.shape)
        blocking, k = self._geometry(shape)
        idx, kept = select_top_k(blocking.split(x.detach()), k)
        codes, lut = self._quantize(kept)
        fields = {
            "idx": pack_bits_tensor(idx, INDEX_BITS),
            "codes": pack_bits_tensor(codes, self.bits),
            "lut": lut.cpu().numpy().astype("<f4").tobytes(),  # float64 -> float32, round to nearest
        }
        return fields, self.decode(fields, shape)

    def _quantize(self, kept: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Codes in [0, 2**bits) and the table (float64): each bin's mean, or its centre when it is
        empty. In float64 on kept's device; the same operations, in the same order, as the numpy
        quantizer this replaced (the CPU bytes are unchanged, tests/test_gpu_encode.py)."""
        bins = 1 << self.bits
        kept = kept.reshape(-1).to(torch.float64)
        if kept.numel() == 0:
            return torch.zeros(0, dtype=torch.int64, device=kept.device), torch.zeros(bins, dtype=torch.float64)
        shift = kept.mean()
        centered = kept - shift
        scale = 2 * _SIGMAS * torch.sqrt(torch.mean(centered * centered)) / bins
        if float(scale) > 0:
            codes = torch.clamp(torch.floor(centered / scale) + bins // 2, 0, bins - 1).to(torch.int64)
        else:  # every kept value equal: one bin holds them all
            codes = torch.full((kept.numel(),), bins // 2, dtype=torch.int64, device=kept.device)
        counts = torch.bincount(codes, minlength=bins)
        sums = torch.bincount(codes, weights=kept, minlength=bins)
        centres = shift + (torch.arange(bins, dtype=torch.float64, device=kept.device) + 0.5 - bins / 2) * scale
        lut = torch.where(counts > 0, sums / torch.clamp(counts, min=1), centres)
        return codes, lut

    # --- decode ----------------------------------------------------------------------------------
    def decode(self, fields: Mapping[str, Any], shape: Shape) -> torch.Tensor:
        blocking, k = self._geometry(shape)
        count = blocking.nblocks * k
        raw = expect_fields(fields, self._lengths(count))
        lut = np.frombuffer(raw["lut"], dtype="<f4").astype(np.float32)
        check_floats(lut, "sparseloco lookup table")
        codes = unpack_bits(raw["codes"], count, self.bits, "sparseloco codes")
        idx = unpack_bits(raw["idx"], count, INDEX_BITS, "sparseloco indices").reshape(blocking.nblocks, k)
        check_positions(idx, blocking.block_numel, "sparseloco", "entries")
        values = torch.from_numpy(lut[codes].reshape(blocking.nblocks, k))
        dense = torch.zeros(blocking.nblocks, blocking.block_numel, dtype=torch.float32)
        dense.scatter_(1, torch.from_numpy(idx), values)
        return blocking.join(dense, shape)
