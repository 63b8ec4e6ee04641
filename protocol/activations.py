"""Subspace compression of the activations and activation-gradients between pipeline stages.

A *chain* is one replica cut into pipeline stages, one low-resource peer per stage (ALGORITHMS.md
section 5; arXiv 2601.02360 with the compression of arXiv 2506.01260). Between two stages travel,
per token, the hidden state forward and its gradient backward. Both are compressed onto a fixed
k-dimensional subspace of R^d:

* ``U`` (d, k), orthonormal columns: ``subspace_basis(d, k, seed)``, the Q of a QR of a Gaussian
  drawn from the run's seed, so every peer builds the same U without communication.
* ``T`` (vocab, d): the token-embedding matrix as of the last outer step. Every stage holds a copy
  and refreshes it after each outer step (every stage applies the outer update of
  ``embed.weight``, even those that do not train it).
* forward:  send ``c = (h - T[tok]) @ U`` (k 16-bit values per token) and the token ids;
  the receiver rebuilds ``h_hat = c @ U.T + T[tok]``.
* backward: send ``c = g @ U``; the receiver uses ``g_hat = c @ U.T`` (the gradient projected
  onto span(U)).

Bytes per token (``bytes_per_token``): forward ``k * s + b``, backward ``k * s``, where s is the
bytes of the wire dtype (2 for fp16/bf16) and b the bytes of one token id (1 for a 256-token byte
vocabulary, 2 up to 65,536 tokens, else 4). Uncompressed: ``d * s`` (``d * 4`` in fp32).
Reference scale point: d 1024, k 160, fp16, a 2-byte token id -> 160 * 2 + 2 = 322 bytes per
token instead of 2048 (6.4x); the paper counts 322 each way, but the backward frame needs no ids
(the receiver of a gradient sent the activation and knows them): 320.

The lossless variant (what this module implements)
---------------------------------------------------
The residual stream at any stage boundary is ``h = E[tok] + sum of the blocks' writes``, and
every write into it goes through an *output projection*: ``blocks.i.attn.out[.s].weight`` and
``blocks.i.mlp.down[.s].weight`` (shape (d, in): their columns live in R^d). RoPE adds nothing to
the stream, norms only read it. Hence, with ``P = U U^T``:

1. every output projection has its columns in span(U): ``W = P W`` (``project_rows_``), so every
   block writes ``W x = U (U^T W x)`` into span(U); and
2. the embedding's *drift since the last outer step* has its rows in span(U):
   ``E = T + (E - T) P`` (``project_embedding_drift_``). The embedding itself stays full-rank
   (T is the high-rank anchor that both ends of a link hold); only what it learns within a
   round is constrained, and that restarts from zero each round because T is refreshed to E.

Then ``h - T[tok] = (E - T)[tok] + sum of writes`` lies in span(U) at every boundary, and the
forward is exact up to the 16-bit rounding of c: relative error ~2e-4 (fp16; 1.7e-3 in bf16),
measured in tests/test_activations.py. It also makes the backward lossless: every parameter of a
stage moves its boundary output only inside span(U) (all paths pass through an output projection
or the embedding drift), so ``g`` and ``P g`` give that stage the same gradient for every
parameter except the output projections and the embedding, and for those the same *projected*
gradient (``project_gradients_``). Chain training is then one-box training of the constrained
model, up to 16-bit rounding.

A training loop applies the constraint as a projection, not a reparameterization, so parameter
names and shapes stay those of ``ModelSpec.param_shapes()`` and the SparseLoCo exchange works as
for any replica:

* after ``build_model`` (round 0): ``constrain_to_subspace_(params, U, T=E, exact=True)``;
* every inner step: ``loss.backward()``; ``project_gradients_(params, U)`` (so AdamW's moments
  see only tangent directions); clip; ``optimizer.step()``;
  ``constrain_to_subspace_(params, U, T)`` -- AdamW's element-wise update (not its weight decay)
  leaves span(U), so the weights, not only the gradients, are projected after every step;
* every outer step: after the aggregated update is applied,
  ``constrain_to_subspace_(params, U, T=E, exact=True)`` -- the sparsified, quantized aggregate
  is not in span(U) -- then ``T <- E.clone()`` (drift zero again). ``exact=True`` runs the
  projection on integers held in float64 (see ``_exact_project_columns``): any BLAS gives the
  same bits, so every replica gets the same theta. Inner steps are local and use a plain matmul.

Where the constraint lives -- two ways, both served by these functions:

* run-wide (lossless end to end): every replica, full ones included, applies it as above; it is
  a property of the model, like its shape, and theta itself stays in the constrained set.
* chain-local (selective, as the reported heterogeneous runs compress only the chains): full
  replicas train theta unconstrained; each stage of a chain, at the start of a round, sets its
  local copy to the projection of theta (``constrain_to_subspace_(..., T=E)``, no need for
  ``exact``), trains it constrained, and reports its pseudo-gradient from that projected start
  (``projected_start - local_end``, in span(U)), not from theta -- otherwise it would push the
  off-subspace part of theta to zero every round. The boundaries are lossless for the model the
  chain trains; what the chain drops is the off-subspace part of theta's output projections.

Both ends of a link must hold the same T bits (the same outer step): a frame should carry the
round of the T it was encoded against, and a stage must refuse frames of another round. Without
any constraint the codec still works and is lossy: the part of ``h - T[tok]`` outside span(U)
(~sqrt(1 - k/d) of it for a generic stream, 0.86 at k/d = 1/4 in the tests) is dropped.

Decoding frames from another peer: ``check_activation_frame`` / ``check_gradient_frame`` raise
``FrameError`` before anything reaches the model. This module is pure torch arithmetic, no I/O.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from protocol.errors import FrameError
from protocol.layout import EMBED_NAME, RESIDUAL_KINDS, parse_name

__all__ = [
    "WIRE_DTYPES",
    "subspace_basis",
    "ActivationCodec",
    "compressed_boundary",
    "token_id_bytes",
    "bytes_per_token",
    "uncompressed_bytes_per_token",
    "is_output_projection",
    "project_rows_",
    "project_embedding_drift_",
    "constrain_to_subspace_",
    "project_gradients_",
    "check_activation_frame",
    "check_gradient_frame",
]

WIRE_DTYPES = (torch.float16, torch.bfloat16)
EMBEDDING = EMBED_NAME
_BASIS_TAG = b"voloco/activation-subspace/v1"


# --- the basis ---------------------------------------------------------------------------------
def subspace_basis(d: int, k: int, seed: int) -> torch.Tensor:
    """U (d, k) float32 with orthonormal columns, bit-identical on every machine for (d, k, seed).

    ``k == d``: the identity (no compression). Otherwise the Q of the QR of a (d, k) Gaussian with
    a positive diagonal in R (which makes Q unique), computed as below:

    * the generator is seeded from sha256(tag, seed, d), not from ``seed`` itself, so U is
      independent of the weights ``build_model`` draws from the same seed;
    * the Gaussian comes from integers only (Irwin-Hall, as peer/model.py's ``_exact_normal``):
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
    """float64 (rows, cols) ~ N(0, 1), bits depending only on the generator (cf. peer/model.py).

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


# --- sizes -------------------------------------------------------------------------------------
def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def token_id_bytes(vocab_size: int) -> int:
    """Bytes of one token id on the wire: 1 up to 256 tokens, 2 up to 65,536, else 4."""
    if vocab_size < 1:
        raise ValueError("vocab_size must be >= 1")
    return 1 if vocab_size <= 1 << 8 else 2 if vocab_size <= 1 << 16 else 4


def bytes_per_token(k: int, dtype: torch.dtype = torch.float16, vocab_size: int = 1 << 16, token_ids: bool = True) -> int:
    """Payload bytes per token of one compressed frame: ``k * itemsize (+ token id bytes)``.

    Forward frames carry the ids (``token_ids=True``); backward frames need not. d 1024, k 160,
    fp16, vocab <= 65,536: 322 forward, 320 backward."""
    return k * _itemsize(dtype) + (token_id_bytes(vocab_size) if token_ids else 0)


def uncompressed_bytes_per_token(d: int, dtype: torch.dtype = torch.float16) -> int:
    """The plain hidden state: ``d * itemsize`` (2048 for d 1024 in fp16, 4096 in fp32)."""
    return d * _itemsize(dtype)


# --- the codec ---------------------------------------------------------------------------------
class ActivationCodec:
    """Encodes what crosses one stage boundary. Pure arithmetic; shapes (B, S, ...) throughout.

    ``U`` (d, k) float32 with orthonormal columns (``subspace_basis``); ``dtype`` the 16-bit wire
    dtype. With U the identity (k == d) no matmul is done: the frame is ``h - T[tok]`` in 16 bits.
    Encoders raise ValueError for values that are not finite in the wire dtype (fp16 overflows
    above 65504: use bfloat16 for such activations)."""

    def __init__(self, U: torch.Tensor, dtype: torch.dtype = torch.float16):
        if not isinstance(U, torch.Tensor) or U.ndim != 2 or not 1 <= U.shape[1] <= U.shape[0]:
            raise ValueError("U must be a (d, k) tensor with 1 <= k <= d")
        if dtype not in WIRE_DTYPES:
            raise ValueError(f"wire dtype must be one of {WIRE_DTYPES}, got {dtype}")
        self.U = U.detach().to(torch.float32).contiguous()
        self.dtype = dtype
        self.d, self.k = self.U.shape
        self.identity = self.k == self.d and torch.equal(self.U, torch.eye(self.d))

    def forward_bytes_per_token(self, vocab_size: int) -> int:
        return bytes_per_token(self.k, self.dtype, vocab_size, token_ids=True)

    def backward_bytes_per_token(self) -> int:
        return bytes_per_token(self.k, self.dtype, token_ids=False)

    def _anchor(self, tok: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
        if T.ndim != 2 or T.shape[1] != self.d:
            raise ValueError(f"T must be (vocab, {self.d}), got {tuple(T.shape)}")
        return F.embedding(tok, T.detach().to(torch.float32))

    def _wire(self, x: torch.Tensor, what: str) -> torch.Tensor:
        out = x.to(self.dtype)
        if not torch.isfinite(out).all():
            raise ValueError(f"{what} is not finite in {self.dtype} (overflow or a diverged model)")
        return out

    def encode_forward(self, h: torch.Tensor, tok: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
        """h (B, S, d), tok (B, S) int64 -> coefficients (B, S, k) in the wire dtype."""
        if h.shape[-1] != self.d or tuple(tok.shape) != tuple(h.shape[:-1]):
            raise ValueError(f"h must be (B, S, {self.d}) and tok (B, S); got {tuple(h.shape)}, {tuple(tok.shape)}")
        dev = h.detach().to(torch.float32) - self._anchor(tok, T)
        return self._wire(dev if self.identity else dev @ self.U, "activation")

    def decode_forward(self, coeffs: torch.Tensor, tok: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
        """coefficients (B, S, k) -> h_hat (B, S, d) float32 = coeffs @ U.T + T[tok]."""
        c = coeffs.to(torch.float32)
        return (c if self.identity else c @ self.U.T) + self._anchor(tok, T)

    def encode_backward(self, g: torch.Tensor) -> torch.Tensor:
        """dL/dh (B, S, d) -> (B, S, k) in the wire dtype."""
        if g.shape[-1] != self.d:
            raise ValueError(f"gradient must end in {self.d}, got {tuple(g.shape)}")
        g = g.detach().to(torch.float32)
        return self._wire(g if self.identity else g @ self.U, "activation gradient")

    def decode_backward(self, c: torch.Tensor) -> torch.Tensor:
        """(B, S, k) -> the gradient projected on span(U), (B, S, d) float32."""
        c = c.to(torch.float32)
        return c if self.identity else c @ self.U.T


class _Boundary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, tok, T, codec):
        ctx.codec, ctx.dtype = codec, h.dtype
        return codec.decode_forward(codec.encode_forward(h, tok, T), tok, T).to(h.dtype)

    @staticmethod
    def backward(ctx, g):
        codec = ctx.codec
        return codec.decode_backward(codec.encode_backward(g)).to(ctx.dtype), None, None, None


def compressed_boundary(h: torch.Tensor, tok: torch.Tensor, T: torch.Tensor, codec: ActivationCodec) -> torch.Tensor:
    """A stage boundary inside one process (simulations, tests): forward ``h -> h_hat`` and
    backward ``g -> g_hat`` exactly as two peers linked by ``codec`` would compute them."""
    return _Boundary.apply(h, tok, T, codec)


# --- the lossless constraint ---------------------------------------------------------------------
def is_output_projection(name: str) -> bool:
    """``blocks.{i}.attn.out[.{s}].weight`` or ``blocks.{i}.mlp.down[.{s}].weight``."""
    parts = parse_name(name)
    return parts is not None and parts.kind in RESIDUAL_KINDS


def _check_basis(U: torch.Tensor, d: int, what: str) -> None:
    if U.ndim != 2 or U.shape[0] != d:
        raise ValueError(f"{what}: U must be ({d}, k), got {tuple(U.shape)}")


def _is_identity(U: torch.Tensor) -> bool:
    return U.shape[0] == U.shape[1] and torch.equal(U, torch.eye(U.shape[0], dtype=U.dtype, device=U.device))


_U_BITS = 21  # fixed-point bits of U in the exact projection (|U| <= 1)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2.0 ** e (float64) for integer e, built from its bit pattern: exact, no libm involved."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def _to_fixed(x: torch.Tensor, bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per column j: integers q (float64, |q| <= 2**bits) and exponents e with x ~ q * 2**(e - bits)."""
    _, e = torch.frexp(x.abs().amax(dim=0))  # max |x_j| < 2**e_j (exact; 0 for a zero column)
    e = e.to(torch.int64)
    return torch.round(x * _pow2(bits - e)), e


def _exact_project_columns(W: torch.Tensor, U: torch.Tensor) -> torch.Tensor:
    """U (U^T W), the same bits on every machine, at the speed of a float64 matmul.

    Both products run on integers: U in 21-bit fixed point, W and then U^T W in per-column
    fixed point, sized so that every product and every partial sum is an integer below 2**53.
    A float64 matmul of such operands is exact whatever the summation order, blocking, FMA or
    thread count of the BLAS, so the result does not depend on the library. Scalings are by
    powers of two (exact) and ``round`` is IEEE round-half-even. The price is a relative error
    of about 2**-21 of each column's largest entry, far below the wire's 16-bit rounding.
    """
    U64, W64 = U.detach().cpu().double(), W.detach().cpu().double()
    d, k = U64.shape
    Uq = torch.round(U64 * 2.0**_U_BITS)  # |Uq| <= 2**21
    w_bits = 52 - _U_BITS - math.ceil(math.log2(d))  # d * 2**(21 + w_bits) <= 2**52
    c_bits = 52 - _U_BITS - math.ceil(math.log2(k)) if k > 1 else 52 - _U_BITS
    Wq, ew = _to_fixed(W64, w_bits)
    Cq = Uq.T @ Wq  # exact integers: U^T W = Cq * 2**(ew - 21 - w_bits)
    Cq2, ec = _to_fixed(Cq, c_bits)  # Cq ~ Cq2 * 2**(ec - c_bits)
    out = Uq @ Cq2  # exact integers
    return (out * _pow2(ec - c_bits + ew - w_bits - 2 * _U_BITS)).to(torch.float32)


@torch.no_grad()
def project_rows_(W: torch.Tensor, U: torch.Tensor, exact: bool = False) -> torch.Tensor:
    """W <- U (U^T W) in place, for an output projection W (d, in) whose columns live in R^d.

    ``exact``: the fixed-order float64 projection (bit-identical on every machine; for theta
    shared across replicas); else a float32 matmul (local inner steps)."""
    _check_basis(U, W.shape[0], "project_rows_")
    if _is_identity(U):
        return W
    if exact:
        W.copy_(_exact_project_columns(W, U).to(device=W.device, dtype=W.dtype))
    else:
        U = U.to(device=W.device, dtype=torch.float32)
        W.copy_((U @ (U.T @ W.to(torch.float32))).to(W.dtype))
    return W


@torch.no_grad()
def project_embedding_drift_(E: torch.Tensor, T: torch.Tensor, U: torch.Tensor) -> torch.Tensor:
    """E <- T + ((E - T) U) U^T in place: the embedding rows' drift since the last outer step
    kept in span(U). E == T (right after an outer step) is left exactly as it is."""
    _check_basis(U, E.shape[1], "project_embedding_drift_")
    if tuple(T.shape) != tuple(E.shape):
        raise ValueError(f"T must have the embedding's shape {tuple(E.shape)}, got {tuple(T.shape)}")
    if _is_identity(U):
        return E
    U = U.to(device=E.device, dtype=torch.float32)
    T = T.detach().to(device=E.device, dtype=torch.float32)
    E.copy_((T + ((E.to(torch.float32) - T) @ U) @ U.T).to(E.dtype))
    return E


def _named(named_params) -> Iterable[Tuple[str, torch.Tensor]]:
    return named_params.items() if hasattr(named_params, "items") else named_params


def constrain_to_subspace_(
    named_params, U: torch.Tensor, T: Optional[torch.Tensor] = None, *, exact: bool = False
) -> List[str]:
    """Project, in place, every output projection onto span(U) and the embedding's drift from T.

    ``named_params``: ``model.named_parameters()``, a state dict, or any (name, tensor) pairs --
    one stage's share is fine; names outside the constraint are left alone. ``T`` is required
    when ``embed.weight`` is among them. Returns the names it projected, in order. See the module
    docstring for when a training loop calls it (and with ``exact``)."""
    touched = []
    for name, p in _named(named_params):
        if is_output_projection(name):
            project_rows_(p.data if isinstance(p, torch.nn.Parameter) else p, U, exact=exact)
            touched.append(name)
        elif name == EMBEDDING:
            if T is None:
                raise ValueError("constrain_to_subspace_: embed.weight needs T, the embedding at the last outer step")
            project_embedding_drift_(p.data if isinstance(p, torch.nn.Parameter) else p, T, U)
            touched.append(name)
    return touched


@torch.no_grad()
def project_gradients_(named_params, U: torch.Tensor) -> List[str]:
    """grad <- P grad for output projections and grad <- grad P for the embedding (P = U U^T):
    the gradient of the constrained model, the same whether the boundaries are compressed or
    not. Call between ``backward()`` and the optimizer step. Returns the names it projected."""
    touched = []
    for name, p in _named(named_params):
        g = getattr(p, "grad", None)
        if g is None:
            continue
        if is_output_projection(name):
            project_rows_(g, U)
        elif name == EMBEDDING:
            project_rows_(g.T, U)  # rows of the embedding gradient live in R^d
        else:
            continue
        touched.append(name)
    return touched


# --- frames from the network ---------------------------------------------------------------------
_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _check_coeffs(coeffs, expected_shape: Sequence[int], dtype: Optional[torch.dtype], what: str) -> None:
    if not isinstance(coeffs, torch.Tensor):
        raise FrameError(f"{what} must be a tensor, got {type(coeffs).__name__}")
    allowed = WIRE_DTYPES if dtype is None else (dtype,)
    if coeffs.dtype not in allowed:
        raise FrameError(f"{what} has dtype {coeffs.dtype}, expected one of {allowed}")
    expected = tuple(int(n) for n in expected_shape)
    if len(expected) != 3 or tuple(coeffs.shape) != expected:
        raise FrameError(f"{what} has shape {tuple(coeffs.shape)}, expected {expected}")
    if not bool(torch.isfinite(coeffs).all()):
        raise FrameError(f"{what} holds non-finite values")


def check_activation_frame(
    coeffs, tok, expected_shape: Sequence[int], vocab: int, dtype: Optional[torch.dtype] = None
) -> None:
    """Validate a decoded forward frame before it reaches ``decode_forward``: coefficients
    ``expected_shape`` = (B, S, k) in a 16-bit wire dtype (``dtype`` if given), all finite; token
    ids (B, S) of an integer dtype, each in [0, vocab). FrameError otherwise."""
    _check_coeffs(coeffs, expected_shape, dtype, "activation frame")
    if not isinstance(tok, torch.Tensor) or tok.dtype not in _INT_DTYPES:
        raise FrameError(f"token ids must be an integer tensor, got {getattr(tok, 'dtype', type(tok).__name__)}")
    if tuple(tok.shape) != tuple(coeffs.shape[:2]):
        raise FrameError(f"token ids have shape {tuple(tok.shape)}, expected {tuple(coeffs.shape[:2])}")
    if tok.numel():
        lo, hi = int(tok.min()), int(tok.max())
        if lo < 0 or hi >= vocab:
            raise FrameError(f"token ids must lie in [0, {vocab}), got [{lo}, {hi}]")


def check_gradient_frame(coeffs, expected_shape: Sequence[int], dtype: Optional[torch.dtype] = None) -> None:
    """Validate a decoded backward frame: (B, S, k), 16-bit wire dtype, all finite."""
    _check_coeffs(coeffs, expected_shape, dtype, "gradient frame")
