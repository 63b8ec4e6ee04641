"""Subspace activation codec for pipeline chains (protocol/chain/activations.py), its basis (protocol/chain/subspace.py)
and the lossless constraint (protocol/chain/subspace_constraint.py)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from peer.training.model import build_model
from protocol.chain.activations import (
    ActivationCodec,
    bytes_per_token,
    check_activation_frame,
    check_gradient_frame,
    compressed_boundary,
    token_id_bytes,
    uncompressed_bytes_per_token,
)
from protocol.errors import FrameError
from protocol.spec import ModelSpec
from protocol.chain.subspace import subspace_basis
from protocol.chain.subspace_constraint import constrain_to_subspace_, is_output_projection, project_gradients_, project_rows_

SPEC = ModelSpec(vocab_size=256, d_model=64, n_layers=2, n_heads=4, ffn_hidden=128, seq_len=32)
K = 16  # 4x compression of the 64-wide stream


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: a thread pool only adds wake-up latency (a lot of it on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def batches(n, seed=1, B=4):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        # a learnable pattern: each sequence counts up from a random start, with noise
        start = torch.randint(0, 256, (B, 1), generator=g)
        tok = (start + torch.arange(SPEC.seq_len + 1)) % 256
        noise = torch.randint(0, 256, tok.shape, generator=g)
        tok = torch.where(torch.rand(tok.shape, generator=g) < 0.1, noise, tok)
        yield tok[:, :-1], tok[:, 1:]


def train(model, U=None, T=None, steps=4, lr=1e-2):
    """AdamW steps; with U, the lossless constraint applied as the module docstring prescribes."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    for x, y in batches(steps):
        _, loss = model(x, y)
        loss.backward()
        if U is not None:
            project_gradients_(model.named_parameters(), U)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if U is not None:
            constrain_to_subspace_(model.named_parameters(), U, T)


def boundaries(model, tok):
    """The hidden states at every possible stage boundary: after the embedding and each block."""
    with torch.no_grad():
        h = model.embed_tokens(tok)
        out = [h]
        for i in range(SPEC.n_layers):
            h = model.forward_blocks(h, i, i + 1)
            out.append(h)
    return out


def boundary_errors(model, codec, T, tok):
    """Reconstruction error of h - T[tok] at each boundary, relative to its norm."""
    errs = []
    for h in boundaries(model, tok):
        h_hat = codec.decode_forward(codec.encode_forward(h, tok, T), tok, T)
        errs.append(rel(h_hat, h) * h.double().norm().item() / (h - T[tok]).double().norm().item())
    return errs


def constrained_model(mlp_slices=1, attn_slices=1, seed=0):
    model = build_model(SPEC, seed, mlp_slices, attn_slices)
    U = subspace_basis(SPEC.d_model, K, seed)
    T = model.embed.weight.detach().clone()
    constrain_to_subspace_(model.named_parameters(), U, T, exact=True)  # round 0
    return model, U, T


# --- the basis ---------------------------------------------------------------------------------
def test_basis_is_orthonormal_reproducible_and_seeded():
    U = subspace_basis(96, 24, seed=7)
    assert U.shape == (96, 24) and U.dtype == torch.float32
    assert torch.allclose(U.T.double() @ U.double(), torch.eye(24, dtype=torch.float64), atol=1e-6)
    again = subspace_basis(96, 24, seed=7)
    assert again.numpy().tobytes() == U.numpy().tobytes()
    again[0, 0] = 5.0  # callers get a copy, not the cached tensor
    assert subspace_basis(96, 24, seed=7)[0, 0] != 5.0
    assert not torch.equal(subspace_basis(96, 24, seed=8), U)
    # nested: a smaller k is a prefix of the same basis
    assert torch.equal(subspace_basis(96, 8, seed=7), U[:, :8])
    assert torch.equal(subspace_basis(32, 32, seed=7), torch.eye(32))


def test_basis_bits_are_pinned():
    """Integer draws and fixed-order float64 arithmetic: these bits on every machine (checked on
    x86 with ATEN_CPU_CAPABILITY default, avx2 and avx512)."""
    digest = hashlib.sha256(subspace_basis(64, 8, 0).numpy().tobytes()).hexdigest()
    assert digest.startswith("282dd790fd466477")


def test_basis_is_the_canonical_qr_of_its_gaussian():
    from protocol.chain import subspace as A

    U = subspace_basis(128, 32, 3)
    seed = hashlib.sha256(A._BASIS_TAG + (3).to_bytes(32, "little") + (128).to_bytes(8, "little")).digest()
    g = torch.Generator().manual_seed(int.from_bytes(seed[:8], "little") >> 1)
    Q, R = torch.linalg.qr(A._exact_gaussian(32, 128, g).T)
    Q = Q * torch.sign(torch.diagonal(R))  # positive diagonal of R: the unique Q
    assert torch.allclose(Q.float(), U, atol=1e-6)


@pytest.mark.parametrize("d, k", [(0, 0), (8, 0), (8, 9)])
def test_basis_rejects_bad_sizes(d, k):
    with pytest.raises(ValueError):
        subspace_basis(d, k, 0)


# --- sizes -------------------------------------------------------------------------------------
def test_bytes_per_token_reference_point():
    assert bytes_per_token(160, torch.float16, vocab_size=50304) == 322  # the paper's d 1024, k 160
    assert bytes_per_token(160, torch.bfloat16, token_ids=False) == 320
    assert uncompressed_bytes_per_token(1024, torch.float16) == 2048
    assert uncompressed_bytes_per_token(1024, torch.float32) == 4096
    assert [token_id_bytes(v) for v in (256, 257, 65536, 65537)] == [1, 2, 2, 4]
    codec = ActivationCodec(subspace_basis(SPEC.d_model, K, 0))
    assert codec.forward_bytes_per_token(SPEC.vocab_size) == 2 * K + 1
    assert codec.backward_bytes_per_token() == 2 * K


# --- the codec ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, tol", [(torch.float16, 1e-3), (torch.bfloat16, 8e-3)])
def test_identity_basis_round_trip(dtype, tol):
    d = 48
    codec = ActivationCodec(subspace_basis(d, d, 0), dtype)
    assert codec.identity
    g = torch.Generator().manual_seed(0)
    T = torch.randn(100, d, generator=g)
    tok = torch.randint(0, 100, (3, 10), generator=g)
    h = T[tok] + 0.1 * torch.randn(3, 10, d, generator=g)
    c = codec.encode_forward(h, tok, T)
    assert c.dtype == dtype and c.shape == (3, 10, d)
    assert rel(codec.decode_forward(c, tok, T) - T[tok], h - T[tok]) < tol
    grad = torch.randn(3, 10, d, generator=g)
    c = codec.encode_backward(grad)
    assert c.dtype == dtype and rel(codec.decode_backward(c), grad) < tol


def test_generic_stream_is_lossy_at_k_lt_d():
    codec = ActivationCodec(subspace_basis(64, K, 0))
    T = torch.zeros(10, 64)
    tok = torch.zeros(2, 5, dtype=torch.long)
    h = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0))
    err = rel(codec.decode_forward(codec.encode_forward(h, tok, T), tok, T), h)
    assert abs(err - (1 - K / 64) ** 0.5) < 0.1  # the part outside span(U) is dropped


def test_encoder_refuses_what_fp16_cannot_carry():
    """The message tells an overflow (with its largest value) from a diverged model (NaN or inf before
    the cast): a chain broke once on an H200 with "not finite", which said neither."""
    codec = ActivationCodec(subspace_basis(16, 16, 0), torch.float16)
    T = torch.zeros(4, 16)
    tok = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="largest value, 1e[+]06, overflows"):
        codec.encode_forward(torch.full((1, 2, 16), 1e6), tok, T)
    with pytest.raises(ValueError, match="32 of 32 values are NaN or inf before it"):
        codec.encode_backward(torch.full((1, 2, 16), float("nan")))
    bf = ActivationCodec(subspace_basis(16, 16, 0), torch.bfloat16)
    assert torch.isfinite(bf.encode_forward(torch.full((1, 2, 16), 1e6), tok, T)).all()
    with pytest.raises(ValueError):
        ActivationCodec(subspace_basis(16, 4, 0), torch.float32)
    with pytest.raises(ValueError):
        ActivationCodec(torch.zeros(4, 8))


# --- the lossless variant ------------------------------------------------------------------------
def test_constraint_touches_exactly_the_output_projections_and_embedding():
    model = build_model(SPEC, 0, mlp_slices=2, attn_slices=2)
    U = subspace_basis(SPEC.d_model, K, 0)
    names = constrain_to_subspace_(model.named_parameters(), U, model.embed.weight.detach().clone())
    expected = ["embed.weight"] + [
        f"blocks.{i}.{proj}.{s}.weight" for i in range(SPEC.n_layers) for proj in ("attn.out", "mlp.down") for s in (0, 1)
    ]
    assert names == expected
    assert is_output_projection("blocks.11.mlp.down.weight") and not is_output_projection("blocks.1.mlp.up.weight")
    with pytest.raises(ValueError):
        constrain_to_subspace_(model.named_parameters(), U)  # the embedding needs T


@pytest.mark.parametrize("slices", [1, 2])
def test_constrained_model_crosses_boundaries_losslessly(slices):
    model, U, T = constrained_model(slices, slices)
    codec = ActivationCodec(U, torch.float16)
    E0 = model.embed.weight.detach().clone()
    train(model, U, T, steps=4)
    assert rel(model.embed.weight.detach(), E0) > 1e-3  # the embedding drifted: boundary 0 is tested
    tok, _ = next(batches(1, seed=9))
    errs = boundary_errors(model, codec, T, tok)
    print("constrained relative errors per boundary:", errs)
    assert max(errs) < 2e-3  # fp16 rounding of the coefficients only

    # an outer step whose (sparsified) update leaves span(U): the exact projection restores it
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_output_projection(name):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5)) * (torch.rand(p.shape) < 0.02) * 0.01)
    constrain_to_subspace_(model.named_parameters(), U, model.embed.weight.detach().clone(), exact=True)
    T = model.embed.weight.detach().clone()  # the new anchor
    train(model, U, T, steps=2)
    assert max(boundary_errors(model, codec, T, tok)) < 2e-3


def test_unconstrained_model_is_lossy():
    model = build_model(SPEC, 0)
    U = subspace_basis(SPEC.d_model, K, 0)
    T = model.embed.weight.detach().clone()
    train(model, steps=4)
    tok, _ = next(batches(1, seed=9))
    errs = boundary_errors(model, ActivationCodec(U), T, tok)
    print("unconstrained relative errors per boundary:", errs)
    assert min(errs) > 0.5  # most of h - T[tok] lies outside span(U)


def test_exact_projection_is_order_independent_and_in_span():
    U = subspace_basis(64, K, 0)
    W = torch.randn(64, 100, generator=torch.Generator().manual_seed(0)) * 0.02
    a, b = W.clone(), W.clone()
    project_rows_(a, U, exact=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for i in range(0, 100, 7):  # column chunks, another thread count: another BLAS blocking
            project_rows_(b[:, i : i + 7], U, exact=True)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(a, b)
    reference = U.double() @ (U.double().T @ W.double())
    assert (a.double() - reference).abs().max() < 1e-5 * W.abs().max()
    assert rel(U @ (U.T @ a), a) < 1e-6  # in span(U)


# --- gradients through a boundary ----------------------------------------------------------------
def chain_grads(model, codec, T, x, y, split=1, capture=None):
    """Two stages joined by a compressed boundary after block ``split``; returns the grads."""
    model.zero_grad(set_to_none=True)
    h = model.forward_blocks(model.embed_tokens(x), 0, split)
    if capture is not None:
        h.register_hook(lambda g: capture.append(g))
    h = compressed_boundary(h, x, T, codec)
    _, loss = model.forward_head(model.forward_blocks(h, split, None), y)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def reference_grads(model, x, y, capture=None):
    model.zero_grad(set_to_none=True)
    h = model.forward_blocks(model.embed_tokens(x), 0, 1)
    if capture is not None:
        h.register_hook(lambda g: capture.append(g))
    _, loss = model.forward_head(model.forward_blocks(h, 1, None), y)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_identity_boundary_gradients_match_uncompressed():
    model = build_model(SPEC, 0)
    train(model, steps=2)
    T = model.embed.weight.detach().clone()
    x, y = next(batches(1, seed=3))
    ref = reference_grads(model, x, y)
    got = chain_grads(model, ActivationCodec(subspace_basis(SPEC.d_model, SPEC.d_model, 0)), T, x, y)
    errs = {n: rel(got[n], ref[n]) for n in ref}
    assert max(errs.values()) < 5e-3, errs


def test_compressed_boundary_sends_back_the_projected_gradient():
    model, U, T = constrained_model()
    train(model, U, T, steps=2)
    codec = ActivationCodec(U)
    x, y = next(batches(1, seed=3))
    g_ref, g_got = [], []
    ref = reference_grads(model, x, y, capture=g_ref)
    got = chain_grads(model, codec, T, x, y, capture=g_got)
    P = U @ U.T
    assert rel(g_got[0], g_ref[0] @ P) < 2e-3  # stage 1 receives P g (to fp16 rounding)
    assert rel(g_got[0], g_ref[0]) > 0.3  # which is not g
    # lossless: every stage-1 parameter off the constraint gets its full gradient ...
    for n in ref:
        if not (is_output_projection(n) or n == "embed.weight"):
            assert rel(got[n], ref[n]) < 1e-2, n
    # ... and the constrained ones their full projected gradient: chain == one box
    for grads in (ref, got):
        project_gradients_([(n, _Grad(g)) for n, g in grads.items()], U)
    errs = {n: rel(got[n], ref[n]) for n in ref}
    print("constrained chain vs one box, worst gradient error:", max(errs.values()))
    assert max(errs.values()) < 1e-2, errs


class _Grad:
    """A stand-in parameter whose .grad is the given tensor (project_gradients_ edits in place)."""

    def __init__(self, g):
        self.grad = g


def test_unconstrained_compressed_gradients_are_lossy():
    model = build_model(SPEC, 0)
    train(model, steps=2)
    T = model.embed.weight.detach().clone()
    x, y = next(batches(1, seed=3))
    ref = reference_grads(model, x, y)
    got = chain_grads(model, ActivationCodec(subspace_basis(SPEC.d_model, K, 0)), T, x, y)
    stage1 = [n for n in ref if n.startswith("blocks.0.") or n == "embed.weight"]
    assert max(rel(got[n], ref[n]) for n in stage1) > 0.1


# --- frames from the network ---------------------------------------------------------------------
def good_frame():
    return torch.zeros(2, 5, K, dtype=torch.float16), torch.zeros(2, 5, dtype=torch.int64)


def test_good_frames_pass():
    c, tok = good_frame()
    check_activation_frame(c, tok, (2, 5, K), vocab=256)
    check_activation_frame(c.to(torch.bfloat16), tok.to(torch.uint8), (2, 5, K), vocab=256)
    check_gradient_frame(c, (2, 5, K), dtype=torch.float16)


@pytest.mark.parametrize(
    "case",
    ["not a tensor", "fp32", "wrong dtype asked", "shape", "k", "2-D", "nan", "inf", "tok shape", "tok float",
     "tok negative", "tok too large", "tok not a tensor"],
)
def test_bad_activation_frames_raise_frame_error(case):
    c, tok = good_frame()
    dtype = None
    if case == "not a tensor":
        c = c.tolist()
    elif case == "fp32":
        c = c.float()
    elif case == "wrong dtype asked":
        dtype = torch.bfloat16
    elif case == "shape":
        c = torch.zeros(2, 6, K, dtype=torch.float16)
    elif case == "k":
        c = torch.zeros(2, 5, K + 1, dtype=torch.float16)
    elif case == "2-D":
        c = c.view(10, K)
    elif case == "nan":
        c[1, 2, 3] = float("nan")
    elif case == "inf":
        c[0, 0, 0] = float("-inf")
    elif case == "tok shape":
        tok = tok[:, :4]
    elif case == "tok float":
        tok = tok.float()
    elif case == "tok negative":
        tok[0, 1] = -1
    elif case == "tok too large":
        tok[1, 4] = 256
    elif case == "tok not a tensor":
        tok = tok.tolist()
    with pytest.raises(FrameError):
        check_activation_frame(c, tok, (2, 5, K), vocab=256, dtype=dtype)


def test_bad_gradient_frames_raise_frame_error():
    c, _ = good_frame()
    for bad in (c.float(), c[:, :4], c.clone().fill_(float("inf")), "bytes"):
        with pytest.raises(FrameError):
            check_gradient_frame(bad, (2, 5, K))
