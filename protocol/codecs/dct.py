"""The DCT codec: top-k coefficients of each block's 2-D DCT-II (docs/codecs.md, "DCT momentum").

The sender transforms each block (see chunking.py) with the orthonormal, separable DCT-II,
``C = D_r X D_c^T``, and keeps the ``k`` coefficients of largest magnitude. Fields, all bytes:

* ``idx``: uint16 little-endian, a coefficient's position ``i * bw + j`` in its block's
  coefficient matrix, block after block, strictly increasing inside a block (no duplicates);
* ``val``: the coefficients in the same order, fp16 (clamped to its finite range) or fp32.

Encoding may use matmul, on the pseudo-gradient's device (a GPU's included, see base.py): its
result stays local, only the chosen coefficients are sent. Decoding must give the same bits everywhere, so
the inverse transform of the sparse coefficients is built from element-wise operations in a fixed
order: for t = 0 .. k-1, ``acc += (c_t * D_r[i_t, :])[:, None] * D_c[j_t, :][None, :]``,
vectorized over blocks. The basis itself is computed with Python's ``math.cos`` in float64 and
rounded to float32, not with a vectorized library whose last bit may depend on the CPU.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Mapping, Tuple

import numpy as np
import torch

from protocol.codecs.base import Fields, Shape, TensorCodec
from protocol.codecs.chunking import Blocking, check_positions, select_top_k, top_k_geometry
from protocol.codecs.fields import check_encodable, check_floats, expect_fields

_MAX_CHUNK = 256  # 256*256 = 2**16 positions per block: uint16 indices
_VALUE_DTYPES = {"fp16": np.dtype("<f2"), "fp32": np.dtype("<f4")}
_FP16_MAX = 65504.0
_MSGPACK_OVERHEAD = 24  # fixmap header, two short keys, two bin32 headers
_TILE = 1 << 20  # elements decoded at once: keeps the accumulator in cache across the k terms


@functools.lru_cache(maxsize=None)
def dct_basis(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix of size n: row u is frequency u, ``C = D @ x`` transforms."""
    rows = []
    for u in range(n):
        norm = math.sqrt((1.0 if u == 0 else 2.0) / n)
        # (2i+1)u mod 4n keeps the angle in [0, 2 pi): the same float64 argument on every machine
        rows.append([norm * math.cos(math.pi * ((2 * i + 1) * u % (4 * n)) / (2 * n)) for i in range(n)])
    return torch.tensor(rows, dtype=torch.float64).to(torch.float32)


@functools.lru_cache(maxsize=None)
def _basis_on(n: int, device: torch.device) -> torch.Tensor:
    """``dct_basis(n)`` copied (exactly) to ``device``, for the encoder's transform."""
    return dct_basis(n).to(device)


class DCTCodec(TensorCodec):
    def __init__(self, chunk: int = 64, topk: int = 32, value_dtype: str = "fp16"):
        if not 1 <= chunk <= _MAX_CHUNK:
            raise ValueError(f"chunk must lie in [1, {_MAX_CHUNK}] (indices are uint16)")
        if not 1 <= topk <= chunk * chunk:
            raise ValueError("topk must lie in [1, chunk*chunk]")
        if value_dtype not in _VALUE_DTYPES:
            raise ValueError(f"value_dtype must be one of {sorted(_VALUE_DTYPES)}, got {value_dtype!r}")
        self.chunk, self.topk, self.value_dtype = chunk, topk, value_dtype
        self._wire = _VALUE_DTYPES[value_dtype]
        self.name = f"dct-c{chunk}-k{topk}-{value_dtype}"

    # --- geometry --------------------------------------------------------------------------------
    def _geometry(self, shape: Shape) -> Tuple[Blocking, int]:
        return top_k_geometry(shape, self.chunk, self.topk)

    def _lengths(self, count: int) -> dict:
        return {"idx": 2 * count, "val": self._wire.itemsize * count}

    def max_encoded_bytes(self, shape: Shape) -> int:
        blocking, k = self._geometry(shape)
        return sum(self._lengths(blocking.nblocks * k).values()) + _MSGPACK_OVERHEAD

    # --- forward transform -----------------------------------------------------------------------
    def coefficients(self, x: torch.Tensor) -> torch.Tensor:
        """Every block's DCT-II coefficients, (nblocks, bh*bw), positions as in the ``idx`` field."""
        blocking = Blocking.of(tuple(x.shape), self.chunk)
        blocks = blocking.split(x).reshape(-1, blocking.bh, blocking.bw)
        d_r, d_c = _basis_on(blocking.bh, x.device), _basis_on(blocking.bw, x.device)
        return (d_r @ blocks @ d_c.T).reshape(-1, blocking.block_numel)

    # --- encode ----------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> Tuple[Fields, torch.Tensor]:
        check_encodable(x)
        shape = tuple(x.shape)
        _, k = self._geometry(shape)
        idx, values = select_top_k(self.coefficients(x.detach()), k)  # on x's device
        if self.value_dtype == "fp16":
            values = values.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16)  # round to nearest, as numpy does
        fields = {
            "idx": idx.to(torch.int32).cpu().numpy().astype("<u2").tobytes(),
            "val": values.cpu().numpy().astype(self._wire, copy=False).tobytes(),
        }
        return fields, self.decode(fields, shape)

    # --- decode ----------------------------------------------------------------------------------
    def decode(self, fields: Mapping[str, Any], shape: Shape) -> torch.Tensor:
        blocking, k = self._geometry(shape)
        count = blocking.nblocks * k
        raw = expect_fields(fields, self._lengths(count))
        values = np.frombuffer(raw["val"], dtype=self._wire).astype(np.float32)
        check_floats(values, "dct values")
        idx = np.frombuffer(raw["idx"], dtype="<u2").astype(np.int64).reshape(blocking.nblocks, k)
        check_positions(idx, blocking.block_numel, "dct", "coefficients")
        coeffs = torch.from_numpy(values.reshape(blocking.nblocks, k))
        blocks = _inverse(blocking, torch.from_numpy(idx), coeffs)
        # coefficients below the bound can still add up past it where no real block could have
        # given them (an honest block's inverse is no larger than its norm: protocol/codecs/fields.py)
        check_floats(blocks.numpy(), "dct decoded values")
        return blocking.join(blocks, shape)


def _inverse(blocking: Blocking, idx: torch.Tensor, coeffs: torch.Tensor) -> torch.Tensor:
    """Sum of the sparse coefficients' basis images, element-wise ops only, terms in index order.

    Tiles of blocks are independent (every op is element-wise across blocks), so tiling changes
    no bit of the result; it only keeps the accumulator in cache while the k terms are added.
    """
    bh, bw, nblocks = blocking.bh, blocking.bw, blocking.nblocks
    d_r, d_c = dct_basis(bh), dct_basis(bw)
    rows, cols = idx // bw, idx % bw
    out = torch.zeros(nblocks, bh, bw, dtype=torch.float32)
    tile = max(1, _TILE // blocking.block_numel)
    for start in range(0, nblocks, tile):
        stop = min(start + tile, nblocks)
        acc, term = out[start:stop], torch.empty(stop - start, bh, bw)
        for t in range(idx.shape[1]):
            u = coeffs[start:stop, t, None] * d_r[rows[start:stop, t]]  # (tile, bh)
            v = d_c[cols[start:stop, t]]  # (tile, bw)
            torch.mul(u[:, :, None], v[:, None, :], out=term)
            acc.add_(term)
    return out.reshape(nblocks, bh * bw)
