"""The interface every pseudo-gradient codec implements.

A codec turns one float32 tensor into a small msgpack-able dict of fields, and back. It is pure
(torch arithmetic only, no I/O) and its decoder is the trust boundary: it must raise
PayloadError, and nothing else, for any fields a hostile peer could send.

Decoding must be bit-reproducible on every machine, CPU or GPU: only element-wise arithmetic in a
fixed order, no matmul or reductions whose summation order a BLAS library may choose. Replicas
stay bit-identical only because every member decodes the same bytes to the same floats.
"""

from __future__ import annotations

import abc
from typing import Any, Dict, Mapping, Tuple

import torch

Fields = Dict[str, Any]  # msgpack-able: bytes, int, float, str, lists of those
Shape = Tuple[int, ...]


class TensorCodec(abc.ABC):
    name: str

    @abc.abstractmethod
    def encode(self, x: torch.Tensor) -> Tuple[Fields, torch.Tensor]:
        """Encode a float32 CPU tensor.

        Returns ``(fields, sent)``: ``sent`` is the dense float32 tensor, of x's shape, that every
        receiver will decode from ``fields``, bit for bit (error feedback subtracts exactly it).
        """

    @abc.abstractmethod
    def decode(self, fields: Mapping[str, Any], shape: Shape) -> torch.Tensor:
        """Rebuild the dense float32 tensor of ``shape``; PayloadError on any invalid field."""

    @abc.abstractmethod
    def max_encoded_bytes(self, shape: Shape) -> int:
        """An upper bound of len(msgpack.packb(fields)) for a tensor of this shape."""
