"""The dense codec: DiLoCo's baseline wire format, every value as little-endian fp32 or fp16.

It is the reference the sparse codecs are measured against (4 bytes per parameter in fp32).
fp16 halves that; values beyond fp16's range are clamped to its largest finite value, so an
encoder never produces a payload its receivers would reject.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Tuple

import numpy as np
import torch

from protocol.codecs.base import Fields, Shape, TensorCodec
from protocol.codecs.fields import check_encodable, check_floats, expect_fields

_WIRE_DTYPES = {"fp32": np.dtype("<f4"), "fp16": np.dtype("<f2")}
_FP16_MAX = 65504.0
_MSGPACK_OVERHEAD = 16  # fixmap header, the "data" key, a bin32 header


class DenseCodec(TensorCodec):
    def __init__(self, dtype: str = "fp32"):
        if dtype not in _WIRE_DTYPES:
            raise ValueError(f"dense dtype must be one of {sorted(_WIRE_DTYPES)}, got {dtype!r}")
        self.dtype = dtype
        self.name = f"dense-{dtype}"
        self._wire = _WIRE_DTYPES[dtype]

    def encode(self, x: torch.Tensor) -> Tuple[Fields, torch.Tensor]:
        check_encodable(x)
        x = x.detach().contiguous()
        if self.dtype == "fp16":  # converted on x's device: round to nearest, as numpy does
            x = x.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16)
        fields = {"data": x.cpu().numpy().astype(self._wire, copy=False).tobytes()}
        return fields, self.decode(fields, tuple(x.shape))

    def decode(self, fields: Mapping[str, Any], shape: Shape) -> torch.Tensor:
        numel = math.prod(shape)
        data = expect_fields(fields, {"data": numel * self._wire.itemsize})["data"]
        values = np.frombuffer(data, dtype=self._wire).astype(np.float32)  # checks are fast in fp32
        check_floats(values, "dense data")
        return torch.from_numpy(values).reshape(shape)

    def max_encoded_bytes(self, shape: Shape) -> int:
        return math.prod(shape) * self._wire.itemsize + _MSGPACK_OVERHEAD
