"""Evaluate a round's θ without touching the model the inner steps train.

With overlap (peer/round/loop.py) the inner steps of the next round are under way while a round is
evaluated, so the evaluation runs on a model of its own: a copy of the role's model (the same
architecture and buffers, on the role's device), made in the inner loop's thread between two
rounds, θ copied in, the validation batches run in the role's precision. It costs one more copy of
the weights, and takes no time from the inner loop but what it shares of the device.

The copy is not built from the run's seed: its values are overwritten by θ at once, and the exact
initialisation took 25 of 35 s at the 125m preset on a 2-core CPU (minutes at 1.3b), in the
exchange's thread, which the next round's end waits for
(tests/training/test_evaluator.py::test_the_evaluation_model_is_a_copy_not_a_second_initialisation).
"""

from __future__ import annotations

import copy
import math
from typing import Callable, Iterable, Optional

import torch

from peer.training.inner import evaluate


class RoundEvaluator:
    """``engine``: the round engine (its ``lock`` and ``theta``); ``per_byte``: nats per token to nats per
    byte (the corpus'); ``val``: the validation batches."""

    def __init__(self, engine, per_byte: Callable[[float], float], val: Iterable):
        self._engine, self._per_byte, self._val = engine, per_byte, val
        self._model: Optional[torch.nn.Module] = None
        self._role = None

    def prepare(self, role) -> None:
        """Copy ``role``'s model for the evaluations to come, once per role; call it where the inner
        steps do not run (between two rounds, in their thread)."""
        if role is not self._role:
            self._role = role
            self._model = copy.deepcopy(role.model).requires_grad_(False) if role.reports_loss else None

    def evaluate(self) -> float:
        """The validation loss of the engine's θ, in nats per byte (NaN if the role cannot evaluate)."""
        if self._model is None:  # nothing prepared, or a role that reports no loss
            return math.nan
        with self._engine.lock, torch.no_grad():
            theta = self._engine.theta
            for name, p in self._model.named_parameters():
                p.copy_(theta[name].to(p.device, p.dtype))
        return self._per_byte(evaluate(self._model, self._val, self._role.device, self._role.trainer.autocast_dtype))
