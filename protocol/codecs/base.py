"""The interface every pseudo-gradient codec implements.

A codec turns one float32 tensor into a small msgpack-able dict of fields, and back. It is pure
(torch arithmetic only, no I/O) and its decoder is the trust boundary: it must raise
PayloadError, and nothing else, for any fields a hostile peer could send.

Decoding must be bit-reproducible on every machine, CPU or GPU: only element-wise arithmetic in a
fixed order, no matmul or reductions whose summation order a BLAS library may choose. Replicas
stay bit-identical only because every member decodes the same bytes to the same floats.

Encoding is device-generic: ``encode`` runs its tensor math (top-k, quantization, the DCT) on
whatever device ``x`` lives on, a peer's GPU included, and copies only the packed fields to the
CPU. Bit-identity across members does not depend on the encoder at all: ``decode`` runs on the
CPU, in float32, from the field bytes alone, and so does everything after it (aggregation and
the outer step, peer/outer/strategies.py). A sender's hardware can change which values it sends (a tie
in top-k, the last bit of a quantizer's bin mean), never how the members combine what was sent;
and ``sent``, what the sender's error feedback subtracts, is itself decoded from its own bytes.
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
        """Encode a float32 tensor, on its own device (CPU or GPU).

        Returns ``(fields, sent)``: ``sent`` is the dense float32 tensor, of x's shape, that every
        receiver will decode from ``fields``, bit for bit (error feedback subtracts exactly it); it
        is decoded from the fields, so it is a CPU tensor whatever ``x``'s device.
        """

    @abc.abstractmethod
    def decode(self, fields: Mapping[str, Any], shape: Shape) -> torch.Tensor:
        """Rebuild the dense float32 tensor of ``shape``; PayloadError on any invalid field."""

    @abc.abstractmethod
    def max_encoded_bytes(self, shape: Shape) -> int:
        """An upper bound of len(msgpack.packb(fields)) for a tensor of this shape."""
