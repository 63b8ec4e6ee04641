"""The lossless variant of the activation codec: the model constrained so that span(U) holds it all.

The codec of protocol/chain/activations.py sends ``(h - T[tok]) @ U`` forward and ``g @ U`` backward,
with U the basis of protocol/chain/subspace.py and T the token embedding as of the last outer step. The
residual stream at any stage boundary is ``h = E[tok] + sum of the blocks' writes``, and every
write into it goes through an *output projection*: ``blocks.i.attn.out[.s].weight`` and
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
measured in tests/protocol/test_activations.py. It also makes the backward lossless: every parameter of a
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

Pure torch arithmetic, no I/O.
"""

from __future__ import annotations

import math
from typing import Iterable, List, Optional, Tuple

import torch

from protocol.model.layout import EMBED_NAME, RESIDUAL_KINDS, parse_name

__all__ = [
    "is_output_projection",
    "project_rows_",
    "project_embedding_drift_",
    "constrain_to_subspace_",
    "project_gradients_",
]

EMBEDDING = EMBED_NAME
_U_BITS = 21  # fixed-point bits of U in the exact projection (|U| <= 1)


def is_output_projection(name: str) -> bool:
    """``blocks.{i}.attn.out[.{s}].weight`` or ``blocks.{i}.mlp.down[.{s}].weight``."""
    parts = parse_name(name)
    return parts is not None and parts.kind in RESIDUAL_KINDS


def _check_basis(U: torch.Tensor, d: int, what: str) -> None:
    if U.ndim != 2 or U.shape[0] != d:
        raise ValueError(f"{what}: U must be ({d}, k), got {tuple(U.shape)}")


def _is_identity(U: torch.Tensor) -> bool:
    return U.shape[0] == U.shape[1] and torch.equal(U, torch.eye(U.shape[0], dtype=U.dtype, device=U.device))


# --- the exact projection ------------------------------------------------------------------------
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


# --- the projections -------------------------------------------------------------------------------
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
