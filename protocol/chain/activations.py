"""Subspace compression of the activations and activation-gradients between pipeline stages.

A *chain* is one replica cut into pipeline stages, one low-resource peer per stage (docs/chains.md;
arXiv 2601.02360 with the compression of arXiv 2506.01260). Between two stages travel,
per token, the hidden state forward and its gradient backward. Both are compressed onto a fixed
k-dimensional subspace of R^d:

* ``U`` (d, k), orthonormal columns: ``subspace_basis(d, k, seed)`` (protocol/chain/subspace.py), the Q
  of a QR of a Gaussian drawn from the run's seed, so every peer builds the same U without
  communication.
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

With the model constrained as protocol/chain/subspace_constraint.py describes (output projections and
the embedding's drift kept in span(U)), ``h - T[tok]`` lies in span(U) at every boundary and the
codec is lossless up to 16-bit rounding, forward and backward. Without any constraint it still
works and is lossy: the part of ``h - T[tok]`` outside span(U) (~sqrt(1 - k/d) of it for a generic
stream, 0.86 at k/d = 1/4 in the tests) is dropped.

Both ends of a link must hold the same T bits (the same outer step): a frame should carry the
round of the T it was encoded against, and a stage must refuse frames of another round.

Decoding frames from another peer: ``check_activation_frame`` / ``check_gradient_frame`` raise
``FrameError`` before anything reaches the model. This module is pure torch arithmetic, no I/O.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from protocol.errors import FrameError

__all__ = [
    "WIRE_DTYPES",
    "ActivationCodec",
    "compressed_boundary",
    "token_id_bytes",
    "bytes_per_token",
    "uncompressed_bytes_per_token",
    "check_activation_frame",
    "check_gradient_frame",
]

WIRE_DTYPES = (torch.float16, torch.bfloat16)


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
        self._U_on = {self.U.device: self.U}  # U copied to each device it is used on, once

    def basis_on(self, device: torch.device) -> torch.Tensor:
        """U on ``device`` (copied there at the first use)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" are one GPU: one copy
            device = torch.device("cuda", torch.cuda.current_device())
        if device not in self._U_on:
            self._U_on[device] = self.U.to(device)
        return self._U_on[device]

    def forward_bytes_per_token(self, vocab_size: int) -> int:
        return bytes_per_token(self.k, self.dtype, vocab_size, token_ids=True)

    def backward_bytes_per_token(self) -> int:
        return bytes_per_token(self.k, self.dtype, token_ids=False)

    def _anchor(self, tok: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
        if T.ndim != 2 or T.shape[1] != self.d:
            raise ValueError(f"T must be (vocab, {self.d}), got {tuple(T.shape)}")
        return F.embedding(tok.to(T.device), T.detach().to(torch.float32))

    def _wire(self, x: torch.Tensor, what: str) -> torch.Tensor:
        out = x.to(self.dtype)
        if not torch.isfinite(out).all():
            bad = ~torch.isfinite(x)
            if bool(bad.any()):  # a diverged model: NaN or inf before the cast
                raise ValueError(f"{what} is not finite in {self.dtype}: {int(bad.sum())} of {x.numel()} values "
                                 f"are NaN or inf before it (a diverged model)")
            raise ValueError(f"{what} is not finite in {self.dtype}: its largest value, {float(x.abs().max()):.4g}, "
                             f"overflows it (chain.wire_dtype = \"bf16\" has float32's range)")
        return out

    def encode_forward(self, h: torch.Tensor, tok: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
        """h (B, S, d), tok (B, S) int64 -> coefficients (B, S, k) in the wire dtype."""
        if h.shape[-1] != self.d or tuple(tok.shape) != tuple(h.shape[:-1]):
            raise ValueError(f"h must be (B, S, {self.d}) and tok (B, S); got {tuple(h.shape)}, {tuple(tok.shape)}")
        dev = h.detach().to(T.device, torch.float32) - self._anchor(tok, T)
        return self._wire(dev if self.identity else dev @ self.basis_on(T.device), "activation")

    def decode_forward(self, coeffs: torch.Tensor, tok: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
        """coefficients (B, S, k) -> h_hat (B, S, d) float32 = coeffs @ U.T + T[tok], on T's device."""
        c = coeffs.to(T.device, torch.float32)
        return (c if self.identity else c @ self.basis_on(T.device).T) + self._anchor(tok, T)

    def encode_backward(self, g: torch.Tensor) -> torch.Tensor:
        """dL/dh (B, S, d) -> (B, S, k) in the wire dtype."""
        if g.shape[-1] != self.d:
            raise ValueError(f"gradient must end in {self.d}, got {tuple(g.shape)}")
        g = g.detach().to(torch.float32)
        return self._wire(g if self.identity else g @ self.basis_on(g.device), "activation gradient")

    def decode_backward(self, c: torch.Tensor, device: Optional[torch.device] = None) -> torch.Tensor:
        """(B, S, k) -> the gradient projected on span(U), (B, S, d) float32, on ``device`` (default:
        where ``c`` is)."""
        c = c.to(c.device if device is None else device, torch.float32)
        return c if self.identity else c @ self.basis_on(c.device).T


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
