"""A role gives its device memory back before the next role is built (peer/training/roles.py
``Role.release_device``): a chain stage that recovers from a broken chain builds its new stage on a GPU
sized for one stage, so the old one's weights, AdamW moments and strategy buffers must be gone first."""

from __future__ import annotations

import pytest
import torch

import peer.training.roles as roles
from peer.training.data import load_corpus
from peer.training.model import build_model
from peer.training.roles import ChainStage, FullReplica
from protocol.spec import RunSpec

SPEC = RunSpec().replace(
    model={"d_model": 16, "n_layers": 1, "n_heads": 2, "ffn_hidden": 32, "seq_len": 8},
    outer={"strategy": "sparseloco", "inner_steps": 2},
    data={"batch_size": 2, "val_batches": 1},
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    text = tmp_path_factory.mktemp("corpus") / "text.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(400)))
    return load_corpus(text, SPEC.data.val_fraction)


def test_release_device_drops_the_optimizer_state_and_gradients_and_keeps_the_buffers_on_the_cpu(corpus):
    role = FullReplica(SPEC, build_model(SPEC.model, SPEC.seed), torch.device("cpu"), corpus, "peer-a")
    for _ in range(2):
        role.inner_step(*role.stream.next_batch())
    for t in role.strategy.buffer.values():
        t.normal_()  # a residual worth keeping
    kept = {n: t.clone() for n, t in role.strategy.buffer.items()}
    assert role.trainer.optimizer.state
    role.release_device()
    assert not role.trainer.optimizer.state
    assert all(p.grad is None for p in role.model.parameters())
    assert all(p.device.type == "cpu" for p in role.model.parameters())
    assert all(torch.equal(role.strategy.buffer[n], kept[n]) and role.strategy.buffer[n].device.type == "cpu" for n in kept)


class _Chain:
    def __init__(self, assigned: bool):
        self.assigned = assigned

    def wait_for_assignment(self):
        return object() if self.assigned else None


@pytest.mark.parametrize("assigned", [True, False])
def test_a_recovering_stage_releases_its_device_before_it_builds_the_next_one(monkeypatch, assigned):
    """Assigned a new chain: the old stage's memory goes first, then the new stage is built. Stopping
    (no assignment): nothing is released, the old role stays whole."""
    calls = []
    old = ChainStage.__new__(ChainStage)
    old.spec, old.chain, old.device = SPEC, _Chain(assigned), torch.device("cpu")
    monkeypatch.setattr(old, "release_device", lambda: calls.append("released"), raising=False)
    monkeypatch.setattr(roles.ChainStage, "__init__", lambda self, *a: calls.append("built"))
    new = old.recover(corpus=None)
    assert calls == (["released", "built"] if assigned else [])
    assert (new is not None) is assigned
