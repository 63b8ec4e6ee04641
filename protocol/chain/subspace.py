"""The subspace of R^d onto which pipeline stages compress what crosses a stage boundary.

``subspace_basis(d, k, seed)`` is U (d, k) with orthonormal columns: the Q of a QR of a Gaussian
drawn from the run's seed, so every peer builds the same U, bit for bit, without communication.
The codec that sends coefficients on span(U) is protocol/chain/activations.py; the constraint that makes
it lossless, protocol/chain/subspace_constraint.py (docs/chains.md, "Subspace-projected activations").
Pure torch arithmetic, no I/O.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib

import torch

__all__ = ["subspace_basis"]

_BASIS_TAG = b"voloco/activation-subspace/v1"


def subspace_basis(d: int, k: int, seed: int) -> torch.Tensor:
    """U (d, k) float32 with orthonormal columns, bit-identical on every machine for (d, k, seed).

    ``k == d``: the identity (no compression). Otherwise the Q of the QR of a (d, k) Gaussian with
    a positive diagonal in R (which makes Q unique), computed as below:

    * the generator is seeded from sha256(tag, seed, d), not from ``seed`` itself, so U is
      independent of the weights ``build_model`` draws from the same seed;
    * the Gaussian comes from integers only (Irwin-Hall, as peer/training/model.py's ``_exact_normal``):
      torch's float ``normal_`` gives different bits on different CPU vector paths;
    * Q comes from classical Gram-Schmidt with one re-orthogonalisation, in float64, every sum a
      fixed pairwise tree of element-wise additions (no BLAS, no torch reduction whose order
      depends on the vector width); Gram-Schmidt's R has a positive diagonal by construction.
      Then one rounding to float32.

    Column j depends only on columns 0..j of the Gaussian, drawn column after column, so the
    bases are nested: ``subspace_basis(d, k1, s) == subspace_basis(d, k2, s)[:, :k1]``.
    """
    return _basis(int(d), int(k), int(seed)).clone()


@functools.lru_cache(maxsize=8)
def _basis(d: int, k: int, seed: int) -> torch.Tensor:
    if d < 1 or not 1 <= k <= d:
        raise ValueError(f"subspace basis needs 1 <= k <= d, got d={d}, k={k}")
    if seed < 0:
        raise ValueError("seed must be >= 0")
    if k == d:
        return torch.eye(d, dtype=torch.float32)
    digest = hashlib.sha256(_BASIS_TAG + seed.to_bytes(32, "little") + d.to_bytes(8, "little")).digest()
    generator = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    with _one_thread():  # thousands of small element-wise ops: waking a thread pool costs more
        return _gram_schmidt(_exact_gaussian(k, d, generator)).to(torch.float32)


@contextlib.contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _gram_schmidt(G: torch.Tensor) -> torch.Tensor:
    """Q (d, k) float64 of the QR of G.T (G is (k, d)) with R's diagonal positive."""
    k, d = G.shape
    Q = torch.zeros(d, k, dtype=torch.float64)  # columns q_j; Qt its transpose, both contiguous
    Qt = torch.zeros(k, d, dtype=torch.float64)
    for j in range(k):
        v = G[j]
        for _ in range(2):  # CGS2: a second pass restores orthogonality to float64 precision
            if j:
                coef = _tree_sum(Q[:, :j] * v[:, None])  # (j,): <q_i, v>
                v = v - _tree_sum(Qt[:j] * coef[:, None])
        q = v / torch.sqrt(_tree_sum(v * v))
        Q[:, j], Qt[j] = q, q
    return Q


def _exact_gaussian(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """float64 (rows, cols) ~ N(0, 1), bits depending only on the generator (cf. peer/training/model.py).

    Sum of 12 uniforms of 15 bits each, four from one 62-bit integer draw, minus 6: integers, one
    exact division by a power of two. Rows are drawn one after another (row-major)."""
    n = rows * cols
    draws = torch.randint(0, 1 << 62, (n, 3), dtype=torch.int64, generator=generator)
    total = torch.zeros(n, dtype=torch.int64)
    for shift in (0, 15, 30, 45):
        total += ((draws >> shift) & 0x7FFF).sum(dim=1)
    return ((2 * total + 12 - 12 * (1 << 15)).to(torch.float64) / float(1 << 16)).view(rows, cols)


def _tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 by a fixed pairwise tree of element-wise additions: the same order, hence
    the same bits, whatever the vector width (unlike torch.sum)."""
    while x.shape[0] > 1:
        n = x.shape[0]
        h = n // 2
        y = x[:h] + x[h : 2 * h]
        if n % 2:
            y[:1] = y[:1] + x[2 * h :]
        x = y
    return x[0]
