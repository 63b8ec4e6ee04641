"""Checks and bit packing shared by the codecs: the trust boundary's building blocks.

Every decoder validates a peer's fields the same way: exactly the expected keys, each a byte
string of exactly the expected length, every float finite and bounded. The bound, ``MAX_ABS`` =
1e8, is far above any real pseudo-gradient (a parameter change of 1e8 means nothing but an attack
or a diverged run) and far below float32's range, so a hostile but finite value cannot overflow
to inf once replicas are summed or squared. It bounds what a payload can do before the median
clipping of peer/outer/robust.py, which bounds it relative to the round's other contributions.
Encoders refuse inputs beyond ``ENCODE_MAX_ABS`` = 1e6, far enough below the decode bound that
everything they derive from those inputs is still accepted by every receiver: a lookup-table entry
is a mean of inputs, a DCT coefficient of a block of at most 64x64 at most 64x its largest entry
(the block's L2 norm), and a truncated inverse DCT is no larger than that norm either.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Union

import numpy as np
import torch

from protocol.errors import PayloadError

MAX_ABS = 1e8  # receivers reject any decoded float at or above this magnitude
ENCODE_MAX_ABS = 1e6  # a pseudo-gradient this large means training diverged


def expect_fields(fields: Any, lengths: Mapping[str, Union[int, range]]) -> Dict[str, bytes]:
    """``fields`` must map exactly the names of ``lengths`` to byte strings of those lengths (a
    ``range``: a length in it, for a field whose exact length its codec checks itself)."""
    if not isinstance(fields, Mapping):
        raise PayloadError(f"fields must be a map, got {type(fields).__name__}")
    if set(fields) != set(lengths):
        raise PayloadError(f"fields must be exactly {sorted(lengths)}, got {sorted(map(str, fields))}")
    out = {}
    for name, length in lengths.items():
        value = fields[name]
        if not isinstance(value, (bytes, bytearray)):
            raise PayloadError(f"field {name!r} must be bytes, got {type(value).__name__}")
        if isinstance(length, range) and len(value) not in length:
            raise PayloadError(f"field {name!r} must be {length.start} to {length.stop - 1} bytes, got {len(value)}")
        if isinstance(length, int) and len(value) != length:
            raise PayloadError(f"field {name!r} must be {length} bytes, got {len(value)}")
        out[name] = bytes(value)
    return out


def check_floats(values: np.ndarray, what: str) -> None:
    """Every value finite and below MAX_ABS in magnitude (NaN fails both comparisons)."""
    if values.size and not (-MAX_ABS < float(values.min()) and float(values.max()) < MAX_ABS):
        if not np.isfinite(values).all():
            raise PayloadError(f"{what} holds a non-finite value")
        peak = float(np.abs(values).max())
        raise PayloadError(f"{what} holds a value of magnitude {peak:.3g}, at or above the bound {MAX_ABS:g}: "
                           "no pseudo-gradient is that large")


def check_encodable(x: torch.Tensor) -> None:
    """Encoders take finite float32 tensors below ENCODE_MAX_ABS; anything else is a local bug."""
    if x.dtype != torch.float32:
        raise TypeError(f"codecs encode float32 tensors, got {x.dtype}")
    if x.numel():
        # NaN propagates, and fails the comparisons below; one copy to the host (on a GPU, one sync)
        lo, hi = torch.stack(torch.aminmax(x.detach())).tolist()
        if not (-ENCODE_MAX_ABS <= lo and hi <= ENCODE_MAX_ABS):
            raise ValueError(f"cannot encode a tensor with non-finite values or magnitudes above {ENCODE_MAX_ABS:g}")


def packed_len(count: int, bits: int) -> int:
    return (count * bits + 7) // 8


def pack_bits(values: np.ndarray, bits: int) -> bytes:
    """Unsigned integers < 2**bits, densely packed little-endian (two 12-bit values in 3 bytes)."""
    values = values.reshape(-1).astype(np.uint16)
    bitmat = np.empty((values.size, bits), dtype=np.uint8)
    for b in range(bits):
        bitmat[:, b] = (values >> b) & 1
    return np.packbits(bitmat.reshape(-1), bitorder="little").tobytes()


def pack_bits_tensor(values: torch.Tensor, bits: int) -> bytes:
    """``pack_bits`` computed on the tensor's own device (CPU or GPU): the same bytes, bit for bit
    (integer arithmetic only); just the packed bytes are copied to the CPU."""
    values = values.reshape(-1).to(torch.int64)
    shifts = torch.arange(bits, device=values.device, dtype=torch.int64)
    bitmat = ((values[:, None] >> shifts) & 1).reshape(-1)
    pad = (-bitmat.numel()) % 8
    if pad:
        bitmat = torch.cat([bitmat, bitmat.new_zeros(pad)])
    weights = torch.arange(8, device=values.device, dtype=torch.int64)
    packed = (bitmat.reshape(-1, 8) << weights).sum(dim=1).to(torch.uint8)
    return packed.cpu().numpy().tobytes()


def unpack_bits(data: bytes, count: int, bits: int, what: str) -> np.ndarray:
    """The inverse of ``pack_bits``: ``count`` values as int64; the padding bits must be zero."""
    raw = np.frombuffer(data, dtype=np.uint8)
    used = (count * bits) % 8
    if used and raw[-1] >> used:
        raise PayloadError(f"{what} has non-zero padding bits")
    bitmat = np.unpackbits(raw, count=count * bits, bitorder="little").reshape(count, bits)
    out = np.zeros(count, dtype=np.int64)
    for b in range(bits):
        out |= bitmat[:, b].astype(np.int64) << b
    return out
