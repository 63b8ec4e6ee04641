"""Decoding msgpack that another peer sent: every length bounded, one error type out.

Payloads (protocol/payload.py), stage frames (protocol/chain/frames.py) and chain records
(protocol/chain/records.py) all arrive from peers that may be hostile. They are decoded with the
same settings: str keys only, no ext types, no string or binary longer than the input itself, and
the caller's bounds on arrays and maps, so a few bytes cannot make the decoder allocate much. Any
failure of msgpack becomes the caller's ``ProtocolError`` subclass, with one line that says why.
"""

from __future__ import annotations

from typing import Any, Type

import msgpack

from protocol.errors import ProtocolError

__all__ = ["bounded_unpack"]


def bounded_unpack(data: bytes, error: Type[ProtocolError], what: str, *, max_array_len: int, max_map_len: int) -> Any:
    """``msgpack.unpackb(data)`` for untrusted bytes; ``error("{what} is not valid msgpack: ...")``
    for anything msgpack rejects (trailing data, a bad format, a limit exceeded, deep nesting)."""
    n = len(data)
    limits = dict(max_str_len=n, max_bin_len=n, max_array_len=max_array_len, max_map_len=max_map_len, max_ext_len=0)
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True, **limits)
    except Exception as e:  # msgpack raises ExtraData, FormatError, StackError, ValueError, TypeError...
        raise error(f"{what} is not valid msgpack: {type(e).__name__}: {e}") from None
