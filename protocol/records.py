"""Schemas of the records peers put in the DHT, validated on read.

A record from the DHT is untrusted: any peer can write under a run's keys. Readers call
``parse_progress`` and skip what fails, so one malformed record never breaks a peer or the
coordinator's view of the swarm.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict

from protocol.errors import ProtocolError

CHOOSING = -2  # `part` of a peer that has not chosen its slice yet (-1: a full replica)
STATES = ("starting", "waiting", "training", "ready", "exchanging", "syncing", "stopped")
# waiting: started, holding its first round until enough peers have started (``--wait-peers``)


@dataclass(frozen=True)
class Progress:
    """A peer's heartbeat: where it is in the run and what it has done so far."""

    round: int  # the round this peer is training for (its parameters are those after round-1)
    step: int  # inner steps done in this round
    state: str  # one of STATES
    spec: str  # the run-spec digest the peer trains with
    loss: float  # last training loss (nats per byte)
    val_loss: float  # last validation loss, NaN before the first evaluation
    tokens: int  # tokens this peer trained on since it started
    tokens_per_s: float
    bytes_sent: int  # exchange + state-download bytes, counted at the stream level
    bytes_received: int
    params_hash: str  # sha256 prefix of the parameters at the start of `round`
    part: int = CHOOSING  # -1: full replica; s >= 0: the slice it owns (partial updates)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


_TYPES = {f.name: f.type for f in fields(Progress)}


def parse_progress(value: Any) -> Progress:
    """Validate a progress record read from the DHT; ProtocolError on anything unexpected."""
    if not isinstance(value, dict) or set(value) != set(_TYPES):
        raise ProtocolError("progress record has missing or unknown fields")
    for name, kind in _TYPES.items():
        v = value[name]
        if kind == "int" and (isinstance(v, bool) or not isinstance(v, int) or (v < 0 and name != "part")):
            raise ProtocolError(f"progress.{name} must be a non-negative integer")
        if kind == "float" and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ProtocolError(f"progress.{name} must be a number")
        if kind == "str" and (not isinstance(v, str) or len(v) > 64):
            raise ProtocolError(f"progress.{name} must be a short string")
    if not CHOOSING <= value["part"] < 1 << 16:
        raise ProtocolError("progress.part is out of range")
    if value["state"] not in STATES:
        raise ProtocolError(f"progress.state must be one of {STATES}")
    if not math.isfinite(value["loss"]) and not math.isnan(value["loss"]):
        raise ProtocolError("progress.loss must be finite or NaN")
    return Progress(**{k: (float(v) if _TYPES[k] == "float" else v) for k, v in value.items()})
