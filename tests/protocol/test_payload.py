"""The round payload: round trips, header and layout validation, and fuzzing of the whole
container (random bytes, mutated valid payloads) that must give PayloadError and nothing else."""

from __future__ import annotations

import functools

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import PROTOCOL_VERSION
from protocol.codecs import DCTCodec, DenseCodec, SparseLoCoCodec
from protocol.errors import PayloadError
from protocol.wire.payload import decode_claimed_payload, decode_payload, encode_payload, payload_max_bytes

LAYOUT = {"embed.weight": (67, 16), "blocks.0.attn.qkv.weight": (48, 16), "blocks.0.attn_norm.weight": (16,),
          "scalar": (), "empty": (0, 4)}
CODECS = [DenseCodec("fp32"), DenseCodec("fp16"), SparseLoCoCodec(), DCTCodec()]
RUN, ROUND = "0123456789abcdef", 7
FUZZ = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def tensors(layout=LAYOUT, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name, shape in layout.items()}


def encoded(codec, layout=LAYOUT):
    return encode_payload(codec, tensors(layout), run_digest=RUN, round=ROUND, steps=1)


@functools.lru_cache(maxsize=None)
def valid_payload(codec) -> bytes:
    return encoded(codec)[0]


def decode(data, codec, layout=LAYOUT, **kw):
    kw = {"run_digest": RUN, "round": ROUND, **kw}
    return decode_payload(data, codec, layout, **kw)


def repack(data: bytes, change) -> bytes:
    message = msgpack.unpackb(data, raw=False)
    change(message)
    return msgpack.packb(message, use_bin_type=True)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.numpy().tobytes() == b.numpy().tobytes()


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_round_trip_returns_what_was_sent(codec):
    data, sent = encoded(codec)
    assert list(sent) == list(LAYOUT)
    assert len(data) <= payload_max_bytes(codec, LAYOUT)
    out = decode(data, codec)
    assert list(out) == list(LAYOUT)
    for name, shape in LAYOUT.items():
        assert out[name].shape == shape and same_bits(out[name], sent[name])
    again = decode(data, codec)
    assert all(same_bits(again[n], out[n]) for n in LAYOUT)


def test_wire_format():
    data, _ = encoded(DenseCodec("fp32"), {"a": (2,)})
    message = msgpack.unpackb(data, raw=False)
    assert message["v"] == PROTOCOL_VERSION and message["run"] == RUN and message["round"] == ROUND
    assert message["codec"] == "dense-fp32" and message["t"][0][0] == "a" and set(message["t"][0][1]) == {"data"}


def test_a_subset_layout_is_enough():
    owned = {"blocks.0.attn.qkv.weight": (48, 16)}
    data, sent = encoded(SparseLoCoCodec(), owned)
    assert list(decode(data, SparseLoCoCodec(), owned)) == list(owned)
    with pytest.raises(PayloadError, match="missing"):
        decode(data, SparseLoCoCodec(), LAYOUT)


def test_empty_layout():
    data, sent = encoded(SparseLoCoCodec(), {})
    assert sent == {} and decode(data, SparseLoCoCodec(), {}) == {}


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"run_digest": "fedcba9876543210"}, "run"),
        ({"round": ROUND + 1}, "round"),
        ({"max_bytes": 100}, "exceeds"),
    ],
)
def test_header_checks(kw, match):
    data, _ = encoded(SparseLoCoCodec())
    with pytest.raises(PayloadError, match=match):
        decode(data, SparseLoCoCodec(), **kw)


def test_the_steps_a_payload_claims_are_checked():
    data, _ = encode_payload(SparseLoCoCodec(), tensors(), run_digest=RUN, round=ROUND, steps=12)
    layouts = lambda part: LAYOUT if part == -1 else None  # noqa: E731
    claimed = functools.partial(decode_claimed_payload, codec=SparseLoCoCodec(), layouts=layouts, run_digest=RUN,
                                round=ROUND, max_bytes=1 << 20)
    assert claimed(data, max_steps=12)[:2] == (-1, 12)
    for steps, bound in ((0, None), (-3, None), (True, None), (1.5, None), ("12", None), (None, None), (13, 12)):
        with pytest.raises(PayloadError, match="inner steps"):
            claimed(repack(data, lambda m: m.update(steps=steps)), max_steps=bound)
    with pytest.raises(PayloadError, match="inner steps"):
        decode(repack(data, lambda m: m.update(steps=0)), SparseLoCoCodec())
    with pytest.raises(PayloadError, match="keys"):
        decode(repack(data, lambda m: m.pop("steps")), SparseLoCoCodec())  # a payload of protocol version 1
    with pytest.raises(ValueError):
        encode_payload(SparseLoCoCodec(), tensors(), run_digest=RUN, round=ROUND, steps=0)


def test_wrong_codec_is_rejected():
    data, _ = encoded(SparseLoCoCodec())
    with pytest.raises(PayloadError, match="codec"):
        decode(data, SparseLoCoCodec(topk=32), max_bytes=1 << 20)
    with pytest.raises(PayloadError, match="codec"):
        decode(data, DCTCodec(), max_bytes=1 << 20)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda m: m.update(v=PROTOCOL_VERSION + 1), "version"),
        (lambda m: m.update(v=True), "version"),
        (lambda m: m.update(v="1"), "version"),
        (lambda m: m.update(round=float(ROUND)), "round"),
        (lambda m: m.update(round=True), "round"),
        (lambda m: m.update(extra=1), "keys"),
        (lambda m: m.pop("codec"), "keys"),
        (lambda m: m.update(t={"a": 1}), "list"),
        (lambda m: m["t"].append("x"), "pair"),
        (lambda m: m["t"].__setitem__(0, [1, {}]), "pair"),
        (lambda m: m["t"].__setitem__(0, [m["t"][0][0], {}, 3]), "pair"),
        (lambda m: m["t"].pop(1), "missing"),
        (lambda m: m["t"].append(["intruder", {}]), "extra"),
        (lambda m: m["t"].append(m["t"][0]), "duplicated"),
        (lambda m: m["t"].reverse(), "out of order"),
        (lambda m: m["t"][0].__setitem__(1, m["t"][1][1]), "embed.weight"),
        (lambda m: m["t"][1][1].update(idx=m["t"][1][1]["codes"]), "qkv"),
    ],
)
def test_structural_errors(change, match):
    data, _ = encoded(SparseLoCoCodec())
    with pytest.raises(PayloadError, match=match):
        decode(repack(data, change), SparseLoCoCodec())


@pytest.mark.parametrize("data", [None, "text", 3, [b"x"], memoryview(b"\x80")])
def test_not_bytes(data):
    with pytest.raises(PayloadError, match="bytes"):
        decode(data, SparseLoCoCodec())


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x92\x01", b"\x81\xa1v", msgpack.packb([1, 2]),
                                  msgpack.packb({1: 2}), msgpack.packb({"v": 1}) + b"\x00", b"\x91" * 5000])
def test_not_a_payload(data):
    with pytest.raises(PayloadError):
        decode(data, SparseLoCoCodec())


def test_default_size_limit_follows_the_layout():
    codec = SparseLoCoCodec()
    data, _ = encoded(codec)
    padded = repack(data, lambda m: m.update(run=m["run"] + "x" * payload_max_bytes(codec, LAYOUT)))
    with pytest.raises(PayloadError, match="exceeds"):
        decode(padded, codec)


# --- fuzzing ---------------------------------------------------------------------------------------
def decode_or_payload_error(data, codec):
    try:
        out = decode(data, codec, max_bytes=1 << 20)
    except PayloadError:
        return
    assert list(out) == list(LAYOUT)
    for name, shape in LAYOUT.items():
        assert out[name].shape == shape and torch.isfinite(out[name]).all()


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
@given(data=st.binary(max_size=300))
@FUZZ
def test_random_bytes(codec, data):
    decode_or_payload_error(data, codec)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
@given(data=st.data())
@FUZZ
def test_mutated_bytes(codec, data):
    raw = bytearray(valid_payload(codec))
    how = data.draw(st.sampled_from(["flip", "truncate", "extend", "splice"]))
    if how == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
    elif how == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif how == "extend":
        raw += data.draw(st.binary(min_size=1, max_size=16))
    else:
        at = data.draw(st.integers(0, len(raw)))
        raw[at:at] = data.draw(st.binary(min_size=1, max_size=16))
    decode_or_payload_error(bytes(raw), codec)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=32),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
@given(data=st.data())
@FUZZ
def test_mutated_structure(codec, data):
    message = msgpack.unpackb(valid_payload(codec), raw=False)
    entry = data.draw(st.integers(0, len(LAYOUT) - 1))
    how = data.draw(st.sampled_from(["header", "entry", "fields", "field", "swap"]))
    value = data.draw(msgpack_values)
    if how == "header":
        message[data.draw(st.sampled_from(sorted(message)))] = value
    elif how == "entry":
        message["t"][entry] = value
    elif how == "fields":
        message["t"][entry][1] = value
    elif how == "field" and message["t"][entry][1]:
        message["t"][entry][1][data.draw(st.sampled_from(sorted(message["t"][entry][1])))] = value
    else:
        other = data.draw(st.integers(0, len(LAYOUT) - 1))
        message["t"][entry][1], message["t"][other][1] = message["t"][other][1], message["t"][entry][1]
    decode_or_payload_error(msgpack.packb(message, use_bin_type=True), codec)
