"""The pseudo-gradient codecs: block geometry, round trips, exactness of ``sent``, compression,
and the decoders as a trust boundary (any hostile fields give PayloadError and nothing else)."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.codecs import DCTCodec, DenseCodec, SparseLoCoCodec, make_codec
from protocol.codecs import dct as dct_module
from protocol.codecs.chunking import Blocking, block_side, from_blocks, k_for_block, to_blocks
from protocol.codecs.dct import dct_basis
from protocol.codecs.fields import pack_bits, unpack_bits
from protocol.codecs.index_coding import decode_positions, encode_positions
from protocol.errors import PayloadError
from protocol.spec import RunSpec

CODECS = [
    DenseCodec("fp32"),
    DenseCodec("fp16"),
    SparseLoCoCodec(),
    SparseLoCoCodec(chunk=16, topk=8, bits=3),
    SparseLoCoCodec(chunk=8, topk=64, bits=1),
    DCTCodec(),
    DCTCodec(chunk=16, topk=5, value_dtype="fp32"),
]
SHAPES = [(), (0,), (1,), (1, 1), (0, 7), (7, 0), (5,), (64,), (67,), (131, 67), (67, 131), (3, 4, 5),
          (2, 0, 3), (128, 64), (100, 96), (352, 128), (130,)]
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple) | st.sampled_from(SHAPES)
scales = st.sampled_from([0.0, 1e-30, 1e-6, 1.0, 1e3, 1e5])  # up to ENCODE_MAX_ABS (1e6)


def sample(shape, scale, seed, kind="normal"):
    gen = torch.Generator().manual_seed(seed)
    if kind == "constant":
        return torch.full(shape, scale, dtype=torch.float32)
    return torch.randn(shape, generator=gen) * scale


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.numpy().tobytes() == b.numpy().tobytes()


def codec_id(codec):
    return codec.name


# --- chunking ---------------------------------------------------------------------------------------
def test_block_side_examples():
    assert block_side(256, 64) == 64 and block_side(128, 64) == 64
    assert block_side(352, 64) == 44
    assert block_side(67, 64) == 1 and block_side(131, 64) == 1
    assert block_side(1, 64) == 1 and block_side(0, 64) == 1 and block_side(48, 64) == 48


def test_blocking_views():
    assert Blocking.of((256, 128), 64) == Blocking(256, 128, 64, 64)
    assert Blocking.of((352,), 64) == Blocking(1, 352, 1, 44)
    assert Blocking.of((4, 6, 5), 64) == Blocking(4, 30, 4, 30)
    assert Blocking.of((), 64).nblocks == 1
    assert Blocking.of((0, 5), 64).nblocks == 0


def test_k_for_block():
    assert k_for_block(64, 64, 4096) == 64
    assert k_for_block(64, 64, 64) == 1  # a 64-element vector chunk keeps 64/4096 of 64, at least 1
    assert k_for_block(64, 64, 44 * 64) == 44
    assert k_for_block(4096, 64, 10) == 10
    assert k_for_block(1, 64, 1) == 1


@given(shape=shapes, chunk=st.integers(1, 70))
@settings(max_examples=60, deadline=None)
def test_blocks_round_trip(shape, chunk):
    x = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    blocking = Blocking.of(shape, chunk)
    blocks = blocking.split(x)
    assert blocks.shape == (blocking.nblocks, blocking.block_numel)
    assert torch.equal(blocking.join(blocks, shape), x)


@given(shape=shapes, chunk=st.integers(1, 70), data=st.data())
@settings(max_examples=60, deadline=None)
def test_scatter_is_join_of_blocks_zero_but_for_the_kept_entries(shape, chunk, data):
    blocking = Blocking.of(shape, chunk)
    n, k = blocking.block_numel, data.draw(st.integers(0, min(blocking.block_numel, 6)))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    idx = np.array([np.sort(rng.choice(n, k, replace=False)) for _ in range(blocking.nblocks)],
                   dtype=np.int64).reshape(blocking.nblocks, k)
    values = torch.from_numpy(rng.standard_normal((blocking.nblocks, k)).astype(np.float32))
    blocks = torch.zeros(blocking.nblocks, n)
    blocks.scatter_(1, torch.from_numpy(idx), values)
    got = blocking.scatter(idx, values, shape)
    assert got.shape == tuple(shape) and torch.equal(got, blocking.join(blocks, shape))


def test_blocks_are_contiguous_tiles():
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    blocks = to_blocks(x, 2, 3)
    assert blocks[0].tolist() == [0, 1, 2, 6, 7, 8]
    assert blocks[1].tolist() == [3, 4, 5, 9, 10, 11]
    assert torch.equal(from_blocks(blocks, 4, 6, 2, 3), x)


# --- bit packing ------------------------------------------------------------------------------------
@given(bits=st.integers(1, 12), data=st.data())
@settings(max_examples=40, deadline=None)
def test_pack_bits_round_trip(bits, data):
    values = np.array(data.draw(st.lists(st.integers(0, (1 << bits) - 1), max_size=50)), dtype=np.int64)
    packed = pack_bits(values, bits)
    assert len(packed) == (values.size * bits + 7) // 8
    assert np.array_equal(unpack_bits(packed, values.size, bits, "test"), values)


def test_twelve_bit_indices_pack_two_in_three_bytes():
    assert pack_bits(np.array([0xABC, 0x123]), 12) == bytes([0xBC, 0x3A, 0x12])


# --- every codec -----------------------------------------------------------------------------------
@pytest.mark.parametrize("codec", CODECS, ids=codec_id)
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_fixed_shapes(codec, shape):
    x = sample(shape, 1.0, seed=1)
    fields, sent = codec.encode(x)
    assert sent.shape == x.shape and sent.dtype == torch.float32
    assert same_bits(sent, codec.decode(fields, shape))
    assert len(msgpack.packb(fields, use_bin_type=True)) <= codec.max_encoded_bytes(shape)


@pytest.mark.parametrize("codec", CODECS, ids=codec_id)
@given(shape=shapes, scale=scales, seed=st.integers(0, 2**31), kind=st.sampled_from(["normal", "constant"]))
@settings(max_examples=25, deadline=None)
def test_sent_is_exactly_what_receivers_decode(codec, shape, scale, seed, kind):
    x = sample(shape, scale, seed, kind)
    fields, sent = codec.encode(x)
    wire = msgpack.unpackb(msgpack.packb(fields, use_bin_type=True), raw=False)
    first, second = codec.decode(wire, shape), codec.decode(wire, shape)
    assert same_bits(sent, first) and same_bits(first, second)
    assert torch.isfinite(sent).all()
    assert len(msgpack.packb(fields, use_bin_type=True)) <= codec.max_encoded_bytes(shape)
    if kind == "constant" and not isinstance(codec, DCTCodec):
        # every kept value is the same number, so every sent value is that number (fp16-rounded)
        values = sent[sent != 0]
        assert (values == values.reshape(-1)[:1]).all()


@pytest.mark.parametrize("codec", CODECS, ids=codec_id)
def test_all_zeros_decode_to_zeros(codec):
    fields, sent = codec.encode(torch.zeros(130, 64))
    assert (sent == 0).all()


@pytest.mark.parametrize("codec", CODECS, ids=codec_id)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 1e25, 2e6])
def test_encode_refuses_non_finite_or_huge(codec, bad):
    x = torch.ones(8, 8)
    x[3, 4] = bad
    with pytest.raises(ValueError):
        codec.encode(x)


@pytest.mark.parametrize("codec", CODECS, ids=codec_id)
def test_encode_refuses_other_dtypes(codec):
    with pytest.raises(TypeError):
        codec.encode(torch.ones(4, dtype=torch.float64))


# --- dense -----------------------------------------------------------------------------------------
def test_dense_fp32_is_exact_and_fp16_close():
    x = torch.randn(33, 17)
    _, sent = DenseCodec("fp32").encode(x)
    assert same_bits(sent, x)
    fields, sent16 = DenseCodec("fp16").encode(x)
    assert len(fields["data"]) == 2 * x.numel()
    assert torch.allclose(sent16, x, rtol=1e-3, atol=1e-4)


def test_dense_fp16_clamps_to_its_range():
    _, sent = DenseCodec("fp16").encode(torch.tensor([1e6, -1e6, 1.0]))
    assert sent.tolist() == [65504.0, -65504.0, 1.0]


@pytest.mark.parametrize("bad", [np.nan, np.inf, 1e31, 1e8, -3e8])
def test_dense_rejects_bad_values(bad):
    data = np.ones(4, dtype="<f4")
    data[2] = bad
    with pytest.raises(PayloadError):
        DenseCodec("fp32").decode({"data": data.tobytes()}, (4,))


# --- sparseloco ------------------------------------------------------------------------------------
def kept_positions(codec: SparseLoCoCodec, fields, shape):
    blocking = Blocking.of(shape, codec.chunk)
    k = k_for_block(codec.topk, codec.chunk, blocking.block_numel)
    return decode_positions(fields["idx"], blocking.nblocks, k, blocking.block_numel, "idx")


@pytest.mark.parametrize("shape", [(256, 128), (352, 128), (67, 131), (1000,), (3, 8, 40)])
def test_sparseloco_keeps_the_k_largest_of_each_block(shape):
    codec = SparseLoCoCodec()
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    fields, sent = codec.encode(x)
    blocking = Blocking.of(shape, codec.chunk)
    k = k_for_block(codec.topk, codec.chunk, blocking.block_numel)
    idx = torch.from_numpy(kept_positions(codec, fields, shape))
    assert idx.shape == (blocking.nblocks, k)
    assert (idx.diff(dim=1) > 0).all()  # k distinct positions per block
    mags = blocking.split(x).abs()
    kept = torch.zeros_like(mags, dtype=torch.bool).scatter_(1, idx, True)
    smallest_kept = mags.masked_fill(~kept, math.inf).amin(dim=1)
    largest_dropped = mags.masked_fill(kept, -1.0).amax(dim=1)
    assert (smallest_kept >= largest_dropped).all()
    # nothing outside the kept positions is sent
    assert (blocking.split(sent).masked_select(~kept) == 0).all()


def test_sparseloco_quantization_tracks_the_kept_values():
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(4))
    for bits, tolerance in ((2, 0.6), (4, 0.2), (8, 0.02)):
        codec = SparseLoCoCodec(bits=bits)
        _, sent = codec.encode(x)
        mask = sent != 0
        err = (sent[mask] - x[mask]).norm() / x[mask].norm()
        assert err < tolerance, (bits, float(err))
        assert (torch.sign(sent[mask]) == torch.sign(x[mask])).float().mean() > 0.95


def test_sparseloco_constant_tensor_is_sent_exactly():
    _, sent = SparseLoCoCodec().encode(torch.full((64, 64), 0.25))
    assert (sent != 0).sum() == 64 and set(sent[sent != 0].tolist()) == {0.25}


def test_sparseloco_is_over_200x_smaller_than_fp32():
    shape = (1024, 1024)
    fields, _ = SparseLoCoCodec(chunk=64, topk=64, bits=2).encode(torch.randn(shape))
    wire = len(msgpack.packb(fields, use_bin_type=True))
    ratio = 4 * math.prod(shape) / wire
    assert ratio >= 200, ratio  # 14 bits per kept entry with 12-bit positions (146x); about 9.5 now
    assert 8 * len(fields["idx"]) < 7.6 * 256 * 64 and len(fields["codes"]) == 256 * 64 // 4


def valid_sparseloco(shape=(8, 8)):
    codec = SparseLoCoCodec(chunk=8, topk=4, bits=2)
    fields, _ = codec.encode(torch.randn(shape, generator=torch.Generator().manual_seed(5)))
    return codec, dict(fields)


def test_sparseloco_indices_are_rice_coded_and_checked():
    codec, fields = valid_sparseloco()
    positions = torch.tensor([[1, 2, 3, 60]])
    codec.decode(dict(fields, idx=encode_positions(positions, 64)), (8, 8))
    # the last position pushed past the block of 64
    with pytest.raises(PayloadError, match="out of range"):
        codec.decode(dict(fields, idx=encode_positions(positions + 4, 68, r=4)), (8, 8))
    # the 12-bit positions of the former format are refused, never misread
    with pytest.raises(PayloadError, match="'idx'"):
        codec.decode(dict(fields, idx=pack_bits(np.array([1, 2, 3, 60]), 12)), (8, 8))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -1e30, 3e38, 1e8, 1e29])
def test_sparseloco_rejects_bad_lookup_tables(bad):
    codec, fields = valid_sparseloco()
    lut = np.frombuffer(fields["lut"], dtype="<f4").copy()
    lut[1] = bad
    fields["lut"] = lut.tobytes()
    with pytest.raises(PayloadError, match="lookup table"):
        codec.decode(fields, (8, 8))


def test_sparseloco_rejects_padding_bits():
    codec = SparseLoCoCodec(chunk=8, topk=1, bits=2)
    fields, _ = codec.encode(torch.randn(8, 8))
    fields = dict(fields, codes=bytes([fields["codes"][0] | 0x80]))
    with pytest.raises(PayloadError, match="padding"):
        codec.decode(fields, (8, 8))


# --- dct -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 7, 44, 64])
def test_dct_basis_is_orthonormal(n):
    d = dct_basis(n).double()
    assert torch.allclose(d @ d.T, torch.eye(n, dtype=torch.float64), atol=1e-6)
    assert dct_basis(n) is dct_basis(n)  # cached


def test_dct_coefficients_match_the_separable_transform():
    codec = DCTCodec(chunk=8)
    x = torch.randn(8, 16, dtype=torch.float32)
    coeffs = codec.coefficients(x)
    d = dct_basis(8).double()
    expected = d @ x[:, 8:].double() @ d.T  # the second block
    assert torch.allclose(coeffs[1].reshape(8, 8).double(), expected, atol=1e-5)
    constant = codec.coefficients(torch.ones(8, 8))
    assert abs(constant[0, 0] - 8.0) < 1e-5 and constant[0, 1:].abs().max() < 1e-5  # DC only


@pytest.mark.parametrize("shape", [(64, 64), (128, 192), (67, 131), (352,), (3, 8, 40), (1,), (0, 3)])
def test_dct_with_every_coefficient_round_trips(shape):
    chunk = 64
    codec = DCTCodec(chunk=chunk, topk=chunk * chunk, value_dtype="fp32")
    x = torch.randn(shape, generator=torch.Generator().manual_seed(6))
    _, sent = codec.encode(x)
    # 4096 float32 terms per entry: the error is relative to the tensor's scale
    scale = float(x.abs().max()) if x.numel() else 1.0
    assert torch.allclose(sent, x, atol=1e-5 * scale, rtol=0)


def test_dct_keeps_the_k_largest_coefficients():
    codec = DCTCodec(chunk=64, topk=32, value_dtype="fp32")
    x = torch.randn(128, 128, generator=torch.Generator().manual_seed(7))
    fields, _ = codec.encode(x)
    idx = torch.from_numpy(np.frombuffer(fields["idx"], dtype="<u2").astype(np.int64)).reshape(4, 32)
    coeffs = codec.coefficients(x)
    kept = torch.zeros_like(coeffs, dtype=torch.bool).scatter_(1, idx, True)
    assert (coeffs.abs().masked_fill(~kept, math.inf).amin(1) >= coeffs.abs().masked_fill(kept, -1).amax(1)).all()
    values = torch.from_numpy(np.frombuffer(fields["val"], dtype="<f4").copy()).reshape(4, 32)
    assert torch.equal(values, coeffs.gather(1, idx))


def test_dct_residual_loses_only_the_sent_energy():
    codec = DCTCodec(chunk=64, topk=32, value_dtype="fp32")
    x = torch.randn(128, 128, generator=torch.Generator().manual_seed(8))
    _, sent = codec.encode(x)
    # orthonormal: |x|^2 = |sent|^2 + |x - sent|^2
    total = x.double().norm() ** 2
    assert abs(total - sent.double().norm() ** 2 - (x - sent).double().norm() ** 2) / total < 1e-4


def test_dct_decode_does_not_depend_on_tiling(monkeypatch):
    codec = DCTCodec()
    x = torch.randn(256, 320, generator=torch.Generator().manual_seed(9))
    fields, sent = codec.encode(x)
    monkeypatch.setattr(dct_module, "_TILE", 64 * 64)
    assert same_bits(codec.decode(fields, x.shape), sent)


def test_dct_fp16_values_are_clamped():
    codec = DCTCodec(chunk=4, topk=1)
    fields, sent = codec.encode(torch.full((4, 4), 1e6))
    assert np.frombuffer(fields["val"], dtype="<f2").tolist() == [65504.0]
    assert torch.allclose(sent, torch.full((4, 4), 65504.0 / 4))


def test_dct_rejects_duplicates_and_out_of_range():
    codec = DCTCodec(chunk=4, topk=2, value_dtype="fp32")
    fields, _ = codec.encode(torch.randn(4, 4))
    with pytest.raises(PayloadError, match="increase strictly"):
        codec.decode(dict(fields, idx=np.array([3, 3], dtype="<u2").tobytes()), (4, 4))
    with pytest.raises(PayloadError, match="out of range"):
        codec.decode(dict(fields, idx=np.array([3, 16], dtype="<u2").tobytes()), (4, 4))
    with pytest.raises(PayloadError, match="dct values"):
        codec.decode(dict(fields, val=np.array([1, np.nan], dtype="<f4").tobytes()), (4, 4))


def test_dct_coefficients_each_in_bounds_that_add_up_past_the_bound_are_refused():
    """Every coefficient below MAX_ABS, signs aligned so k basis images add up at one entry: no real
    block gives such coefficients, and the decoded tensor must obey the bound every decoder keeps
    (found by fuzzing the codecs; each coefficient alone was checked, the sum was not)."""
    codec = DCTCodec(chunk=16, topk=256, value_dtype="fp32")
    corner = np.outer(dct_basis(16).double().numpy()[:, 0], dct_basis(16).double().numpy()[:, 0]).reshape(-1)
    idx = np.arange(256)
    vals = (9.9e7 * np.sign(corner)).astype("<f4")
    with pytest.raises(PayloadError, match="dct decoded values"):
        codec.decode({"idx": idx.astype("<u2").tobytes(), "val": vals.tobytes()}, (16, 16))
    honest, _ = codec.encode(torch.randn(16, 16).sign() * 1e6)  # the largest an encoder takes still decodes
    assert codec.decode(honest, (16, 16)).abs().max() < 1e8


# --- hostile fields ---------------------------------------------------------------------------------
def mutate(fields: dict, data) -> object:
    """One random corruption of a valid field dict."""
    keys = sorted(fields)
    how = data.draw(st.sampled_from(["flip", "truncate", "extend", "swap", "drop", "add", "type", "random"]))
    out = dict(fields)
    key = data.draw(st.sampled_from(keys))
    value = bytearray(out[key])
    if how == "flip" and value:
        pos = data.draw(st.integers(0, len(value) - 1))
        value[pos] ^= data.draw(st.integers(1, 255))
    elif how == "truncate":
        value = value[: data.draw(st.integers(0, max(0, len(value) - 1)))]
    elif how == "extend":
        value += data.draw(st.binary(min_size=1, max_size=8))
    elif how == "swap" and len(keys) > 1:
        other = data.draw(st.sampled_from([k for k in keys if k != key]))
        out[key], out[other] = out[other], out[key]
        return out
    elif how == "drop":
        del out[key]
        return out
    elif how == "add":
        out["extra"] = b""
        return out
    elif how == "type":
        out[key] = data.draw(st.sampled_from([None, 3, "text", [1, 2], {"a": 1}, 1.5]))
        return out
    elif how == "random":
        value = bytearray(data.draw(st.binary(max_size=2 * len(value) + 4)))
    out[key] = bytes(value)
    return out


@pytest.mark.parametrize("codec", CODECS, ids=codec_id)
@given(shape=st.sampled_from([(0,), (1,), (5,), (16, 16), (67, 3), (130, 64)]), data=st.data())
@FUZZ
def test_mutated_fields_give_payload_error_or_a_valid_tensor(codec, shape, data):
    fields, _ = codec.encode(torch.randn(shape, generator=torch.Generator().manual_seed(10)))
    bad = mutate(dict(fields), data)
    try:
        out = codec.decode(bad, shape)
    except PayloadError:
        return
    assert out.shape == shape and out.dtype == torch.float32 and torch.isfinite(out).all()


@pytest.mark.parametrize("codec", CODECS, ids=codec_id)
@given(garbage=st.one_of(st.none(), st.integers(), st.text(max_size=5), st.binary(max_size=20),
                         st.lists(st.binary(max_size=4), max_size=3),
                         st.dictionaries(st.text(max_size=6), st.binary(max_size=16), max_size=4)))
@settings(max_examples=20, deadline=None)
def test_garbage_fields_give_payload_error(codec, garbage):
    try:
        out = codec.decode(garbage, (4, 4))
    except PayloadError:
        return
    assert out.shape == (4, 4) and torch.isfinite(out).all()


# --- factory ---------------------------------------------------------------------------------------
def test_make_codec_follows_the_strategy():
    dense = make_codec(RunSpec().replace(outer={"strategy": "diloco", "dense_dtype": "fp16"}))
    assert isinstance(dense, DenseCodec) and dense.name == "dense-fp16"
    sparse = make_codec(RunSpec().replace(outer={"strategy": "sparseloco", "sparseloco": {"topk": 32, "bits": 3}}))
    assert isinstance(sparse, SparseLoCoCodec) and (sparse.chunk, sparse.topk, sparse.bits) == (64, 32, 3)
    dct = make_codec(RunSpec().replace(outer={"strategy": "dct", "dct": {"chunk": 32, "value_dtype": "fp32"}}))
    assert isinstance(dct, DCTCodec) and (dct.chunk, dct.topk, dct.value_dtype) == (32, 32, "fp32")
    assert isinstance(make_codec(RunSpec()), SparseLoCoCodec)  # the default strategy
