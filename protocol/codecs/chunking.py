"""How the sparse codecs cut a tensor into blocks and keep the top-k entries of each, identically on
every peer.

SparseLoCo and DCT both select the top-k entries of each block. The block geometry is never sent:
sender and receiver derive it from the tensor's shape and the codec's ``chunk``, so it must be a
pure function of those two. The rule:

* a tensor of two or more dimensions is viewed as ``(shape[0], prod(shape[1:]))``, a 1-D (or 0-D)
  one as ``(1, n)``;
* each side is cut into blocks whose side is the largest divisor of that side that is <= chunk
  (a 256x128 matrix gives 64x64 blocks, a side of 352 gives 44, a prime side above chunk gives 1:
  correct, merely degenerate).

``to_blocks`` and ``from_blocks`` are reshapes and one permute, never Python loops over blocks.
``top_k_geometry`` gives a tensor's blocking and how many entries each block keeps,
``select_top_k`` picks them (positions increasing within a block, as the wire sends them), and
``check_positions`` validates positions a peer sent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Tuple

import numpy as np
import torch

from protocol.codecs.base import Shape
from protocol.errors import PayloadError


def block_side(n: int, chunk: int) -> int:
    """The largest divisor of ``n`` that is <= ``chunk`` (1 for n == 0: there are no blocks anyway)."""
    for d in range(min(n, chunk), 0, -1):
        if n % d == 0:
            return d
    return 1


def as_2d(shape: Shape) -> tuple[int, int]:
    """The 2-D view of a tensor of ``shape``: (shape[0], rest) for >= 2 dims, (1, n) otherwise."""
    if len(shape) >= 2:
        return shape[0], math.prod(shape[1:])
    return 1, math.prod(shape)


def k_for_block(topk: int, chunk: int, block_numel: int) -> int:
    """Entries kept in a block: ``topk`` per full chunk*chunk block, scaled to the block's size."""
    return max(1, min(block_numel, round(topk * block_numel / (chunk * chunk))))


@dataclass(frozen=True)
class Blocking:
    """The block geometry of one tensor: its 2-D view (rows, cols) cut into bh x bw blocks."""

    rows: int
    cols: int
    bh: int
    bw: int

    @classmethod
    def of(cls, shape: Shape, chunk: int) -> "Blocking":
        rows, cols = as_2d(tuple(shape))
        return cls(rows, cols, block_side(rows, chunk), block_side(cols, chunk))

    @property
    def nblocks(self) -> int:
        return (self.rows // self.bh) * (self.cols // self.bw)

    @property
    def block_numel(self) -> int:
        return self.bh * self.bw

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """x (any shape with rows*cols elements) -> (nblocks, bh*bw), blocks in row-major order."""
        return to_blocks(x.reshape(self.rows, self.cols), self.bh, self.bw)

    def join(self, blocks: torch.Tensor, shape: Shape) -> torch.Tensor:
        """The inverse of ``split``: (nblocks, bh*bw) -> a tensor of ``shape``."""
        return from_blocks(blocks, self.rows, self.cols, self.bh, self.bw).reshape(shape)

    def scatter(self, idx: np.ndarray, values: torch.Tensor, shape: Shape) -> torch.Tensor:
        """``join`` of blocks that are zero but for ``values`` (nblocks, k) at positions ``idx``
        (nblocks, k), distinct within each block: the same tensor, built without the dense blocks
        and their permuted copy (a SparseLoCo payload keeps 1.6 % of the entries)."""
        per_row = self.cols // self.bw
        block = np.arange(idx.shape[0], dtype=np.int64)[:, None]
        row = (block // per_row) * self.bh + idx // self.bw
        col = (block % per_row) * self.bw + idx % self.bw
        dense = torch.zeros(self.rows * self.cols, dtype=values.dtype)
        dense[torch.from_numpy((row * self.cols + col).reshape(-1))] = values.reshape(-1)
        return dense.reshape(shape)


def to_blocks(x2d: torch.Tensor, bh: int, bw: int) -> torch.Tensor:
    """(rows, cols) -> (nblocks, bh*bw); bh and bw must divide rows and cols."""
    rows, cols = x2d.shape
    return x2d.reshape(rows // bh, bh, cols // bw, bw).permute(0, 2, 1, 3).reshape(-1, bh * bw)


def from_blocks(blocks: torch.Tensor, rows: int, cols: int, bh: int, bw: int) -> torch.Tensor:
    """(nblocks, bh*bw) -> (rows, cols): the inverse of ``to_blocks``."""
    return blocks.reshape(rows // bh, cols // bw, bh, bw).permute(0, 2, 1, 3).reshape(rows, cols)


# --- top-k per block -------------------------------------------------------------------------------
def top_k_geometry(shape: Shape, chunk: int, topk: int) -> Tuple[Blocking, int]:
    """The blocking of a tensor of ``shape`` and the entries each of its blocks keeps."""
    blocking = Blocking.of(shape, chunk)
    return blocking, k_for_block(topk, chunk, blocking.block_numel)


def select_top_k(blocks: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(nblocks, n) -> each block's ``k`` entries of largest magnitude: their positions (nblocks, k),
    increasing within a block, and the entries at those positions."""
    idx = blocks.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    return idx, blocks.gather(1, idx)


def check_positions(idx: np.ndarray, block_numel: int, what: str, unit: str) -> None:
    """Positions a peer sent, (nblocks, k): each inside its block of ``block_numel`` ``unit`` and
    strictly increasing within it (a duplicate would count an entry twice). PayloadError otherwise."""
    if idx.size and idx.max() >= block_numel:
        raise PayloadError(f"{what} index out of range (block of {block_numel} {unit})")
    if idx.shape[1] > 1 and not (np.diff(idx, axis=1) > 0).all():
        raise PayloadError(f"{what} indices must increase strictly within each block")
