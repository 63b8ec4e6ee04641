"""The payload: everything one peer sends in one round, as a single msgpack map.

    {"v": PROTOCOL_VERSION, "run": run digest, "round": int, "codec": codec name,
     "part": -1 for the full model or the slice a partial peer owns,
     "steps": the inner steps the update covers (H, or fewer where its round closed early),
     "t": [[tensor name, codec fields], ...]}

Tensors appear in the order of the layout both sides agree on (the spec's parameter shapes, or
the subset a peer owns under partial updates), so a receiver checks the names against the layout
instead of trusting them. ``decode_payload`` is a trust boundary: for any bytes whatsoever it
returns tensors of exactly the layout's shapes or raises PayloadError.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import msgpack
import torch

from protocol import PROTOCOL_VERSION
from protocol.wire.bounded_unpack import bounded_unpack
from protocol.codecs.base import Shape, TensorCodec
from protocol.errors import PayloadError

_HEADER_SLACK = 256  # the map header, its short keys, the version, run digest, round, steps and codec name
_PER_TENSOR_SLACK = 16  # each entry's array header and its name's str header
_KEYS = {"v", "run", "round", "codec", "part", "steps", "t"}


def payload_max_bytes(codec: TensorCodec, layout: Mapping[str, Shape]) -> int:
    """An upper bound of the encoded size of a payload for ``layout``."""
    return _HEADER_SLACK + sum(
        _PER_TENSOR_SLACK + len(name.encode()) + codec.max_encoded_bytes(tuple(shape)) for name, shape in layout.items()
    )


def encode_payload(
    codec: TensorCodec, tensors: Mapping[str, torch.Tensor], *, run_digest: str, round: int, steps: int, part: "Part" = -1
) -> Tuple[bytes, Dict[str, torch.Tensor]]:
    """Encode ``tensors`` in their mapping order; returns the bytes and what each receiver decodes.
    ``steps``: the inner steps the update covers (what the clip compares norms at, peer/outer/robust.py)."""
    if type(steps) is not int or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    entries: List[list] = []
    sent: Dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        fields, sent[name] = codec.encode(tensor)
        entries.append([name, fields])
    message = {"v": PROTOCOL_VERSION, "run": run_digest, "round": round, "codec": codec.name, "part": part, "steps": steps,
               "t": entries}
    return msgpack.packb(message, use_bin_type=True), sent


def decode_payload(
    data: bytes,
    codec: TensorCodec,
    layout: Mapping[str, Shape],
    *,
    run_digest: str,
    round: int,
    max_bytes: Optional[int] = None,
) -> Dict[str, torch.Tensor]:
    """Validate a peer's payload against the run, round, codec and layout; decode every tensor."""
    message = _unpack(data, payload_max_bytes(codec, layout) if max_bytes is None else max_bytes)
    _check_header(message, codec, run_digest, round)
    _steps(message, None)
    return _decode_entries(message, codec, layout)


Part = Union[int, Tuple[int, int]]  # a slice index (-1: full model), or a chain stage's block range


def decode_claimed_payload(
    data: bytes,
    codec: TensorCodec,
    layouts: Callable[[Part], Optional[Mapping[str, Shape]]],
    *,
    run_digest: str,
    round: int,
    max_bytes: int,
    max_steps: Optional[int] = None,
) -> Tuple[Part, int, Dict[str, torch.Tensor]]:
    """Like decode_payload, for a run whose peers send different parts of the model: the header's
    ``part`` (a slice index, or a [start, end) block range for a chain stage) is resolved by
    ``layouts`` to the layout the tensors must match exactly (None: no such part); with the inner
    steps the payload claims its update covers, an int from 1 to ``max_steps`` (the run's H; None:
    any) (tests/protocol/test_payload.py::test_the_steps_a_payload_claims_are_checked). Returns
    (part, steps, tensors)."""
    message = _unpack(data, max_bytes)
    _check_header(message, codec, run_digest, round)
    steps = _steps(message, max_steps)
    part, layout = _part(message["part"], layouts)
    return part, steps, _decode_entries(message, codec, layout)


def payload_part(
    data: bytes,
    codec: TensorCodec,
    layouts: Callable[[Part], Optional[Mapping[str, Shape]]],
    *,
    run_digest: str,
    round: int,
    max_bytes: int,
) -> Part:
    """The part a payload claims, its header checked as ``decode_claimed_payload`` checks it, without
    unpacking its tensors (their bytes are skipped): what the choice of a round's contributions
    reads (protocol/round/choice.py). The tensors are checked when the payload is decoded."""
    header = _header(data, max_bytes)
    _check_header(header, codec, run_digest, round)
    _steps(header, None)
    return _part(header["part"], layouts)[0]


def claimed_part(data: bytes, max_bytes: Optional[int] = None) -> Optional[Part]:
    """The part a payload's header names (a slice index, or a chain stage's (start, end)), read as
    ``payload_part`` reads it but checked against nothing else; None for bytes with no such header.
    What a set's list of its payloads records (protocol/round/set_manifests.py), so that the choice of
    a round's contributions can be drawn before a payload is fetched; the payload fetched later must
    claim the same part."""
    try:
        part = _header(data, len(data) if max_bytes is None else max_bytes)["part"]
    except (PayloadError, TypeError):
        return None
    if type(part) is list and len(part) == 2 and all(type(p) is int for p in part):
        return (part[0], part[1])
    return part if type(part) is int else None


def _header(data: bytes, max_bytes: int) -> Dict[str, Any]:
    """The header fields of a payload (its tensors skipped, "t" None), with exactly the payload's keys."""
    if not isinstance(data, (bytes, bytearray)):
        raise PayloadError(f"payload must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise PayloadError(f"payload of {len(data)} bytes exceeds the limit of {max_bytes}")
    n = len(data)
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=max(n, 1), max_str_len=n,
                                max_bin_len=n, max_array_len=n, max_map_len=n // 2, max_ext_len=0)
    unpacker.feed(data)
    header: Dict[str, Any] = {}
    try:
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key == "t":
                unpacker.skip()
                header[key] = None
            else:
                header[key] = unpacker.unpack()
    except Exception as e:  # OutOfData, a bad format, a limit, an unhashable key...
        raise PayloadError(f"payload is not valid msgpack: {type(e).__name__}: {e}") from None
    if set(header) != _KEYS:
        raise PayloadError(f"payload must be a map with exactly the keys {sorted(_KEYS)}")
    return header


def _part(part: Any, layouts: Callable[[Part], Optional[Mapping[str, Shape]]]) -> Tuple[Part, Mapping[str, Shape]]:
    if type(part) is list and len(part) == 2 and all(type(p) is int for p in part):
        part = (part[0], part[1])
    elif type(part) is not int:
        raise PayloadError(f"payload part {part!r:.40} is neither a slice index nor a [start, end] block range")
    layout = layouts(part)
    if layout is None:
        raise PayloadError(f"payload part {part!r:.40} is not a part of this run")
    return part, layout


def _decode_entries(message: Dict[str, Any], codec: TensorCodec, layout: Mapping[str, Shape]) -> Dict[str, torch.Tensor]:
    entries = _entries(message["t"], list(layout))
    out: Dict[str, torch.Tensor] = {}
    for name, fields in entries:
        try:
            out[name] = codec.decode(fields, tuple(layout[name]))
        except PayloadError as e:
            raise PayloadError(f"tensor {name!r}: {e}") from None
    return out


def _unpack(data: Any, max_bytes: int) -> Dict[str, Any]:
    if not isinstance(data, (bytes, bytearray)):
        raise PayloadError(f"payload must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise PayloadError(f"payload of {len(data)} bytes exceeds the limit of {max_bytes}")
    n = len(data)
    message = bounded_unpack(data, PayloadError, "payload", max_array_len=n, max_map_len=n // 2)
    if not isinstance(message, dict) or set(message) != _KEYS:
        raise PayloadError(f"payload must be a map with exactly the keys {sorted(_KEYS)}")
    return message


def _check_header(message: Dict[str, Any], codec: TensorCodec, run_digest: str, round: int) -> None:
    version = message["v"]
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise PayloadError(f"payload protocol version {version!r:.40} is not {PROTOCOL_VERSION}")
    if message["run"] != run_digest:
        raise PayloadError(f"payload is for run {message['run']!r:.40}, not {run_digest!r}")
    if type(message["round"]) is not int or message["round"] != round:
        raise PayloadError(f"payload is for round {message['round']!r:.40}, not {round}")
    if message["codec"] != codec.name:
        raise PayloadError(f"payload uses codec {message['codec']!r:.40}, not {codec.name!r}")


def _steps(message: Dict[str, Any], max_steps: Optional[int]) -> int:
    """The inner steps a payload claims: an int from 1 to ``max_steps`` (None: no upper bound)."""
    steps = message["steps"]
    if type(steps) is not int or steps < 1 or (max_steps is not None and steps > max_steps):
        bound = "" if max_steps is None else f" to the run's {max_steps}"
        raise PayloadError(f"payload claims {steps!r:.40} inner steps, not a count from 1{bound}")
    return steps


def _entries(entries: Any, expected: List[str]) -> List[Tuple[str, Any]]:
    """[[name, fields], ...] whose names are exactly ``expected``, in its order."""
    if not isinstance(entries, list):
        raise PayloadError("payload 't' must be a list of [name, fields] pairs")
    pairs = []
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)):
            raise PayloadError("every payload tensor entry must be a [name, fields] pair")
        pairs.append((entry[0], entry[1]))
    names = [name for name, _ in pairs]
    if names != expected:
        raise PayloadError(f"payload tensors do not match the layout: {_name_mismatch(names, expected)}")
    return pairs


def _name_mismatch(names: List[str], expected: List[str]) -> str:
    got, want = set(names), set(expected)
    seen: set = set()
    duplicated = sorted({n for n in names if n in seen or seen.add(n)})
    problems = {
        "missing": [n for n in expected if n not in got],
        "extra": [n for n in names if n not in want],
        "duplicated": duplicated,
    }
    parts = [f"{label} {items[:5]}" for label, items in problems.items() if items]
    return "; ".join(parts) or "names are out of order"
