"""How the sparse codecs cut a tensor into blocks, identically on every peer.

SparseLoCo and DCT both select the top-k entries of each block. The block geometry is never sent:
sender and receiver derive it from the tensor's shape and the codec's ``chunk``, so it must be a
pure function of those two. The rule:

* a tensor of two or more dimensions is viewed as ``(shape[0], prod(shape[1:]))``, a 1-D (or 0-D)
  one as ``(1, n)``;
* each side is cut into blocks whose side is the largest divisor of that side that is <= chunk
  (a 256x128 matrix gives 64x64 blocks, a side of 352 gives 44, a prime side above chunk gives 1:
  correct, merely degenerate).

``to_blocks`` and ``from_blocks`` are reshapes and one permute, never Python loops over blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from protocol.codecs.base import Shape


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


def to_blocks(x2d: torch.Tensor, bh: int, bw: int) -> torch.Tensor:
    """(rows, cols) -> (nblocks, bh*bw); bh and bw must divide rows and cols."""
    rows, cols = x2d.shape
    return x2d.reshape(rows // bh, bh, cols // bw, bw).permute(0, 2, 1, 3).reshape(-1, bh * bw)


def from_blocks(blocks: torch.Tensor, rows: int, cols: int, bh: int, bw: int) -> torch.Tensor:
    """(nblocks, bh*bw) -> (rows, cols): the inverse of ``to_blocks``."""
    return blocks.reshape(rows // bh, cols // bw, bh, bw).permute(0, 2, 1, 3).reshape(rows, cols)
