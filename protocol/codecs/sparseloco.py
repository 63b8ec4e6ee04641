"""SparseLoCo's codec: per-block top-k, values quantized to a few bits (docs/codecs.md, "SparseLoCo").

Each block (see chunking.py) keeps its ``k`` largest magnitudes. The kept values of the whole
tensor share one quantizer: subtract their mean, cut +-3 sigma into 2**bits equal bins, and send
for each bin the mean of the values that fell in it (a lookup table of 2**bits float32 values).
A kept entry then costs its position inside its block, entropy-coded (index_coding.py: Rice codes
of the gaps between the sorted positions, about 7.5 bits at 64 of 4096), plus a ``bits``-bit
code: about 9.5 bits at the defaults, 215x less than fp32 at the 99.5M shape (a plain 12-bit
position gave 14 bits, 146x).

Fields, all bytes (block geometry and k follow from the shape and the codec's parameters):

* ``idx``: the within-block positions, block after block, strictly increasing inside a block, as
  index_coding.py codes them (variable length, at most ``index_coding.max_bytes``);
* ``codes``: one ``bits``-bit code per kept entry, in the same order, packed little-endian
  (``fields.pack_bits``: four 2-bit codes a byte);
* ``lut``: 2**bits little-endian float32 values.

Encoding runs on the pseudo-gradient's device (a GPU peer's included, see base.py); decoding, on
the CPU from the bytes, is integer decoding of the positions, a table lookup and a scatter: no
floating-point arithmetic at all, hence bit-reproducible.
Gap coding cannot express duplicates, which would otherwise count an entry twice.

The codec's name carries the index format (``sparseloco-rice-…``): a payload of the former
12-bit format names ``sparseloco-…`` and is refused at the payload header, never misread.
"""

from __future__ import annotations

from typing import Any, Mapping, Tuple

import numpy as np
import torch

from protocol.codecs.base import Fields, Shape, TensorCodec
from protocol.codecs import index_coding
from protocol.codecs.chunking import Blocking, select_top_k, top_k_geometry
from protocol.codecs.fields import (
    check_encodable,
    check_floats,
    expect_fields,
    pack_bits_tensor,
    packed_len,
    unpack_bits,
)

_MAX_CHUNK = 64  # as the run spec allows: 4096 positions per block
_SIGMAS = 3.0  # the bins span +-3 sigma around the mean of the kept values
_MSGPACK_OVERHEAD = 32  # fixmap header, three short keys, three bin32 headers


class SparseLoCoCodec(TensorCodec):
    def __init__(self, chunk: int = 64, topk: int = 64, bits: int = 2):
        if not 1 <= chunk <= _MAX_CHUNK:
            raise ValueError(f"chunk must lie in [1, {_MAX_CHUNK}]")
        if not 1 <= topk <= chunk * chunk:
            raise ValueError("topk must lie in [1, chunk*chunk]")
        if not 1 <= bits <= 8:
            raise ValueError("bits must lie in [1, 8]")
        self.chunk, self.topk, self.bits = chunk, topk, bits
        self.name = f"sparseloco-rice-c{chunk}-k{topk}-b{bits}"

    # --- geometry --------------------------------------------------------------------------------
    def _geometry(self, shape: Shape) -> Tuple[Blocking, int]:
        return top_k_geometry(shape, self.chunk, self.topk)

    def _lengths(self, blocking: Blocking, k: int) -> dict:
        """Each field's length, the indices' as the range index_coding allows (it checks the rest)."""
        return {
            "idx": range(1, index_coding.max_bytes(blocking.nblocks, k, blocking.block_numel) + 1),
            "codes": packed_len(blocking.nblocks * k, self.bits),
            "lut": 4 << self.bits,
        }

    def max_encoded_bytes(self, shape: Shape) -> int:
        lengths = self._lengths(*self._geometry(shape))
        return lengths["idx"].stop - 1 + lengths["codes"] + lengths["lut"] + _MSGPACK_OVERHEAD

    # --- encode ----------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> Tuple[Fields, torch.Tensor]:
        """Top-k and quantization on x's device; only the packed fields come to the CPU."""
        check_encodable(x)
        shape = tuple(x.shape)
        blocking, k = self._geometry(shape)
        idx, kept = select_top_k(blocking.split(x.detach()), k)
        codes, lut = self._quantize(kept)
        fields = {
            "idx": index_coding.encode_positions(idx, blocking.block_numel),
            "codes": pack_bits_tensor(codes, self.bits),
            "lut": lut.cpu().numpy().astype("<f4").tobytes(),  # float64 -> float32, round to nearest
        }
        return fields, self.decode(fields, shape)

    def _quantize(self, kept: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Codes in [0, 2**bits) and the table (float64): each bin's mean, or its centre when it is
        empty. In float64 on kept's device; the same operations, in the same order, as the numpy
        quantizer this replaced (the CPU bytes are unchanged, tests/system/test_gpu_encode.py)."""
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
        raw = expect_fields(fields, self._lengths(blocking, k))
        lut = np.frombuffer(raw["lut"], dtype="<f4").astype(np.float32)
        check_floats(lut, "sparseloco lookup table")
        codes = unpack_bits(raw["codes"], count, self.bits, "sparseloco codes")
        # in range and strictly increasing within each block (index_coding checks, or gaps guarantee, both)
        idx = index_coding.decode_positions(raw["idx"], blocking.nblocks, k, blocking.block_numel, "sparseloco indices")
        values = torch.from_numpy(lut[codes].reshape(blocking.nblocks, k))
        return blocking.scatter(idx, values, shape)
