"""Device-generic encoding (protocol/codecs, peer/outer/strategies.py).

The codecs' encoders run on the pseudo-gradient's device and copy only the packed fields to the
CPU; decoding stays on the CPU, from the bytes. On the CPU the generic path must give exactly the
bytes of the numpy encoders it replaced (kept below, frozen, as the reference). On a GPU (skipped
without one) the payload may differ from the CPU's only by device rounding: it decodes to values
within the codec's tolerance, and the same bytes decode to the same bits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from peer.outer.strategies import make_strategy, pseudo_gradient
from protocol.codecs.dct import DCTCodec, dct_basis
from protocol.codecs.dense import DenseCodec
from protocol.codecs.fields import pack_bits, pack_bits_tensor
from protocol.codecs.index_coding import encode_positions
from protocol.codecs.sparseloco import SparseLoCoCodec
from protocol.spec import RunSpec

SHAPES = [(256, 128), (352, 64), (64,), (128, 352), (7, 13), (1,)]


def _delta(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * 1e-3


# --- the encoders as they were (numpy on the CPU), the reference ----------------------------------
def _old_sparseloco(codec: SparseLoCoCodec, x: torch.Tensor):
    blocking, k = codec._geometry(tuple(x.shape))
    blocks = blocking.split(x)
    idx = blocks.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    kept = blocks.gather(1, idx).reshape(-1).double().numpy()
    bins = 1 << codec.bits
    shift = kept.mean()
    centered = kept - shift
    scale = 2 * 3.0 * np.sqrt(np.mean(centered * centered)) / bins
    if scale > 0:
        codes = np.clip(np.floor(centered / scale) + bins // 2, 0, bins - 1).astype(np.int64)
    else:
        codes = np.full(kept.size, bins // 2, dtype=np.int64)
    counts = np.bincount(codes, minlength=bins)
    sums = np.bincount(codes, weights=kept, minlength=bins)
    centres = shift + (np.arange(bins) + 0.5 - bins / 2) * scale
    lut = np.where(counts > 0, sums / np.maximum(counts, 1), centres)
    # positions as the codec codes them (tests/protocol/test_index_coding.py compares with the former 12-bit ones)
    return {"idx": encode_positions(idx, blocking.block_numel), "codes": pack_bits(codes, codec.bits),
            "lut": lut.astype("<f4").tobytes()}


def _old_dct(codec: DCTCodec, x: torch.Tensor):
    blocking, k = codec._geometry(tuple(x.shape))
    blocks = blocking.split(x).reshape(-1, blocking.bh, blocking.bw)
    coeffs = (dct_basis(blocking.bh) @ blocks @ dct_basis(blocking.bw).T).reshape(-1, blocking.block_numel)
    idx = coeffs.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    values = coeffs.gather(1, idx)
    if codec.value_dtype == "fp16":
        values = values.clamp(-65504.0, 65504.0)
    return {"idx": idx.numpy().astype("<u2").tobytes(), "val": values.numpy().astype(codec._wire).tobytes()}


def _old_dense(codec: DenseCodec, x: torch.Tensor):
    if codec.dtype == "fp16":
        x = x.clamp(-65504.0, 65504.0)
    return {"data": x.numpy().astype(codec._wire, copy=False).tobytes()}


CASES = [
    (SparseLoCoCodec(64, 64, 2), _old_sparseloco),
    (SparseLoCoCodec(32, 16, 3), _old_sparseloco),
    (DCTCodec(64, 32, "fp16"), _old_dct),
    (DCTCodec(16, 8, "fp32"), _old_dct),
    (DenseCodec("fp32"), _old_dense),
    (DenseCodec("fp16"), _old_dense),
]


@pytest.mark.parametrize("codec, old", CASES, ids=lambda c: getattr(c, "name", ""))
def test_cpu_encode_gives_the_bytes_of_the_numpy_encoders(codec, old):
    for seed, shape in enumerate(SHAPES):
        x = _delta(shape, seed)
        if seed == 1:
            x = x * 5e4  # beyond fp16's range once transformed: the clamp
        fields, sent = codec.encode(x)
        assert fields == old(codec, x), (codec.name, shape)
        assert sent.device.type == "cpu" and sent.dtype == torch.float32
        assert torch.equal(sent, codec.decode(fields, tuple(x.shape)))


def test_constant_and_empty_kept_values_quantize_as_before():
    codec = SparseLoCoCodec(8, 4, 2)
    x = torch.full((16, 16), 0.25)
    assert codec.encode(x)[0] == _old_sparseloco(codec, x)


@pytest.mark.parametrize("bits", [1, 2, 3, 7, 8, 12])
def test_pack_bits_tensor_is_pack_bits(bits):
    values = np.random.default_rng(bits).integers(0, 1 << bits, size=1001)
    assert pack_bits_tensor(torch.from_numpy(values), bits) == pack_bits(values, bits)


@pytest.mark.parametrize("strategy", ["sparseloco", "dct", "diloco"])
def test_strategy_payloads_on_the_cpu_are_unchanged_across_rounds(strategy):
    """The error-feedback path (signal, settle) on the CPU gives the bytes it gave before."""
    spec = RunSpec().replace(model={"d_model": 64, "n_layers": 1, "n_heads": 4, "ffn_hidden": 176, "seq_len": 32},
                             outer={"strategy": strategy})
    a, b = make_strategy(spec), make_strategy(spec)
    theta = {n: torch.zeros(s) for n, s in spec.param_shapes().items()}
    for round_no in range(3):
        now = {n: _delta(s, 10 * round_no + i) for i, (n, s) in enumerate(spec.param_shapes().items())}
        delta = pseudo_gradient(theta, now)
        assert all(t.device.type == "cpu" for t in delta.values())
        (pa, pend_a), (pb, pend_b) = a.encode(delta, round_no), b.encode({n: t.clone() for n, t in delta.items()}, round_no)
        assert pa == pb
        a.settle(pend_a, True)
        b.settle(pend_b, True)
        assert all(torch.equal(a.decode(pa, round_no)[n], pend_a.sent[n]) for n in pend_a.sent)
    sa, sb = a.local_state(), b.local_state()
    assert all(t.device.type == "cpu" and torch.equal(t, sb[k]) for k, t in sa.items())


# --- on a GPU ----------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False")


@cuda
@pytest.mark.parametrize("codec, old", CASES, ids=lambda c: getattr(c, "name", ""))
def test_cuda_and_cpu_encode_decode_within_tolerance_and_decode_is_bit_identical(codec, old):
    for seed, shape in enumerate(SHAPES):
        x = _delta(shape, seed)
        cpu_fields, cpu_sent = codec.encode(x)
        gpu_fields, gpu_sent = codec.encode(x.cuda())
        assert gpu_sent.device.type == "cpu" and gpu_sent.dtype == torch.float32
        assert {k: len(v) for k, v in gpu_fields.items()} == {k: len(v) for k, v in cpu_fields.items()}
        # the same bytes decode to the same bits, whoever encoded them
        assert torch.equal(codec.decode(gpu_fields, shape), gpu_sent)
        assert torch.equal(codec.decode(dict(gpu_fields), shape), codec.decode(gpu_fields, shape))
        # the GPU's choice differs from the CPU's by device rounding only: within the codec's own error
        err = (cpu_sent - x).norm()
        assert (gpu_sent - cpu_sent).norm() <= 0.05 * err + 1e-6 * x.norm(), (codec.name, shape)
        if isinstance(codec, DenseCodec) and codec.dtype == "fp32":
            assert gpu_fields == cpu_fields


@cuda
@pytest.mark.parametrize("strategy", ["sparseloco", "dct", "diloco"])
def test_a_cuda_encoding_strategy_keeps_its_buffer_on_the_gpu_and_state_on_the_cpu(strategy):
    spec = RunSpec().replace(model={"d_model": 64, "n_layers": 1, "n_heads": 4, "ffn_hidden": 176, "seq_len": 32},
                             outer={"strategy": strategy})
    s = make_strategy(spec)
    theta = {n: torch.zeros(sh) for n, sh in spec.param_shapes().items()}
    now = {n: _delta(sh, i).cuda() for i, (n, sh) in enumerate(spec.param_shapes().items())}
    delta = pseudo_gradient(theta, now)
    assert all(t.device.type == "cuda" for t in delta.values())
    assert all(torch.equal(delta[n].cpu(), theta[n] - now[n].cpu()) for n in delta)  # Δ has the CPU's bits
    payload, pending = s.encode(delta, 0)
    s.settle(pending, True)
    decoded = make_strategy(spec).decode(payload, 0)
    assert all(torch.equal(decoded[n], pending.sent[n]) for n in decoded)
    assert all(t.device.type == "cpu" for t in s.local_state().values())
