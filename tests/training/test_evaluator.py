"""peer/training/evaluator.py: an overlapped peer evaluates θ on a copy of its role's model."""

from __future__ import annotations

import math
import threading

import pytest
import torch

import peer.training.model as model_mod
from peer.round.handoff import continue_from
from peer.training.data import load_corpus, val_batches
from peer.training.evaluator import RoundEvaluator
from peer.training.model import build_model
from peer.training.roles import FullReplica, SliceOwner
from protocol.spec import RunSpec

SPEC = RunSpec().replace(
    model={"d_model": 16, "n_layers": 1, "n_heads": 2, "ffn_hidden": 32, "seq_len": 8},
    outer={"strategy": "sparseloco", "inner_steps": 2},
    data={"batch_size": 2, "val_batches": 2},
)


class _Engine:
    def __init__(self, theta):
        self.lock, self.theta = threading.Lock(), theta


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    text = tmp_path_factory.mktemp("corpus") / "text.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(400)))
    return load_corpus(text, SPEC.data.val_fraction)


def test_the_evaluation_model_is_a_copy_not_a_second_initialisation(corpus, monkeypatch):
    """The copy is made from the role's model, never from the seed (the exact initialisation took 25 s
    at 125m in the exchange's thread), and evaluates θ bit for bit as the role itself would."""
    role = FullReplica(SPEC, build_model(SPEC.model, SPEC.seed), torch.device("cpu"), corpus, "peer-a")
    for _ in range(2):
        role.inner_step(*role.stream.next_batch())
    theta = {n: torch.randn_like(p) * 0.02 for n, p in role.params.items()}  # not the model's values
    val = val_batches(corpus, SPEC.model.seq_len, SPEC.data.batch_size, SPEC.data.val_batches)

    def no_init(*args, **kwargs):
        raise AssertionError("the evaluator initialised a model from the seed")

    monkeypatch.setattr(model_mod, "init_parameters", no_init)
    monkeypatch.setattr(model_mod, "build_model", no_init)
    evaluator = RoundEvaluator(_Engine(theta), corpus.per_byte, val)
    assert math.isnan(evaluator.evaluate())  # nothing prepared yet
    evaluator.prepare(role)
    got = evaluator.evaluate()
    with torch.no_grad():
        for n, p in role.params.items():
            p.copy_(theta[n])
    assert got == corpus.per_byte(role.evaluate(val))
    assert not any(p.requires_grad for p in evaluator._model.parameters())
    copy_before = evaluator._model
    evaluator.prepare(role)
    assert evaluator._model is copy_before  # once per role


def test_a_slice_owners_snapshot_skips_its_frozen_slices_and_still_continues_from_theta(corpus):
    """A partial peer's θ_send holds only the part it sends; continue_from sets its frozen slices to θ
    (tests/system/test_swarm.py::test_partial_run_with_two_slices_and_four_peers runs
    overlapped slice owners as processes)."""
    spec = SPEC.replace(partial={"slices": 2})
    role = SliceOwner(spec, 0, build_model(spec.model, spec.seed, spec.partial.slices, spec.partial.attn_slices),
                      torch.device("cpu"), corpus, "peer-a")
    layout = role.strategy.layout
    frozen = [n for n, p in role.params.items() if not p.requires_grad]
    assert frozen and not set(frozen) & set(layout)
    sent = {n: p.detach().clone() for n, p in role.params.items() if n in layout}
    role.inner_step(*role.stream.next_batch())
    trained = {n: p.detach().clone() for n, p in role.params.items()}
    theta = {n: torch.randn_like(p) for n, p in role.params.items()}
    continue_from(role.params, theta, sent)
    for n, p in role.params.items():
        want = theta[n] + (trained[n] - sent[n]) if n in sent else theta[n]
        assert torch.equal(p, want), n
