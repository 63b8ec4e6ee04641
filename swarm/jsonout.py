"""Strict JSON for every file and line voloco writes: NaN and ±Infinity become ``null``.

Python's ``json.dumps`` writes ``NaN`` and ``Infinity`` by default, which is not JSON: strict
parsers (JavaScript's ``JSON.parse``, ``jq``, Go, Rust's serde) reject the whole document. A
validation loss that is not known yet (a chain stage before the last, a peer before its first
evaluation) is such a NaN. ``dumps`` here replaces every non-finite float (also inside lists,
tuples, dicts and numpy or torch scalars) with ``None`` and then refuses any that is left
(``allow_nan=False``), so what it writes always parses with a strict parser.
"""

from __future__ import annotations

import json
import math
import os
import threading
from pathlib import Path
from typing import Any

__all__ = ["dumps", "write", "write_atomic", "finite_or_none", "loads_strict"]


def finite_or_none(value: Any) -> Any:
    """``value`` with every NaN or infinite float (at any depth) replaced by ``None``."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    item = getattr(value, "item", None)  # numpy and torch scalars (shape ())
    if callable(item) and tuple(getattr(value, "shape", (0,))) == ():
        try:
            return finite_or_none(item())
        except (TypeError, ValueError, RuntimeError):
            return value
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` of ``value`` as strict JSON (non-finite floats written as ``null``)."""
    kwargs.setdefault("allow_nan", False)
    return json.dumps(finite_or_none(value), **kwargs)


def write(path: Path, value: Any, **kwargs: Any) -> None:
    """Write ``value`` as strict JSON (and a final newline) to ``path``."""
    Path(path).write_text(dumps(value, **kwargs) + "\n")


def write_atomic(path: Path, value: Any, **kwargs: Any) -> None:
    """Like ``write``, through a temporary file and ``os.replace``: readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # one per writer: no race
    tmp.write_text(dumps(value, **kwargs) + "\n")
    os.replace(tmp, path)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"not strict JSON: {name}")


def loads_strict(text: str) -> Any:
    """``json.loads`` that raises ``ValueError`` on ``NaN``, ``Infinity`` and ``-Infinity``."""
    return json.loads(text, parse_constant=_reject_constant)
