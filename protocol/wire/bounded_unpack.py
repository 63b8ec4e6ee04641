"""Decoding msgpack that another peer sent: every length bounded, one error type out.

Payloads (protocol/wire/payload.py), stage frames (protocol/chain/frames.py) and chain records
(protocol/chain/records.py) all arrive from peers that may be hostile. They are decoded with the
same settings: str keys only, no ext types, no string or binary longer than the input itself, and
the caller's bounds on arrays and maps, so a few bytes cannot make the decoder allocate much. Any
failure of msgpack becomes the caller's ``ProtocolError`` subclass, with one line that says why.
"""

from __future__ import annotations

from typing import Any, Type

import msgpack

from protocol.errors import ProtocolError

__all__ = ["bounded_unpack", "cut_short"]


def bounded_unpack(data: bytes, error: Type[ProtocolError], what: str, *, max_array_len: int, max_map_len: int) -> Any:
    """``msgpack.unpackb(data)`` for untrusted bytes; ``error("{what} is not valid msgpack: ...")``
    for anything msgpack rejects (trailing data, a bad format, a limit exceeded, deep nesting)."""
    n = len(data)
    limits = dict(max_str_len=n, max_bin_len=n, max_array_len=max_array_len, max_map_len=max_map_len, max_ext_len=0)
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True, **limits)
    except Exception as e:  # msgpack raises ExtraData, FormatError, StackError, ValueError, TypeError...
        raise error(f"{what} is not valid msgpack: {type(e).__name__}: {e}") from None


def cut_short(data: bytes) -> bool:
    """Whether ``data`` is the start of one msgpack object but not all of it: what a stream that
    closed between two frames leaves (hivemind's stream handlers end with no end marker). False
    for a whole object and for bytes that are not msgpack at all (those fail their own checks).
    Guarded by tests/exchange/test_exchange_bounds.py."""
    n = max(len(data), 1)
    unpacker = msgpack.Unpacker(max_buffer_size=n, max_str_len=n, max_bin_len=n, max_array_len=n, max_map_len=n,
                                max_ext_len=n)
    unpacker.feed(data)
    try:
        unpacker.skip()
    except msgpack.OutOfData:
        return True
    except Exception:  # not msgpack, or past a limit: not a truncation
        return False
    return False
