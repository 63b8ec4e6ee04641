"""A small Llama-style decoder over bytes, in one file (after nanoGPT's model.py).

RMSNorm, rotary position embeddings, causal attention through PyTorch's SDPA, a SwiGLU MLP and an
untied output head. Parameter names and shapes are those of ``ModelSpec.param_shapes()``, in the
same order: the exchange and the checkpoints address tensors by those names.

The model can be cut into pipeline stages: ``embed_tokens`` -> ``forward_blocks(h, start, end)``
(any slice of the blocks) -> ``forward_head``. ``forward`` is exactly those three in a row. A chain
stage is a ``Model`` built with ``blocks=(start, end)``: it holds only blocks ``[start, end)``,
under the full model's names (``blocks.3.attn.qkv.weight``), plus the embedding if ``start == 0``
and the final norm and head if ``end == n_layers`` (``protocol.model.layout.in_block_range``).

Initialisation is bit-identical on every machine for the same seed, which torch's own float32
``normal_`` is not: its AVX2 path and its scalar path (ARM, or ``ATEN_CPU_CAPABILITY=default``)
give different bits for the same generator. ``build_model`` therefore draws only integers from a
CPU ``torch.Generator`` and turns them into normal deviates with exact arithmetic. It walks the whole
layout (``protocol.model.layout.tensor_layout``) for every model, a stage included, and skips the draws of
the tensors the model does not hold, so a stage gets exactly the bits of the full model's tensors.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from protocol.model.layout import in_block_range, tensor_layout
from protocol.spec import ModelSpec

__all__ = ["Model", "build_model", "init_parameters"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in float32 even under autocast: the mean of squares overflows fp16 easily
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_cache(head_dim: int, seq_len: int, theta: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (seq_len, head_dim), in the rotate-half layout of Llama."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + head_dim/2) of x (batch, heads, seq, head_dim) by position."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Causal self-attention. With ``slices`` > 1 the heads are split into groups with separate
    parameters (``qkv.{s}``, ``out.{s}``), so a peer can freeze the groups it does not own and skip
    their weight gradients; the function is the same as one fused projection."""

    def __init__(self, spec: ModelSpec, slices: int = 1):
        super().__init__()
        self.n_heads = spec.n_heads
        self.head_dim = spec.d_model // spec.n_heads
        self.slices = slices
        width = spec.d_model // slices
        if slices == 1:
            self.qkv = nn.Linear(spec.d_model, 3 * spec.d_model, bias=False)
            self.out = nn.Linear(spec.d_model, spec.d_model, bias=False)
        else:
            self.qkv = nn.ModuleList(nn.Linear(spec.d_model, 3 * width, bias=False) for _ in range(slices))
            self.out = nn.ModuleList(nn.Linear(width, spec.d_model, bias=False) for _ in range(slices))

    def _heads(self, qkv: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        heads = self.n_heads // self.slices
        q, k, v = qkv(x).view(B, T, 3, heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin).type_as(v), apply_rope(k, cos, sin).type_as(v)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(B, T, heads * self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.slices == 1:
            return self.out(self._heads(self.qkv, x, cos, sin))
        y = self.out[0](self._heads(self.qkv[0], x, cos, sin))
        for qkv, out in zip(self.qkv[1:], self.out[1:]):
            y = y + out(self._heads(qkv, x, cos, sin))
        return y


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up``, keeping only ``gate`` and ``up`` for the backward. Autograd's silu and
    product keep ``silu(gate)`` as well: a third ffn-wide tensor a token and a layer (its live peak:
    bench/memory_peak.py, −8.5 % on the demo model). The backward recomputes ``silu(gate)`` and
    applies the operations autograd's would, in the same order, so the gradients are the same bits
    (tests/training/test_model.py::test_swiglu_keeps_two_tensors_and_the_same_gradients)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        # up is needed only for gate's gradient; silu(gate), for up's, is recomputed from gate
        ctx.save_for_backward(gate, up if ctx.needs_input_grad[0] else None)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_gate = grad_up = None
        if ctx.needs_input_grad[0]:  # the product's gradient for silu(gate), then silu's
            grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
        if ctx.needs_input_grad[1]:
            grad_up = grad * F.silu(gate)
        return grad_gate, grad_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up``; under autograd it keeps two tensors for the backward, not three."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SwiGLU.apply(gate, up)
    return F.silu(gate) * up


class MLP(nn.Module):
    """SwiGLU. With ``slices`` > 1 the hidden neurons are split into slices with separate
    parameters (``gate.{s}``, ``up.{s}``, ``down.{s}``); the outputs of the slices are summed."""

    def __init__(self, spec: ModelSpec, slices: int = 1):
        super().__init__()
        self.slices = slices
        if slices == 1:
            self.gate = nn.Linear(spec.d_model, spec.ffn_hidden, bias=False)
            self.up = nn.Linear(spec.d_model, spec.ffn_hidden, bias=False)
            self.down = nn.Linear(spec.ffn_hidden, spec.d_model, bias=False)
        else:
            width = spec.ffn_hidden // slices
            self.gate = nn.ModuleList(nn.Linear(spec.d_model, width, bias=False) for _ in range(slices))
            self.up = nn.ModuleList(nn.Linear(spec.d_model, width, bias=False) for _ in range(slices))
            self.down = nn.ModuleList(nn.Linear(width, spec.d_model, bias=False) for _ in range(slices))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slices == 1:
            return self.down(swiglu(self.gate(x), self.up(x)))
        y = self.down[0](swiglu(self.gate[0](x), self.up[0](x)))
        for gate, up, down in zip(self.gate[1:], self.up[1:], self.down[1:]):
            y = y + down(swiglu(gate(x), up(x)))
        return y


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, mlp_slices: int = 1, attn_slices: int = 1):
        super().__init__()
        self.attn_norm = RMSNorm(spec.d_model, spec.norm_eps)
        self.attn = Attention(spec, attn_slices)
        self.mlp_norm = RMSNorm(spec.d_model, spec.norm_eps)
        self.mlp = MLP(spec, mlp_slices)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Model(nn.Module):
    """The model, or with ``blocks=(start, end)`` the share of it one pipeline stage holds: blocks
    ``[start, end)``, the embedding only if ``start == 0``, the final norm and head only if
    ``end == n_layers``. Parameter names and order are the full model's restricted to that range
    (``self.blocks`` stays a ModuleList of ``n_layers`` entries, None for the blocks not held),
    so payloads, state dicts and checkpoints match.

    ``recompute_blocks`` (``inner.checkpoint_activations``, set by peer/training/inner.py; a
    chain stage's too): under
    autograd, each block keeps only its input and runs its forward again in the backward
    (torch.utils.checkpoint): the activations of one block at a time instead of every block's, for
    a quarter more FLOPs a step (bench/partial.py). The gradients are the same bits (tests/training/test_model.py::
    test_recomputed_blocks_give_the_same_gradients)."""

    recompute_blocks: bool = False

    def __init__(
        self, spec: ModelSpec, mlp_slices: int = 1, attn_slices: int = 1, blocks: Optional[Tuple[int, int]] = None
    ):
        super().__init__()
        spec.check()
        spec.check_slices(mlp_slices, attn_slices)
        start, end = (0, spec.n_layers) if blocks is None else blocks
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= spec.n_layers):
            raise ValueError(f"block range [{start}, {end}) is not a non-empty part of [0, {spec.n_layers})")
        self.spec = spec
        self.mlp_slices, self.attn_slices = mlp_slices, attn_slices
        self.start, self.end = start, end
        self.is_first, self.is_last = start == 0, end == spec.n_layers
        self.embed = nn.Embedding(spec.vocab_size, spec.d_model) if self.is_first else None
        self.blocks = nn.ModuleList(
            Block(spec, mlp_slices, attn_slices) if start <= i < end else None for i in range(spec.n_layers)
        )
        self.norm = RMSNorm(spec.d_model, spec.norm_eps) if self.is_last else None
        self.head = nn.Linear(spec.d_model, spec.vocab_size, bias=False) if self.is_last else None
        cos, sin = rope_cache(spec.d_model // spec.n_heads, spec.seq_len, spec.rope_theta)
        # not persistent: the state dict holds exactly the parameters of ModelSpec.param_shapes()
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _range(self) -> str:
        return f"blocks [{self.start}, {self.end})"

    def embed_tokens(self, idx: torch.Tensor) -> torch.Tensor:
        """(batch, seq) int64 byte ids -> hidden states (batch, seq, d_model)."""
        if not self.is_first:
            raise RuntimeError(f"the model of {self._range()} does not hold the embedding")
        if idx.shape[-1] > self.spec.seq_len:
            raise ValueError(f"sequence of {idx.shape[-1]} tokens is longer than model.seq_len={self.spec.seq_len}")
        return self.embed(idx)

    def forward_blocks(self, h: torch.Tensor, start: Optional[int] = None, end: Optional[int] = None) -> torch.Tensor:
        """Run blocks[start:end] on hidden states (batch, seq, d_model): one pipeline stage's work.
        By default the blocks this model holds; an explicit range must lie within them."""
        start = self.start if start is None else start
        end = self.end if end is None else end
        if not self.start <= start <= end <= self.end:
            raise ValueError(f"blocks [{start}, {end}) are not within the {self._range()} this model holds")
        T = h.shape[1]
        if T > self.spec.seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than model.seq_len={self.spec.seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        recompute = self.recompute_blocks and torch.is_grad_enabled()
        for i in range(start, end):
            if recompute:
                h = torch.utils.checkpoint.checkpoint(self.blocks[i], h, cos, sin, use_reentrant=False)
            else:
                h = self.blocks[i](h, cos, sin)
        return h

    def forward_head(
        self, h: torch.Tensor, targets: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Final norm and head; with targets, also the mean cross-entropy in nats."""
        if not self.is_last:
            raise RuntimeError(f"the model of {self._range()} does not hold the head")
        logits = self.head(self.norm(h)).float()
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss

    def forward(
        self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """idx (batch, seq) -> (logits (batch, seq, vocab) float32, mean loss in nats or None)."""
        return self.forward_head(self.forward_blocks(self.embed_tokens(idx)), targets)


_CHUNK = 1 << 20  # bounds the int64 scratch of one draw to 24 MiB however large the tensor


def _exact_normal(
    shape: Tuple[int, ...], std: float, generator: torch.Generator, keep: bool = True
) -> Optional[torch.Tensor]:
    """float32 samples of N(0, std^2) whose bits depend only on the generator's state.

    Irwin-Hall: the sum of 12 uniforms minus 6 has mean 0 and variance 1 and is close to normal
    (support +-6 sigma). Each uniform is a 15-bit integer; four of them come from one 62-bit draw.
    Integer sums, a division by a power of two (exact) and one float64 multiply are correctly
    rounded IEEE operations, so every CPU and vector unit gives the same bits.

    ``keep=False`` makes the same draws (the generator ends where it would) into one reused
    scratch buffer and returns None: the tensors a pipeline stage does not hold.
    """
    n = math.prod(shape)
    out = torch.empty(n, dtype=torch.float32) if keep else None
    scratch: Optional[torch.Tensor] = None
    for start in range(0, n, _CHUNK):
        m = min(_CHUNK, n - start)
        if not keep:
            if scratch is None or scratch.shape[0] != m:
                scratch = torch.empty((m, 3), dtype=torch.int64)
            torch.randint(0, 1 << 62, (m, 3), dtype=torch.int64, generator=generator, out=scratch)
            continue
        draws = torch.randint(0, 1 << 62, (m, 3), dtype=torch.int64, generator=generator)
        total = torch.zeros(m, dtype=torch.int64)
        for shift in (0, 15, 30, 45):
            total += ((draws >> shift) & 0x7FFF).sum(dim=1)
        # uniforms u = (k + 1/2) / 2^15, so sum(u) - 6 = (2 * sum(k) + 12 - 12 * 2^15) / 2^16
        z = (2 * total + 12 - 12 * (1 << 15)).to(torch.float64) / float(1 << 16)
        out[start : start + m] = (z * std).to(torch.float32)
    return out.view(shape) if keep else None


@torch.no_grad()
def init_parameters(model: Model, seed: int) -> None:
    """Re-initialise every parameter from ``seed``, on the CPU: walk the full model's layout in
    order on one generator; norm weights are ones, matrices exact normals (``init_std``, divided
    by sqrt(2 n_layers) for the output projections). The draws of the tensors a stage does not
    hold are made and dropped, so a stage gets exactly the full model's bits. Memory peak: the
    held parameters, one fp32 copy of the largest held tensor and one draw chunk's scratch."""
    spec = model.spec
    generator = torch.Generator(device="cpu").manual_seed(int(seed))
    residual_std = spec.init_std / math.sqrt(2 * spec.n_layers)
    own = dict(model.named_parameters())
    for name, info in tensor_layout(spec, model.mlp_slices, model.attn_slices).items():
        held = in_block_range(info, model.start, model.end, spec.n_layers)
        p = own.pop(name, None)
        if (p is not None) != held:  # pragma: no cover - Model and the layout disagree
            raise RuntimeError(f"{name}: the model {'holds' if p is not None else 'lacks'} it, the layout says otherwise")
        if info.is_vector:
            value = torch.ones(info.shape) if held else None
        else:
            value = _exact_normal(info.shape, residual_std if info.residual else spec.init_std, generator, keep=held)
        if held:
            p.copy_(value.to(device=p.device, dtype=p.dtype))
    if own:  # pragma: no cover - Model and the layout disagree
        raise RuntimeError(f"parameters unknown to the layout: {sorted(own)}")


def build_model(
    spec: ModelSpec, seed: int, mlp_slices: int = 1, attn_slices: int = 1, blocks: Optional[Tuple[int, int]] = None
) -> Model:
    """A model on the CPU whose parameters are bit-identical on every machine for the same seed.

    ``mlp_slices``/``attn_slices`` > 1 store the MLP hidden neurons / attention heads as that many
    separate parameters (partial parameter updates train one slice per peer). ``blocks=(start,
    end)``: only that pipeline stage's share, with exactly the bits the full model's tensors get;
    the other tensors are never allocated."""
    with torch.random.fork_rng(devices=[]):  # nn.Linear's own init would advance the global RNG
        model = Model(spec, mlp_slices, attn_slices, blocks)
    init_parameters(model, seed)
    return model
