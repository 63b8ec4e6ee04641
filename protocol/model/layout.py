"""The model's tensors in one table: name, shape, block, kind and slice of each, in a fixed order.

Everything that depends on how the model is laid out (initialisation, partial-update slices,
chain stages, memory estimates, the subspace constraint of compressed activations) reads this
table instead of parsing names. Pure: no torch.

The order is the model's parameter order: the embedding, then each block (attention norm, the
attention's qkv and output projections, MLP norm, the MLP's gate, up and down projections), then
the final norm and the head. With ``slices > 1`` a sliced projection is one tensor per slice
(``blocks.{i}.mlp.gate.{s}.weight``), cut along its hidden axis (rows of qkv/gate/up, columns of
attn.out/down).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Dict, Iterator, NamedTuple, Optional, Tuple

from protocol.errors import SpecError

KINDS = ("embed", "attn_norm", "qkv", "attn_out", "mlp_norm", "gate", "up", "down", "norm", "head")
RESIDUAL_KINDS = ("attn_out", "down")  # output projections: they write into the residual stream
ATTN_KINDS = ("qkv", "attn_out")
MLP_KINDS = ("gate", "up", "down")
EMBED_NAME = "embed.weight"

# kind -> the name's stem inside a block (or at the top level for embed, norm and head)
_STEM = {
    "embed": "embed",
    "attn_norm": "attn_norm",
    "qkv": "attn.qkv",
    "attn_out": "attn.out",
    "mlp_norm": "mlp_norm",
    "gate": "mlp.gate",
    "up": "mlp.up",
    "down": "mlp.down",
    "norm": "norm",
    "head": "head",
}
_TOP_LEVEL = ("embed", "norm", "head")
_KIND_OF_STEM = {stem: kind for kind, stem in _STEM.items()}
_BLOCK_NAME = re.compile(r"^blocks\.(\d+)\.([a-z_]+(?:\.[a-z]+)?)(?:\.(\d+))?\.weight$")
_TOP_NAME = re.compile(r"^([a-z]+)\.weight$")


@dataclass(frozen=True)
class TensorInfo:
    name: str  # e.g. "blocks.3.mlp.gate.1.weight"
    shape: Tuple[int, ...]
    block: int  # -1: embedding (before the blocks); 0..n_layers-1: that block; n_layers: final norm and head
    kind: str  # one of KINDS
    slice: Optional[int]  # the MLP (gate/up/down) or attention (qkv/attn_out) slice, None when not sliced

    @property
    def residual(self) -> bool:
        """An output projection: initialised with init_std / sqrt(2 * n_layers)."""
        return self.kind in RESIDUAL_KINDS

    @property
    def is_vector(self) -> bool:
        """A norm weight (initialised to ones)."""
        return len(self.shape) == 1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class NameParts(NamedTuple):
    kind: str
    block: Optional[int]  # None for the embedding, the final norm and the head
    slice: Optional[int]


def tensor_name(kind: str, block: Optional[int] = None, slice: Optional[int] = None) -> str:
    """The parameter name peer/training/model.py gives a tensor of ``kind`` (in ``block``, of ``slice``)."""
    stem = _STEM[kind]
    prefix = "" if kind in _TOP_LEVEL else f"blocks.{block}."
    return f"{prefix}{stem}{'' if slice is None else f'.{slice}'}.weight"


def parse_name(name: str) -> Optional[NameParts]:
    """The kind, block and slice a parameter name stands for; None for a name the model never uses."""
    m = _BLOCK_NAME.match(name)
    if m:
        kind = _KIND_OF_STEM.get(m.group(2))
        if kind is None or kind in _TOP_LEVEL:
            return None
        sl = None if m.group(3) is None else int(m.group(3))
        if sl is not None and kind not in ATTN_KINDS + MLP_KINDS:
            return None
        return NameParts(kind, int(m.group(1)), sl)
    m = _TOP_NAME.match(name)
    if m and _KIND_OF_STEM.get(m.group(1)) in _TOP_LEVEL:
        return NameParts(_KIND_OF_STEM[m.group(1)], None, None)
    return None


def check_slices(model, mlp_slices: int = 1, attn_slices: int = 1) -> None:
    """SpecError unless the MLP hidden neurons and the attention heads split evenly."""
    if mlp_slices < 1 or model.ffn_hidden % mlp_slices:
        raise SpecError(f"model.ffn_hidden ({model.ffn_hidden}) must be divisible by the {mlp_slices} MLP slices")
    if attn_slices < 1 or model.n_heads % attn_slices:
        raise SpecError(f"model.n_heads ({model.n_heads}) must be divisible by the {attn_slices} attention slices")


def _sliced(kind: str, block: int, shape: Tuple[int, int], axis: int, slices: int) -> Iterator[TensorInfo]:
    if slices == 1:
        yield TensorInfo(tensor_name(kind, block), shape, block, kind, None)
        return
    sub = tuple(n // slices if i == axis else n for i, n in enumerate(shape))
    for s in range(slices):
        yield TensorInfo(tensor_name(kind, block, s), sub, block, kind, s)


def _iter_layout(model, mlp_slices: int, attn_slices: int) -> Iterator[TensorInfo]:
    d, f, v, n = model.d_model, model.ffn_hidden, model.vocab_size, model.n_layers
    yield TensorInfo(EMBED_NAME, (v, d), -1, "embed", None)
    for i in range(n):
        yield TensorInfo(tensor_name("attn_norm", i), (d,), i, "attn_norm", None)
        yield from _sliced("qkv", i, (3 * d, d), 0, attn_slices)
        yield from _sliced("attn_out", i, (d, d), 1, attn_slices)
        yield TensorInfo(tensor_name("mlp_norm", i), (d,), i, "mlp_norm", None)
        for kind, shape, axis in (("gate", (f, d), 0), ("up", (f, d), 0), ("down", (d, f), 1)):
            yield from _sliced(kind, i, shape, axis, mlp_slices)
    yield TensorInfo(tensor_name("norm"), (d,), n, "norm", None)
    yield TensorInfo(tensor_name("head"), (v, d), n, "head", None)


def tensor_layout(model, mlp_slices: int = 1, attn_slices: int = 1) -> Dict[str, TensorInfo]:
    """Every trainable tensor of ``model`` (a ModelSpec, or anything with vocab_size, d_model,
    n_layers, ffn_hidden and n_heads), by name, in the model's parameter order."""
    check_slices(model, mlp_slices, attn_slices)
    return {t.name: t for t in _iter_layout(model, mlp_slices, attn_slices)}


def in_block_range(info: TensorInfo, start: int, end: int, n_layers: int) -> bool:
    """Whether a chain stage owning blocks [start, end) holds this tensor: its blocks, plus the
    embedding if it starts at block 0 and the final norm and head if it ends at the last block."""
    if info.block < 0:
        return start == 0
    if info.block >= n_layers:
        return end == n_layers
    return start <= info.block < end


__all__ = [
    "KINDS",
    "RESIDUAL_KINDS",
    "ATTN_KINDS",
    "MLP_KINDS",
    "EMBED_NAME",
    "TensorInfo",
    "NameParts",
    "tensor_name",
    "parse_name",
    "check_slices",
    "tensor_layout",
    "in_block_range",
]
