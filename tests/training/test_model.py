import hashlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from peer.training import model as model_module
from peer.training.model import Model, _exact_normal, build_model
from protocol.spec import ModelSpec

GOLDEN_DEFAULT_SEED0 = "aad1a404add8349f"
SMALL = ModelSpec(d_model=32, n_layers=3, n_heads=2, ffn_hidden=64, seq_len=16)


def _param_bytes(model):
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("spec", [ModelSpec(), SMALL])
def test_names_shapes_and_order_match_spec(spec):
    model = build_model(spec, seed=0)
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == list(spec.param_shapes().items())
    assert list(model.state_dict()) == list(spec.param_shapes())  # RoPE tables are not persistent
    assert sum(p.numel() for p in model.parameters()) == spec.num_params()


def test_same_seed_bit_identical_different_seed_differs():
    a, b, c = build_model(SMALL, 7), build_model(SMALL, 7), build_model(SMALL, 8)
    assert _param_bytes(a) == _param_bytes(b)
    assert _param_bytes(a) != _param_bytes(c)


def test_init_does_not_depend_on_global_rng_and_leaves_it_alone():
    torch.manual_seed(1)
    a = build_model(SMALL, 3)
    after_a = torch.rand(1)
    torch.manual_seed(1)
    torch.rand(5)
    b = build_model(SMALL, 3)
    assert _param_bytes(a) == _param_bytes(b)
    torch.manual_seed(1)
    assert torch.rand(1).item() == after_a.item()


def test_init_golden_fingerprint():
    # The init uses integer draws and exact arithmetic only, so these bits hold on every CPU.
    # If this changes, every peer of a run must upgrade together: the model at round 0 changed.
    model = build_model(ModelSpec(), 0)
    w = model.blocks[0].attn.qkv.weight
    assert _param_bytes(model)[:16] == GOLDEN_DEFAULT_SEED0
    assert abs(w.std().item() - 0.02) < 0.0005 and abs(w.mean().item()) < 0.0005


def test_init_is_the_same_on_the_scalar_cpu_path():
    # torch's float32 normal_ gives other bits on its scalar path (ARM, old x86) than with AVX2;
    # our init must not: run it with the vector kernels disabled and compare.
    code = (
        "import hashlib; from peer.training.model import build_model; from protocol.spec import ModelSpec\n"
        "h = hashlib.sha256()\n"
        "for n, p in build_model(ModelSpec(), 0).named_parameters():\n"
        "    h.update(n.encode()); h.update(p.detach().numpy().tobytes())\n"
        "print(h.hexdigest()[:16])"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == GOLDEN_DEFAULT_SEED0


def test_init_statistics():
    model = build_model(ModelSpec(), 0)
    spec = model.spec
    for name, p in model.named_parameters():
        if p.ndim == 1:
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith(("attn.out.weight", "mlp.down.weight")):
            assert abs(p.std().item() - spec.init_std / math.sqrt(2 * spec.n_layers)) < 5e-4, name
        else:
            assert abs(p.std().item() - spec.init_std) < 5e-4, name


def test_exact_normal_is_close_to_standard_normal():
    z = _exact_normal((200_000,), 1.0, torch.Generator().manual_seed(0)).double()
    assert abs(z.mean().item()) < 0.01
    assert abs(z.std().item() - 1.0) < 0.01
    assert abs((z.abs() < 1).double().mean().item() - 0.6827) < 0.005
    assert abs((z.abs() < 2).double().mean().item() - 0.9545) < 0.005


def test_loss_at_init_is_about_ln_256():
    torch.manual_seed(0)
    model = build_model(ModelSpec(), 0)
    x = torch.randint(0, 256, (4, 128))
    y = torch.randint(0, 256, (4, 128))
    logits, loss = model(x, y)
    assert logits.shape == (4, 128, 256) and logits.dtype == torch.float32
    assert abs(loss.item() - math.log(256)) < 0.05
    logits2, none = model(x)
    assert none is None and torch.equal(logits, logits2)


def test_forward_blocks_composition_equals_forward():
    torch.manual_seed(0)
    model = build_model(SMALL, 1).eval()
    x = torch.randint(0, 256, (2, 16))
    y = torch.randint(0, 256, (2, 16))
    full_logits, full_loss = model(x, y)
    h = model.embed_tokens(x)
    for start, end in [(0, 1), (1, 3)]:  # two stages
        h = model.forward_blocks(h, start, end)
    logits, loss = model.forward_head(h, y)
    torch.testing.assert_close(logits, full_logits, rtol=0, atol=0)
    assert loss.item() == full_loss.item()
    # and an empty slice is the identity
    h0 = model.embed_tokens(x)
    assert torch.equal(model.forward_blocks(h0, 2, 2), h0)


def test_causal():
    torch.manual_seed(0)
    model = build_model(SMALL, 2).eval()
    x = torch.randint(0, 256, (1, 16))
    x2 = x.clone()
    x2[0, 10] = (x2[0, 10] + 1) % 256
    with torch.no_grad():
        a, _ = model(x)
        b, _ = model(x2)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_shorter_sequences_and_too_long():
    model = build_model(SMALL, 0)
    logits, _ = model(torch.zeros(2, 5, dtype=torch.long))
    assert logits.shape == (2, 5, 256)
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_rope_theta_from_spec_matters():
    x = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    a = build_model(SMALL, 0).eval()
    b = build_model(ModelSpec(**{**SMALL.__dict__, "rope_theta": 100.0}), 0).eval()
    with torch.no_grad():
        assert not torch.allclose(a(x)[0], b(x)[0])


def test_model_is_a_plain_module():
    model = Model(SMALL)
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == SMALL.n_layers
    assert {"embed", "blocks", "norm", "head"} <= set(dict(model.named_children()))


# --- block ranges: a pipeline stage is a Model holding some of the blocks -------------------------

FOUR = ModelSpec(d_model=32, n_layers=4, n_heads=4, ffn_hidden=64, seq_len=16)
SPLITS = [(a, b) for a in range(FOUR.n_layers) for b in range(a + 1, FOUR.n_layers + 1)]


@pytest.mark.parametrize("slices", [(1, 1), (2, 2)])
def test_every_stage_holds_exactly_the_full_models_tensors(slices):
    from protocol.model.layout import in_block_range, tensor_layout

    full = dict(build_model(FOUR, 5, *slices).named_parameters())
    layout = tensor_layout(FOUR, *slices)
    for start, end in SPLITS:
        stage = build_model(FOUR, 5, *slices, blocks=(start, end))
        want = [n for n, info in layout.items() if in_block_range(info, start, end, FOUR.n_layers)]
        assert [n for n, _ in stage.named_parameters()] == want, (start, end)
        assert list(stage.state_dict()) == want
        for name, p in stage.named_parameters():
            assert p.detach().numpy().tobytes() == full[name].detach().numpy().tobytes(), (start, end, name)
        assert (stage.is_first, stage.is_last) == (start == 0, end == FOUR.n_layers)
        assert (stage.embed is not None, stage.head is not None) == (stage.is_first, stage.is_last)


def test_stages_chained_compute_the_full_forward():
    full = build_model(FOUR, 2).eval()
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    y = torch.roll(x, -1, dims=1)
    want_logits, want_loss = full(x, y)
    stages = [build_model(FOUR, 2, blocks=b).eval() for b in [(0, 1), (1, 3), (3, 4)]]
    h = stages[0].embed_tokens(x)
    for s in stages:
        h = s.forward_blocks(h)
    logits, loss = stages[-1].forward_head(h, y)
    assert torch.equal(logits, want_logits) and torch.equal(loss, want_loss)


def test_block_range_checks():
    stage = Model(FOUR, blocks=(1, 3))
    assert isinstance(stage.blocks, torch.nn.ModuleList) and len(stage.blocks) == FOUR.n_layers
    assert stage.blocks[0] is None and stage.blocks[3] is None and stage.blocks[1] is not None
    h = torch.zeros(1, 4, FOUR.d_model)
    assert stage.forward_blocks(h, 2, 2) is h
    with pytest.raises(ValueError, match="not within"):
        stage.forward_blocks(h, 0, 2)
    with pytest.raises(RuntimeError, match="embedding"):
        stage.embed_tokens(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(RuntimeError, match="head"):
        stage.forward_head(h)
    for bad in [(0, 0), (2, 1), (-1, 2), (0, 5), (0.0, 1)]:
        with pytest.raises(ValueError, match="block range"):
            Model(FOUR, blocks=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_keeps_two_tensors_and_the_same_gradients(dtype, monkeypatch):
    """peer/training/model.py's swiglu: autograd's silu(g) * u keeps g, silu(g) and u; swiglu keeps
    g and u, and its gradients (and so a whole model's) are the same bits as autograd's."""
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(3, 17, 40, generator=gen).to(dtype).requires_grad_()
    u = torch.randn(3, 17, 40, generator=gen).to(dtype).requires_grad_()
    grad = torch.randn(3, 17, 40, generator=gen).to(dtype)

    def saved_and_grads(fn, needs=(True, True)):
        a, b = g.detach().clone().requires_grad_(needs[0]), u.detach().clone().requires_grad_(needs[1])
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.untyped_storage().data_ptr()) or t,
                                                     lambda t: t):
            out = fn(a, b)
        out.backward(grad)
        return out, len(set(kept)), a.grad, b.grad

    reference = lambda a, b: torch.nn.functional.silu(a) * b  # noqa: E731
    for needs, kept in [((True, True), (3, 2)), ((True, False), (2, 2)), ((False, True), (1, 1))]:
        out_r, kept_r, ga_r, gb_r = saved_and_grads(reference, needs)
        out_s, kept_s, ga_s, gb_s = saved_and_grads(model_module.swiglu, needs)
        assert torch.equal(out_r, out_s) and (kept_r, kept_s) == kept
        for x, y in [(ga_r, ga_s), (gb_r, gb_s)]:
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y))
    # without autograd it is the plain expression
    with torch.no_grad():
        assert torch.equal(model_module.swiglu(g, u), reference(g, u))

    # a whole model, sliced MLP included: the same loss and gradients, bit for bit
    spec = ModelSpec(d_model=32, n_layers=2, n_heads=2, ffn_hidden=64, seq_len=16)
    x = torch.randint(0, 256, (2, 16), generator=gen)
    for slices in (1, 2):
        grads = []
        for fn in (model_module.swiglu, reference):
            monkeypatch.setattr(model_module, "swiglu", fn)
            model = build_model(spec, seed=1, mlp_slices=slices)
            if slices == 2:
                model.blocks[0].mlp.up[1].weight.requires_grad_(False)  # a frozen slice's tensor
            model(x, x)[1].backward()
            grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        monkeypatch.undo()
        assert grads[0].keys() == grads[1].keys() and all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_recomputed_blocks_give_the_same_gradients(dtype):
    """Model.recompute_blocks (inner.checkpoint_activations): each block keeps its input only and
    runs again in the backward; the loss and every gradient are the same bits, with a sliced MLP, a
    frozen slice and under bf16 autocast too, and far fewer bytes are kept for the backward."""
    spec = ModelSpec(d_model=32, n_layers=3, n_heads=2, ffn_hidden=64, seq_len=16)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    for slices in (1, 2):
        out = []
        for recompute in (False, True):
            model = build_model(spec, seed=1, mlp_slices=slices)
            model.recompute_blocks = recompute
            if slices == 2:
                model.blocks[1].mlp.gate[0].weight.requires_grad_(False)
            kept = {}
            params = {p.untyped_storage().data_ptr() for p in model.parameters()}

            def pack(t):
                if t.untyped_storage().data_ptr() not in params:
                    kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                    torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = model(x, x)[1]
            loss.backward()
            out.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
                        sum(kept.values())))
        (loss_a, grads_a, kept_a), (loss_b, grads_b, kept_b) = out
        assert torch.equal(loss_a, loss_b)
        assert grads_a.keys() == grads_b.keys() and all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
        assert kept_b < kept_a / 2, (kept_a, kept_b)
    # without autograd nothing is recomputed: the same forward
    model = build_model(spec, seed=1)
    with torch.no_grad():
        plain = model(x)[0]
        model.recompute_blocks = True
        assert torch.equal(model(x)[0], plain)
