"""Decoding msgpack that another peer sent: every length bounded, one error type out.

Payloads (protocol/wire/payload.py), stage frames (protocol/chain/frames.py) and chain records
(protocol/chain/records.py) all arrive from peers that may be hostile. They are decoded with the
same settings: str keys only, no ext types, no string or binary longer than the input itself, and
the caller's bounds on arrays and maps, so a few bytes cannot make the decoder allocate much, and
no nesting deeper than ``MAX_DEPTH``: msgpack itself accepts about 1,000 levels, and Python's ``repr``
of a list nested that deep raises ``RecursionError`` (an error message quoting a hostile value would
then raise in place of the error, on some machines and not others, as the stack allows). Any failure
of msgpack becomes the caller's ``ProtocolError`` subclass, with one line that says why.
``packed_nesting`` measures the same in bytes about to be decoded by hivemind's serializer, which
packs a tuple as an extension type holding msgpack and decodes it recursively through C: about 200
tuples deep crash the process (a segmentation fault). Guarded by tests/protocol/test_deep_nesting.py.
"""

from __future__ import annotations

from typing import Any, Type

import msgpack

from protocol.errors import ProtocolError

__all__ = ["MAX_DEPTH", "bounded_unpack", "cut_short", "nesting", "packed_nesting"]

# lists and maps inside one another: the deepest message voloco sends nests 4; 16 leaves room to grow
MAX_DEPTH = 16


def bounded_unpack(data: bytes, error: Type[ProtocolError], what: str, *, max_array_len: int, max_map_len: int) -> Any:
    """``msgpack.unpackb(data)`` for untrusted bytes; ``error("{what} is not valid msgpack: ...")``
    for anything msgpack rejects (trailing data, a bad format, a limit exceeded, deep nesting)."""
    n = len(data)
    limits = dict(max_str_len=n, max_bin_len=n, max_array_len=max_array_len, max_map_len=max_map_len, max_ext_len=0)
    try:
        value = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True, **limits)
    except Exception as e:  # msgpack raises ExtraData, FormatError, StackError, ValueError, TypeError...
        raise error(f"{what} is not valid msgpack: {type(e).__name__}: {e}") from None
    if nesting(value) > MAX_DEPTH:
        raise error(f"{what} nests lists or maps more than {MAX_DEPTH} deep")
    return value


def nesting(value: Any) -> int:
    """How deep lists, tuples and maps nest in ``value`` (a scalar: 0, ``[1]``: 1, ``[(1,)]``: 2),
    without recursion; stops counting once past ``MAX_DEPTH``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            v = list(v.keys()) + list(v.values())
        if not isinstance(v, (list, tuple)):
            continue
        deepest = max(deepest, depth)
        if depth > MAX_DEPTH:
            break
        stack.extend((x, depth + 1) for x in v if isinstance(x, (list, tuple, dict)))
    return deepest


def packed_nesting(data: bytes) -> int:
    """``nesting`` of the value msgpack ``data`` holds, extension types counted as a level and their
    payloads read as msgpack too (hivemind's tuples and DHT values), decoded level by level and never
    recursively; stops counting once past ``MAX_DEPTH``. Bytes that are no msgpack count 0 (the
    decoder that follows refuses them)."""
    deepest, pending = 0, [(bytes(data), 0)]
    while pending and deepest <= MAX_DEPTH:
        raw, base = pending.pop()
        try:
            value = msgpack.unpackb(raw, raw=False, strict_map_key=False)  # extensions stay ExtType
        except Exception:
            continue
        stack = [(value, base)]
        while stack and deepest <= MAX_DEPTH:
            v, depth = stack.pop()
            if isinstance(v, msgpack.ExtType):
                deepest = max(deepest, depth + 1)
                pending.append((v.data, depth + 1))
                continue
            if isinstance(v, dict):
                v = list(v.keys()) + list(v.values())
            if not isinstance(v, list):
                continue
            deepest = max(deepest, depth + 1)
            stack.extend((x, depth + 1) for x in v if isinstance(x, (list, dict, msgpack.ExtType)))
    return deepest


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
