"""The run's loss history: the record the coordinator keeps in the DHT for its dashboard.

The coordinator samples the swarm once a pass (coordinator/history.py) and keeps a bounded,
downsampled series of points, one per round at most. It stores that series under
``history_key(run_id)``, signed by the run's key like the chain assignments, so a restarted
coordinator reads it back and its chart goes on where it stopped. Readers take only the record
signed by the run's key and parse it strictly here: a record that fails any check is skipped.

The body is columnar (one array per field) to stay far below the envelope's 64 KiB:
``MAX_POINTS`` points of 7 numbers take at most about 32 KB of msgpack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List

import msgpack

from protocol.errors import ProtocolError
from protocol.dht.keys import HISTORY_FIELD
from protocol.dht.records import decode_body

HISTORY_VERSION = 1
MAX_POINTS = 512  # points one series holds (older ones are thinned out: coordinator/history.py)
HISTORY_TTL = 3600.0  # seconds the record lives; the coordinator refreshes it far more often
MAX_COUNT = 1 << 62  # rounds, tokens and bytes above this are not honest counts
MAX_STRIDE = 1 << 40

COLUMNS = ("round", "tokens", "bytes", "peers", "loss", "val_loss", "time")
_INTS = ("round", "tokens", "bytes", "peers")


def history_key(run_id: str) -> str:
    return f"{run_id}_{HISTORY_FIELD}"


@dataclass(frozen=True)
class HistoryPoint:
    """The swarm at one round, as the coordinator saw it."""

    round: int
    tokens: int  # tokens trained by the run's peers so far
    bytes: int  # bytes the peers sent so far
    peers: int  # live peers at that moment
    loss: float  # median training loss of the peers at this round (NaN: none reported one)
    val_loss: float  # median validation loss of the peers at this round (NaN: none reported one)
    time: float  # unix time of the sample


@dataclass
class HistoryRecord:
    spec: str  # the run-spec digest the series belongs to
    stride: int  # rounds between kept points (a power of two; the newest point may fall between)
    points: List[HistoryPoint] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        return {
            "v": HISTORY_VERSION,
            "spec": self.spec,
            "stride": self.stride,
            **{c: [getattr(p, c) for p in self.points] for c in COLUMNS},
        }

    def to_bytes(self) -> bytes:
        return msgpack.packb(self.to_dict(), use_bin_type=True)


def parse_history(value: Any) -> HistoryRecord:
    """A history record from its msgpack body (or map); ProtocolError on anything unexpected."""
    if isinstance(value, (bytes, bytearray)):
        value = decode_body(bytes(value), "history record")
    keys = {"v", "spec", "stride", *COLUMNS}
    if not isinstance(value, dict) or set(value) != keys:
        raise ProtocolError("history record has missing or unknown fields")
    if value["v"] != HISTORY_VERSION:
        raise ProtocolError(f"history record has version {value['v']!r}, not {HISTORY_VERSION}")
    spec, stride = value["spec"], value["stride"]
    if not isinstance(spec, str) or not 0 < len(spec) <= 64:
        raise ProtocolError("history.spec must be a short string")
    if not _is_int(stride) or not 1 <= stride <= MAX_STRIDE or stride & (stride - 1):
        raise ProtocolError("history.stride must be a power of two")
    cols = [value[c] for c in COLUMNS]
    if not all(isinstance(col, list) for col in cols) or len({len(col) for col in cols}) != 1:
        raise ProtocolError("history columns must be lists of one length")
    if len(cols[0]) > MAX_POINTS:
        raise ProtocolError(f"history holds more than {MAX_POINTS} points")
    for name in _INTS:
        if not all(_is_int(v) and 0 <= v <= MAX_COUNT for v in value[name]):
            raise ProtocolError(f"history.{name} must hold non-negative integers")
    for name in ("loss", "val_loss"):
        if not all(_is_float(v) and (math.isnan(v) or 0.0 <= v < 1e6) for v in value[name]):
            raise ProtocolError(f"history.{name} must hold losses (NaN: unknown)")
    if not all(_is_float(v) and 0.0 <= v < 1e11 for v in value["time"]):
        raise ProtocolError("history.time must hold unix times")
    rounds = value["round"]
    if any(b <= a for a, b in zip(rounds, rounds[1:])):
        raise ProtocolError("history rounds must increase")
    points = [HistoryPoint(*(float(v) if c not in _INTS else v for c, v in zip(COLUMNS, row))) for row in zip(*cols)]
    return HistoryRecord(spec=spec, stride=stride, points=points)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_float(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
