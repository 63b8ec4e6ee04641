"""Evaluate a round's θ without touching the model the inner steps train.

With overlap (peer/round/loop.py) the inner steps of the next round are under way while a round is
evaluated, so the evaluation runs on a model of its own: built once (the same architecture, on the
role's device), θ copied in, the validation batches run. It costs one more copy of the weights,
and takes no time from the inner loop but what it shares of the device.
"""

from __future__ import annotations

import torch

from peer.training.inner import evaluate
from peer.training.model import build_model


class RoundEvaluator:
    def __init__(self, peer):
        self.peer = peer
        self._model = None

    def evaluate(self) -> float:
        """The validation loss of the engine's θ, in nats per byte (NaN if the role cannot evaluate)."""
        peer = self.peer
        if not peer.role.reports_loss:
            return float("nan")
        device = peer.role.device
        if self._model is None:
            spec = peer.spec
            self._model = build_model(spec.model, spec.seed, spec.partial.slices, spec.partial.attn_slices).to(device)
            self._model.requires_grad_(False)
        params = dict(self._model.named_parameters())
        with peer.engine.lock, torch.no_grad():
            for name, p in params.items():
                p.copy_(peer.engine.theta[name].to(device, p.dtype))
        with torch.no_grad():
            return peer.corpus.per_byte(evaluate(self._model, peer.val, device))
