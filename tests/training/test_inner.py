import copy
import os
import time

import pytest
import torch

from peer.training.data import TrainStream, load_corpus, val_batches
from peer.training.inner import InnerTrainer, evaluate
from peer.training.model import build_model
from protocol.spec import InnerSpec, ModelSpec

SMALL = ModelSpec(d_model=32, n_layers=2, n_heads=2, ffn_hidden=64, seq_len=32)
INNER = InnerSpec(warmup_steps=3, total_steps=50)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus("stdlib")


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _batches(corpus, n, seq_len=32, batch=4, shard="a"):
    stream = TrainStream(corpus, seq_len, batch, seed=0, shard=shard)
    return [next(stream) for _ in range(n)]


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_step_counter_and_schedule(corpus):
    trainer = InnerTrainer(build_model(SMALL, 0), INNER)
    for i, (x, y) in enumerate(_batches(corpus, 6)):
        assert trainer.step_count == i and trainer.lr == INNER.lr_at(i)
        loss = trainer.step(x, y)
        assert isinstance(loss, float) and loss > 0
        assert all(g["lr"] == INNER.lr_at(i) for g in trainer.optimizer.param_groups)
    assert trainer.step_count == 6


def test_weight_decay_only_on_matrices():
    trainer = InnerTrainer(build_model(SMALL, 0), INNER)
    decay, no_decay = trainer.optimizer.param_groups
    assert decay["weight_decay"] == INNER.weight_decay and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert trainer.optimizer.defaults["betas"] == (INNER.beta1, INNER.beta2)


def test_state_dict_resume_is_exact(corpus):
    batches = _batches(corpus, 8)
    a = InnerTrainer(build_model(SMALL, 0), INNER)
    for x, y in batches[:5]:
        a.step(x, y)
    state = copy.deepcopy(a.state_dict())
    params = copy.deepcopy(a.model.state_dict())

    b = InnerTrainer(build_model(SMALL, 1), INNER)
    b.model.load_state_dict(params)
    b.load_state_dict(state)
    assert b.step_count == 5 and b.lr == a.lr
    for x, y in batches[5:]:
        assert a.step(x, y) == b.step(x, y)
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert p.detach().numpy().tobytes() == q.detach().numpy().tobytes(), n


def test_frozen_parameters_get_no_state_and_stay_unchanged(corpus):
    model = build_model(SMALL, 0)
    frozen = {n for n in SMALL.param_shapes() if n.startswith(("embed.", "blocks.0."))}
    for n, p in model.named_parameters():
        p.requires_grad_(n not in frozen)
    before = _snapshot(model)
    trainer = InnerTrainer(model, INNER)
    for x, y in _batches(corpus, 4):
        trainer.step(x, y)
    by_id = {id(p): n for n, p in model.named_parameters()}
    with_state = {by_id[id(p)] for p in trainer.optimizer.state}
    assert with_state == set(SMALL.param_shapes()) - frozen
    for n, p in model.named_parameters():
        same = p.detach().numpy().tobytes() == before[n].numpy().tobytes()
        assert same == (n in frozen), n
        if n in frozen:
            assert p.grad is None
    saved = trainer.state_dict()["optimizer"]
    assert len(saved["state"]) == len(SMALL.param_shapes()) - len(frozen)


def test_no_trainable_parameters_is_an_error():
    model = build_model(SMALL, 0).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable"):
        InnerTrainer(model, INNER)


def test_evaluate_restores_mode_and_needs_no_grad(corpus):
    model = build_model(SMALL, 0)
    batches = val_batches(corpus, 32, 4, 2)
    model.train()
    loss = evaluate(model, batches, "cpu")
    assert model.training and isinstance(loss, float) and 5.0 < loss < 6.5
    model.eval()
    assert evaluate(model, batches) == loss and not model.training
    assert all(p.grad is None for p in model.parameters())


def test_evaluate_follows_the_trainers_precision_and_syncs_once(corpus, monkeypatch):
    """The losses add up on the device: one ``item()`` a pass, not one a batch (on a GPU each is a
    wait behind the inner steps' queued kernels), and the same float64 sum of the same values as
    before. With a bf16 trainer the pass runs under its autocast, as its steps do."""
    model = build_model(SMALL, 0)
    batches = val_batches(corpus, 32, 4, 3)
    with torch.no_grad():
        model.eval()
        per_batch = [model(x, y)[1].item() * y.numel() for x, y in batches]
    old = 0.0
    for v in per_batch:
        old += v
    items = []
    real_item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda t: items.append(1) or real_item(t))
    assert evaluate(model, batches) == old / sum(y.numel() for _, y in batches)
    assert len(items) == 1
    monkeypatch.undo()
    bf16 = InnerTrainer(copy.deepcopy(model), InnerSpec(precision="bf16"))
    assert bf16.autocast_dtype == torch.bfloat16
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = sum(model(x, y)[1].double().item() * y.numel() for x, y in batches)
    got = evaluate(bf16.model, batches, "cpu", bf16.autocast_dtype)
    assert got == pytest.approx(want / sum(y.numel() for _, y in batches), rel=1e-12)
    assert got != evaluate(model, batches)  # it did run in bf16


def test_out_of_memory_at_the_first_compiled_step_is_raised_not_taken_for_a_compile_failure(corpus, monkeypatch, caplog):
    """An eager step needs more memory than a compiled one: a CUDA out-of-memory at the first compiled
    call propagates, with compile still on, instead of turning compile off and failing again."""
    import peer.training.inner as inner_mod

    def compile_out_of_memory(model):
        def call(x, y):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return call

    monkeypatch.setattr(inner_mod.torch, "compile", compile_out_of_memory)
    trainer = InnerTrainer(build_model(SMALL, seed=0), INNER, compile=True)
    (x, y), = _batches(corpus, 1)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        trainer.step(x, y)
    assert trainer.compiled and "torch.compile failed" not in caplog.text


def test_default_model_learns_the_stdlib(corpus, threads):
    """60 inner steps of 16 x 128 bytes take the validation loss down by more than a nat."""
    # two intra-op threads on a machine with two cores collapse as soon as anything else runs
    # (measured: 60 steps in 12 s on one thread, 157 s on two with a load of 5)
    threads(2 if (os.cpu_count() or 1) >= 4 else 1)
    spec = ModelSpec()
    model = build_model(spec, 0)
    trainer = InnerTrainer(model, InnerSpec(), "cpu")
    stream = TrainStream(corpus, spec.seq_len, 16, seed=0, shard="peer-0")
    val = val_batches(corpus, spec.seq_len, 16, 4)
    before = evaluate(model, val)
    start = time.perf_counter()
    losses = [trainer.step(*next(stream)) for _ in range(60)]
    elapsed = time.perf_counter() - start
    after = evaluate(model, val)
    assert 5.3 < before < 6.0
    assert before - after > 1.0, (before, after)
    assert losses[-1] < losses[0] - 1.0
    print(f"val {before:.3f} -> {after:.3f} nats/byte, 60 steps in {elapsed:.1f}s")


def test_step_is_backward_then_apply_gradients(corpus):
    """``step`` is the forward, the backward and ``apply_gradients``: the same bits by hand."""
    batches = _batches(corpus, 3)
    a = InnerTrainer(build_model(SMALL, 0), INNER)
    b = InnerTrainer(build_model(SMALL, 0), INNER)
    for x, y in batches:
        want = a.step(x, y)
        b.optimizer.zero_grad(set_to_none=True)
        _, loss = b.model(x, y)
        loss.backward()
        b.apply_gradients()
        assert loss.item() == want
    assert a.step_count == b.step_count == 3
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert p.detach().numpy().tobytes() == q.detach().numpy().tobytes(), n


def test_apply_gradients_hooks(corpus):
    trainer = InnerTrainer(build_model(SMALL, 0), INNER)
    x, y = _batches(corpus, 1)[0]
    calls = []

    def before_clip():  # sees the raw gradients, before the schedule's lr and the clip
        calls.append(("before", trainer.step_count, sum(float(p.grad.norm()) ** 2 for p in trainer.params) ** 0.5))

    def after_step():
        calls.append(("after", trainer.step_count, None))

    trainer.model(x, y)[1].backward()
    trainer.apply_gradients(before_clip, after_step)
    assert [c[:2] for c in calls] == [("before", 0), ("after", 1)]
    assert calls[0][2] > INNER.grad_clip  # clipped afterwards: the hook came first

    # a hook that raises: nothing is updated, the step does not count
    before = _snapshot(trainer.model)
    state = copy.deepcopy(trainer.optimizer.state_dict())
    trainer.model(x, y)[1].backward()

    def refuse():
        raise RuntimeError("no")

    with pytest.raises(RuntimeError, match="no"):
        trainer.apply_gradients(refuse)
    assert trainer.step_count == 1
    assert trainer.optimizer.state_dict()["param_groups"] == state["param_groups"]
    for n, p in trainer.model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_compiled_trainer_trains_the_same_modules_to_about_the_same_values(corpus):
    """``compile=True`` (a peer's --compile): the same parameters and optimizer are updated, the
    losses agree with the eager trainer's to float tolerance (fused kernels round differently),
    and the state dict has the same keys, so checkpoints and payloads do not change."""
    pytest.importorskip("torch._dynamo")
    eager_model = build_model(SMALL, seed=0, mlp_slices=1)
    compiled_model = copy.deepcopy(eager_model)
    eager, compiled = InnerTrainer(eager_model, INNER), InnerTrainer(compiled_model, INNER, compile=True)
    assert compiled.compiled and not eager.compiled and compiled.model is compiled_model
    for x, y in _batches(corpus, 3):
        assert compiled.step(x, y) == pytest.approx(eager.step(x, y), abs=1e-4)
    for (name, a), (_, b) in zip(eager_model.named_parameters(), compiled_model.named_parameters()):
        assert torch.allclose(a, b, atol=1e-4), name
    assert compiled.state_dict().keys() == eager.state_dict().keys() and compiled.step_count == 3
    assert list(compiled_model.state_dict()) == list(eager_model.state_dict())  # no "_orig_mod." prefixes


def test_a_failing_compile_falls_back_to_eager_once_with_a_warning(corpus, monkeypatch, caplog):
    """No C compiler or an unsupported platform: the first compiled call fails, the trainer says so
    and trains eagerly from then on (the same step, not lost)."""
    import peer.training.inner as inner_mod

    def broken_compile(model):
        def call(*args, **kwargs):
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore detail")
        return call

    monkeypatch.setattr(inner_mod.torch, "compile", broken_compile)
    model = build_model(SMALL, seed=0, mlp_slices=1)
    eager = InnerTrainer(copy.deepcopy(model), INNER)
    trainer = InnerTrainer(model, INNER, compile=True)
    (x, y), = _batches(corpus, 1)
    assert trainer.step(x, y) == eager.step(x, y)
    assert not trainer.compiled and trainer.step_count == 1
    assert "torch.compile failed (RuntimeError: InvalidCxxCompiler: No working C++ compiler found)" in caplog.text
    caplog.clear()
    trainer.step(x, y)
    assert "torch.compile" not in caplog.text  # said once


def test_a_compile_refused_at_once_falls_back_to_eager(corpus, monkeypatch, caplog):
    """A platform dynamo does not support raises at ``torch.compile`` itself, not at the first call:
    the peer still starts, says so, and trains eagerly."""
    import peer.training.inner as inner_mod

    def refusing_compile(model):
        raise RuntimeError("Python 3.13+ is not yet supported for torch.compile")

    monkeypatch.setattr(inner_mod.torch, "compile", refusing_compile)
    model = build_model(SMALL, seed=0, mlp_slices=1)
    eager = InnerTrainer(copy.deepcopy(model), INNER)
    trainer = InnerTrainer(model, INNER, compile=True)
    assert not trainer.compiled
    assert "torch.compile failed (RuntimeError: Python 3.13+ is not yet supported" in caplog.text
    (x, y), = _batches(corpus, 1)
    assert trainer.step(x, y) == eager.step(x, y)


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("inductor: backward compile failed")


def test_a_compiled_backward_that_fails_at_its_first_call_falls_back_to_the_same_eager_step(corpus, monkeypatch, caplog):
    """The compiled backward is built at the first ``loss.backward()``, after the forward pass
    worked: a failure there is the compile's too. The step is taken again eagerly, with no gradient
    of the failed try left over, so it ends on the eager trainer's parameters, bit for bit."""
    import peer.training.inner as inner_mod

    def compile_with_broken_backward(model):
        def call(x, y):
            logits, loss = model(x, y)
            return logits, _FailingBackward.apply(loss)
        return call

    monkeypatch.setattr(inner_mod.torch, "compile", compile_with_broken_backward)
    model = build_model(SMALL, seed=0, mlp_slices=1)
    eager = InnerTrainer(copy.deepcopy(model), INNER)
    trainer = InnerTrainer(model, INNER, compile=True)
    for x, y in _batches(corpus, 2):
        assert trainer.step(x, y) == eager.step(x, y)
    assert not trainer.compiled and trainer.step_count == 2
    assert caplog.text.count("torch.compile failed (RuntimeError: inductor: backward compile failed)") == 1
    for (name, a), (_, b) in zip(eager.model.named_parameters(), trainer.model.named_parameters()):
        assert torch.equal(a, b), name


def test_checkpoint_activations_recomputes_blocks_and_trains_the_same_bits():
    """inner.checkpoint_activations: the trainer sets the model's recompute_blocks, and three AdamW
    steps end on the same parameters, bit for bit, as without it."""
    spec = ModelSpec(d_model=32, n_layers=2, n_heads=2, ffn_hidden=64, seq_len=16)
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 256, (2, 16), generator=gen), torch.randint(0, 256, (2, 16), generator=gen))
               for _ in range(3)]
    ends = []
    for on in (False, True):
        model = build_model(spec, seed=3)
        trainer = InnerTrainer(model, InnerSpec(checkpoint_activations=on))
        assert model.recompute_blocks is on
        for x, y in batches:
            trainer.step(x, y)
        ends.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*ends))
