"""inner.precision: bf16 autocast around forward + loss, fp32 master weights and AdamW state."""

from __future__ import annotations

import pytest
import torch

from peer.training.data import TrainStream, load_corpus
from peer.training.inner import InnerTrainer, autocast_dtype
from peer.training.model import build_model
from protocol.spec import InnerSpec, ModelSpec, RunSpec

SMALL = ModelSpec(d_model=32, n_layers=2, n_heads=2, ffn_hidden=64, seq_len=32)
STEPS = 8


@pytest.fixture(scope="module")
def batches():
    stream = TrainStream(load_corpus("stdlib"), SMALL.seq_len, 4, seed=0, shard="precision")
    return [next(stream) for _ in range(STEPS)]


def _train(precision, batches):
    trainer = InnerTrainer(build_model(SMALL, 0), InnerSpec(warmup_steps=2, total_steps=50, lr=3e-3, precision=precision))
    losses = [trainer.step(x, y) for x, y in batches]
    return trainer, losses


def test_the_spec_field_defaults_to_auto_and_leaves_the_digest_alone():
    spec = RunSpec()
    assert spec.inner.precision == "auto"
    assert "precision" not in spec.to_toml()
    bf16 = spec.replace(inner={"precision": "bf16"})
    assert bf16.digest() != spec.digest() and "precision" in bf16.to_toml()
    assert RunSpec.from_toml(bf16.to_toml()).inner.precision == "bf16"
    assert spec.replace(inner={"precision": "auto"}).digest() == spec.digest()
    with pytest.raises(Exception, match="inner.precision"):
        spec.replace(inner={"precision": "fp16"})


def test_auto_is_fp32_on_the_cpu_and_explicit_values_win():
    assert autocast_dtype("auto", "cpu") is None
    assert autocast_dtype("fp32", "cpu") is None
    assert autocast_dtype("bf16", "cpu") is torch.bfloat16
    assert InnerTrainer(build_model(SMALL, 0), InnerSpec()).precision == "fp32"
    if torch.cuda.is_available():
        native = torch.cuda.get_device_capability()[0] >= 8 or bool(getattr(torch.version, "hip", None))
        assert autocast_dtype("auto", "cuda") is (torch.bfloat16 if native else None)
        assert autocast_dtype("fp32", "cuda") is None


@pytest.mark.parametrize("capability, expected", [((7, 5), None), ((7, 0), None), ((8, 0), torch.bfloat16),
                                                  ((9, 0), torch.bfloat16)])
def test_auto_takes_bf16_only_where_the_gpu_runs_it_natively(monkeypatch, capability, expected):
    """A T4 (7.5) or V100 (7.0) "supports" bf16 by emulation (``is_bf16_supported()`` says yes), slower
    than fp32: "auto" keeps fp32 there; Ampere (8.0) and later train in bf16."""
    import contextlib

    import peer.training.inner as inner_mod
    monkeypatch.setattr(inner_mod.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(inner_mod.torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(inner_mod.torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(inner_mod.torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(inner_mod.torch.version, "hip", None)
    assert autocast_dtype("auto", "cuda:0") is expected
    assert autocast_dtype("bf16", "cuda:0") is torch.bfloat16  # asked for explicitly: as asked


def test_bf16_runs_the_matrix_products_in_bf16_and_the_loss_in_fp32():
    trainer = InnerTrainer(build_model(SMALL, 0), InnerSpec(precision="bf16"))
    seen = []
    trainer.model.head.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    x = torch.randint(0, 256, (2, SMALL.seq_len))
    logits, loss = trainer.forward(x, x)
    assert seen == [torch.bfloat16] and logits.dtype == loss.dtype == torch.float32
    seen.clear()
    InnerTrainer(trainer.model, InnerSpec(precision="fp32")).forward(x, x)
    assert seen == [torch.float32]


def test_bf16_on_the_cpu_trains_near_fp32_with_fp32_weights_and_state(batches):
    fp32, fp32_losses = _train("fp32", batches)
    bf16, bf16_losses = _train("bf16", batches)
    assert bf16.precision == "bf16" and fp32.precision == "fp32"
    # it learns: the loss falls over a few steps
    assert bf16_losses[-1] < bf16_losses[0] - 0.1, bf16_losses
    # and stays near fp32 (bf16 keeps 8 bits of mantissa: a loose tolerance)
    for a, b in zip(fp32_losses, bf16_losses):
        assert abs(a - b) < 0.05 * a, (fp32_losses, bf16_losses)
    for (name, p), q in zip(fp32.model.named_parameters(), bf16.model.parameters()):
        assert q.dtype == torch.float32 and (q.grad is None or q.grad.dtype == torch.float32), name
        assert (p - q).norm() <= 0.05 * p.norm() + 1e-6, name
    for state in bf16.optimizer.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert len(bf16.optimizer.state) == len(bf16.params)


def test_bf16_changes_no_parameter_that_is_frozen(batches):
    model = build_model(SMALL, 0)
    frozen = [n for n, _ in model.named_parameters()][1]
    dict(model.named_parameters())[frozen].requires_grad_(False)
    before = dict(model.named_parameters())[frozen].detach().clone()
    trainer = InnerTrainer(model, InnerSpec(warmup_steps=2, total_steps=50, precision="bf16"))
    for x, y in batches[:2]:
        trainer.step(x, y)
    assert torch.equal(dict(model.named_parameters())[frozen], before)
