"""Pseudo-gradient codecs: dense, SparseLoCo (chunked top-k, 2-bit), DCT."""

from __future__ import annotations

from protocol.codecs.base import TensorCodec
from protocol.codecs.dct import DCTCodec
from protocol.codecs.dense import DenseCodec
from protocol.codecs.sparseloco import SparseLoCoCodec
from protocol.spec import RunSpec

__all__ = ["TensorCodec", "DenseCodec", "SparseLoCoCodec", "DCTCodec", "make_codec"]


def make_codec(spec: RunSpec) -> TensorCodec:
    """The codec a run's outer strategy sends its pseudo-gradients with."""
    outer = spec.outer
    if outer.strategy == "diloco":
        return DenseCodec(outer.dense_dtype)
    if outer.strategy == "sparseloco":
        s = outer.sparseloco
        return SparseLoCoCodec(chunk=s.chunk, topk=s.topk, bits=s.bits)
    if outer.strategy == "dct":
        d = outer.dct
        return DCTCodec(chunk=d.chunk, topk=d.topk, value_dtype=d.value_dtype)
    raise ValueError(f"no codec for outer strategy {outer.strategy!r}")
