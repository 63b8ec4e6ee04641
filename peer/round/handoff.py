"""What passes between a round's inner steps and its exchange, and how an overlapped round lands.

``Handoff`` is what the inner steps of a round hand to its exchange (in the loop's thread, or with
overlap in the exchange's own). ``continue_from`` is the one-step-delayed outer update: the model
continues from the new θ plus the steps taken while the exchange was in flight (docs/round.md,
"Overlap"; tests/outer/test_overlap.py). Used by peer/round/loop.py and peer/round/simulate.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

__all__ = ["Handoff", "continue_from"]


def continue_from(params: Dict[str, torch.Tensor], theta: Dict[str, torch.Tensor], sent: Dict[str, torch.Tensor]) -> None:
    """The one-step-delayed update, in place: ``params ← θ + (params − θ_send)``. With no step
    taken since ``sent`` the model is θ exactly, as in the sequential loop."""
    with torch.no_grad():
        for name, param in params.items():
            param.sub_(sent[name]).add_(theta[name].to(param.device, param.dtype))


@dataclass
class Handoff:
    """What the inner steps of a round hand to its exchange."""

    payload: Optional[bytes]  # None until encoded (with overlap, in the exchange's thread)
    pending: Any
    losses: List[float]
    t0: float  # when the round's inner steps began
    t_train: float  # when they ended
    t_encode: float  # when the payload was ready
    # the training state to checkpoint (checkpoints.trainer_snapshot), taken when the inner steps ended;
    # with overlap, None when no checkpoint is due this round (peer/checkpoints/writer.py)
    trainer: Optional[Dict[str, Any]] = None
    overlapped: int = 0  # inner steps taken while the previous round's exchange was in flight
    cpu0: float = 0.0  # time.thread_time() of the exchange's thread when its work began (the encode)
