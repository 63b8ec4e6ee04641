"""Rice-coded block positions (protocol/codecs/index_coding.py): lossless round trips, sizes
against the entropy bound, the same decoded SparseLoCo values as the former 12-bit positions, and
the decoder as a trust boundary (hand-made and fuzzed fields give PayloadError or a valid result)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.codecs.chunking import select_top_k
from protocol.codecs.fields import pack_bits, unpack_bits
from protocol.codecs.index_coding import (
    decode_positions,
    encode_positions,
    entropy_bound_bits,
    max_bytes,
    max_param,
)
from protocol.codecs.sparseloco import SparseLoCoCodec
from protocol.errors import PayloadError
from protocol.wire.payload import decode_payload, encode_payload

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def random_positions(nblocks: int, k: int, n: int, seed: int) -> torch.Tensor:
    """(nblocks, k) distinct positions below n, increasing within each row."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(nblocks, n, generator=gen).topk(k, dim=1).indices.sort(dim=1).values


def round_trip(idx: torch.Tensor, n: int) -> bytes:
    data = encode_positions(idx, n)
    assert len(data) <= max_bytes(idx.shape[0], idx.shape[1], n)
    assert np.array_equal(decode_positions(data, idx.shape[0], idx.shape[1], n, "test"), idx.numpy())
    return data


# --- round trips and sizes ----------------------------------------------------------------------------
@given(nblocks=st.integers(0, 6), n=st.integers(1, 300), data=st.data())
@FUZZ
def test_any_sorted_positions_round_trip(nblocks, n, data):
    k = data.draw(st.integers(1, n))
    kind = data.draw(st.sampled_from(["random", "first", "last", "spread"]))
    if kind == "random":
        idx = random_positions(nblocks, k, n, data.draw(st.integers(0, 2**31)))
    elif kind == "first":  # every gap zero
        idx = torch.arange(k).repeat(nblocks, 1)
    elif kind == "last":  # one gap of n - k: the longest unary run
        idx = torch.arange(n - k, n).repeat(nblocks, 1)
    else:
        idx = (torch.arange(k) * (n // k)).repeat(nblocks, 1)
    round_trip(idx.reshape(nblocks, k), n)


@pytest.mark.parametrize("nblocks, k, n", [(1, 64, 4096), (3, 1, 64), (2, 4096, 4096), (5, 1, 1), (4, 44, 2816), (0, 3, 10)])
def test_edge_geometries_round_trip(nblocks, k, n):
    for seed in range(3):
        round_trip(random_positions(nblocks, k, n, seed), n)
    round_trip(torch.arange(n - k, n).repeat(nblocks, 1).reshape(nblocks, k), n)


def test_64_of_4096_costs_near_the_entropy_bound():
    nblocks, k, n = 2048, 64, 4096
    data = round_trip(random_positions(nblocks, k, n, 0), n)
    bits = 8 * len(data) / (nblocks * k)
    bound = entropy_bound_bits(n, k) / k
    assert data[0] == 5  # the Rice parameter the encoder chose
    assert bound < bits < 1.025 * bound and bits < 7.6, (bits, bound)  # 7.49 against 7.36; 12 before
    # the worst case stays below a plain 12-bit position too
    assert 8 * max_bytes(nblocks, k, n) / (nblocks * k) < 8.0


@pytest.mark.parametrize("k, r", [(16, 7), (32, 6), (128, 4), (512, 2)])
def test_the_parameter_follows_the_density(k, r):
    data = round_trip(random_positions(256, k, 4096, 1), 4096)
    assert data[0] == r


def test_clustered_positions_get_a_small_parameter():
    idx = torch.arange(64).repeat(8, 1) + torch.arange(8)[:, None] * 3  # 64 neighbours per block
    assert round_trip(idx, 4096)[0] == 0


def test_encode_refuses_unsorted_or_duplicate_positions():
    for bad in ([[3, 2]], [[2, 2]], [[0, 16]]):
        with pytest.raises(ValueError, match="increase strictly"):
            encode_positions(torch.tensor(bad), 16)


# --- the decoded values are those of the 12-bit format -------------------------------------------
class TwelveBitSparseLoCo(SparseLoCoCodec):
    """The former wire format, frozen: the same top-k and quantizer, each position in 12 bits."""

    def __init__(self, chunk=64, topk=64, bits=2):
        super().__init__(chunk, topk, bits)
        self.name = f"sparseloco-c{chunk}-k{topk}-b{bits}"  # the former codec's name

    def encode(self, x):
        blocking, k = self._geometry(tuple(x.shape))
        idx, kept = select_top_k(blocking.split(x), k)
        codes, lut = self._quantize(kept)
        fields = {"idx": pack_bits(idx.numpy(), 12), "codes": pack_bits(codes.numpy(), self.bits),
                  "lut": lut.numpy().astype("<f4").tobytes()}
        return fields, self.decode(fields, tuple(x.shape))

    def decode(self, fields, shape):
        blocking, k = self._geometry(shape)
        count = blocking.nblocks * k
        lut = np.frombuffer(fields["lut"], dtype="<f4")
        idx = unpack_bits(fields["idx"], count, 12, "idx").reshape(blocking.nblocks, k)
        values = torch.from_numpy(lut[unpack_bits(fields["codes"], count, self.bits, "codes")].reshape(blocking.nblocks, k))
        dense = torch.zeros(blocking.nblocks, blocking.block_numel).scatter_(1, torch.from_numpy(idx), values)
        return blocking.join(dense, shape)


@pytest.mark.parametrize("params", [(64, 64, 2), (16, 8, 3), (8, 64, 1), (64, 32, 4), (64, 4096, 2)])
@pytest.mark.parametrize("shape", [(256, 128), (1024, 64), (352, 128), (67, 131), (130,), (1000,), (352,), (64,),
                                   (3, 8, 40), (7, 13), (1,), (), (0, 5)])
def test_decoded_values_are_bit_identical_to_the_12_bit_format(params, shape):
    new, old = SparseLoCoCodec(*params), TwelveBitSparseLoCo(*params)
    for seed in range(2):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 10.0 ** (seed - 3)
        fields, sent = new.encode(x)
        decoded = new.decode(msgpack.unpackb(msgpack.packb(fields), raw=False), shape)
        old_fields, expected = old.encode(x)
        assert decoded.numpy().tobytes() == expected.numpy().tobytes() == sent.numpy().tobytes()
        assert fields["codes"] == old_fields["codes"] and fields["lut"] == old_fields["lut"]
        blocking, k = new._geometry(shape)  # and the same positions, zero values or not
        assert np.array_equal(decode_positions(fields["idx"], blocking.nblocks, k, blocking.block_numel, "new"),
                              unpack_bits(old_fields["idx"], blocking.nblocks * k, 12, "old").reshape(blocking.nblocks, k))


def test_a_payload_of_the_12_bit_format_is_refused_by_its_codec_name():
    layout = {"w": (128, 64), "b": (64,)}
    tensors = {name: torch.randn(shape) for name, shape in layout.items()}
    data, _ = encode_payload(TwelveBitSparseLoCo(), tensors, run_digest="r", round=1, steps=1)
    with pytest.raises(PayloadError, match="codec 'sparseloco-c64-k64-b2', not 'sparseloco-rice-c64-k64-b2'"):
        decode_payload(data, SparseLoCoCodec(), layout, run_digest="r", round=1)


# --- a strict decoder ------------------------------------------------------------------------------
def rice(r: int, gaps, n_pad_bytes: int = 0) -> bytes:
    """A field written by hand: parameter r, the gaps' low bits, their unary high parts."""
    gaps = np.asarray(gaps, dtype=np.int64)
    ends = np.cumsum((gaps >> r) + 1) - 1
    bits = np.zeros((int(ends[-1]) // 8 + 1 + n_pad_bytes) * 8, dtype=np.uint8)
    bits[ends] = 1
    return bytes([r]) + pack_bits(gaps & ((1 << r) - 1), r) + np.packbits(bits, bitorder="little").tobytes()


def decode(data, nblocks=2, k=2, n=16):
    return decode_positions(data, nblocks, k, n, "test")


def test_hand_made_field_decodes():
    assert decode(rice(2, [0, 3, 5, 0])).tolist() == [[0, 4], [5, 6]]


@pytest.mark.parametrize("data, match", [
    (b"", "expected 1 to"),
    (bytes([5]) + bytes(64), "expected 1 to"),  # above the shape's bound
    (bytes([max_param(16, 2) + 1]) + bytes(3), "Rice parameter"),
    (bytes([255, 1]), "Rice parameter"),
    (rice(2, [0, 3, 5, 0])[:2], "truncated"),  # the low bits cut short, no unary stream
    (rice(2, [0, 3, 5]), "holds 3 codes, expected 4"),  # a unary code missing
    (bytes([2, 0b0001_1100, 0b1_1111]), "holds 5 codes, expected 4"),  # one code too many
    (rice(2, [0, 3, 5, 0], n_pad_bytes=1), "after its last code"),  # a trailing byte
    (rice(0, [0, 15, 0, 0]), "overruns"),  # a unary run no block of 16 holds
    (rice(2, [9, 6, 0, 0]), "out of range"),  # 9, then 16: past the block
    (rice(4, [15, 0, 0, 0]), "out of range"),  # 15, then 16
    (bytes([1, 0b0001_0000]) + rice(1, [0, 0, 0, 0])[2:], "padding"),  # non-zero padding of the low bits
])
def test_decoder_rejects(data, match):
    with pytest.raises(PayloadError, match=match):
        decode(data)


def test_a_field_longer_than_the_shape_allows_is_refused_before_it_is_read():
    nblocks, k, n = 4, 64, 4096
    limit = max_bytes(nblocks, k, n)
    valid = round_trip(random_positions(nblocks, k, n, 3), n)
    with pytest.raises(PayloadError, match=f"expected 1 to {limit}"):
        decode_positions(valid + b"\x00" * (limit + 1 - len(valid)), nblocks, k, n, "test")
    # the worst case of 64 of 4096 (every block's positions at its end) fits, with the best r
    worst = torch.arange(n - k, n).repeat(nblocks, 1)
    assert len(round_trip(worst, n)) <= limit
    assert len(encode_positions(worst, n, r=0)) > limit  # a poor r is refused: no encoder sends one


def test_an_empty_tensor_takes_one_byte_only():
    assert decode_positions(b"\x00", 0, 5, 7, "t").shape == (0, 5)
    with pytest.raises(PayloadError):
        decode_positions(b"\x00\x01", 0, 5, 7, "t")


@given(seed=st.integers(0, 2**31), geometry=st.sampled_from([(4, 64, 4096), (12, 1, 64), (3, 7, 100), (2, 16, 16)]),
       data=st.data())
@FUZZ
def test_mutated_fields_give_payload_error_or_valid_positions(seed, geometry, data):
    nblocks, k, n = geometry
    valid = bytearray(encode_positions(random_positions(nblocks, k, n, seed), n))
    how = data.draw(st.sampled_from(["flip", "bit", "truncate", "extend", "insert", "delete", "random"]))
    pos = data.draw(st.integers(0, len(valid) - 1))
    if how == "flip":
        valid[pos] ^= data.draw(st.integers(1, 255))
    elif how == "bit":
        valid[pos] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "truncate":
        del valid[pos:]
    elif how == "extend":
        valid += data.draw(st.binary(min_size=1, max_size=16))
    elif how == "insert":
        valid[pos:pos] = data.draw(st.binary(min_size=1, max_size=4))
    elif how == "delete":
        del valid[pos:pos + data.draw(st.integers(1, 4))]
    else:
        valid = bytearray(data.draw(st.binary(max_size=len(valid) + 8)))
    try:
        out = decode_positions(bytes(valid), nblocks, k, n, "fuzz")
    except PayloadError:
        return
    assert out.shape == (nblocks, k) and out.dtype == np.int64
    assert (out >= 0).all() and (out < n).all() and (np.diff(out, axis=1) > 0).all()
    assert encode_positions(torch.from_numpy(out), n, r=valid[0]) == bytes(valid)  # one field per positions and r
