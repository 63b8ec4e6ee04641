"""Stage-to-stage wire frames: round trips, stream reassembly, hostile bytes, the handshake."""

from __future__ import annotations

import struct

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.errors import FrameError
from protocol.chain.frames import (
    LINK_VERSION,
    Activations,
    Bye,
    Close,
    FrameDecoder,
    FrameFormat,
    Grads,
    Hello,
    HelloOk,
    Reject,
    check_hello,
    decode_body,
    encode_frame,
)
from protocol.spec import RunSpec

SPEC = RunSpec(run_id="frames").replace(model=dict(d_model=32, n_heads=2, ffn_hidden=88, seq_len=8, n_layers=2), data={"batch_size": 4})
FMT = FrameFormat.for_run(SPEC, micro_batch=2, k=8)
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def activations(b=2, dtype=torch.float16, mb=3, step=7, fmt=FMT, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, fmt.vocab_size, (b, fmt.seq_len), generator=g)
    return Activations(mb, step, tokens, torch.randn(b, fmt.seq_len, fmt.k, generator=g).to(dtype))


def grads(b=2, dtype=torch.bfloat16, mb=3, step=7):
    return Grads(mb, step, torch.randn(b, FMT.seq_len, FMT.k).to(dtype))


HELLO = Hello(run=SPEC.digest(), chain="ch-0123456789abcdef", stage=1, round=5, role="upstream")
SIMPLE = [HELLO, HelloOk(), Reject("wrong round"), Reject(""), Close(12), Bye()]


def same(a, b):
    assert type(a) is type(b)
    if isinstance(a, (Activations, Grads)):
        assert (a.mb, a.step) == (b.mb, b.step)
        assert b.values.dtype == a.values.dtype and torch.equal(b.values, a.values)
        if isinstance(a, Activations):
            assert b.tokens.dtype == torch.int64 and torch.equal(b.tokens, a.tokens)
    else:
        assert a == b


def stream(frames, fmt=FMT):
    return b"".join(encode_frame(f, fmt) for f in frames)


def body(msg):
    return msgpack.packb(msg, use_bin_type=True)


def framed(msg):
    raw = body(msg)
    return struct.pack(">I", len(raw)) + raw


def wire(frame):
    """A frame's msgpack map, to mutate."""
    return msgpack.unpackb(encode_frame(frame, FMT)[4:], raw=False)


# --- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("frame", SIMPLE, ids=lambda f: type(f).__name__)
def test_simple_frames_round_trip(frame):
    assert FrameDecoder(FMT).feed(encode_frame(frame)) == [frame]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b", [1, 2])
def test_tensor_frames_round_trip(dtype, b):
    for frame in (activations(b, dtype), grads(b, dtype)):
        (out,) = FrameDecoder(FMT).feed(encode_frame(frame, FMT))
        same(frame, out)
        assert out.values.shape == (b, FMT.seq_len, FMT.k)


@pytest.mark.parametrize("vocab, width", [(256, 1), (300, 2), (65536, 2), (70000, 4)])
def test_token_ids_use_the_vocabulary_width(vocab, width):
    fmt = FrameFormat(micro_batch=2, seq_len=8, k=4, d_model=16, vocab_size=vocab)
    frame = activations(fmt=fmt)
    frame = Activations(1, 1, torch.full((2, 8), vocab - 1), frame.values)
    msg = msgpack.unpackb(encode_frame(frame, fmt)[4:], raw=False)
    assert len(msg["tokens"]) == 2 * 8 * width
    (out,) = FrameDecoder(fmt).feed(encode_frame(frame, fmt))
    same(frame, out)


def test_bytes_per_token_match_the_activation_codec():
    fmt = FrameFormat.for_run(RunSpec().replace(model=dict(d_model=1024, n_heads=8, ffn_hidden=2816, vocab_size=50000, seq_len=16)), micro_batch=1, k=160)
    frame = Activations(0, 0, torch.zeros(1, 16, dtype=torch.long), torch.zeros(1, 16, 160, dtype=torch.float16))
    raw = encode_frame(frame, fmt)
    # bytes per token (docs/chains.md): 160 fp16 values + a 2-byte token id (vocabulary 50,000) = 322
    payload = 16 * 322
    assert payload < len(raw) < payload + 80


def test_largest_frame_fits_the_limit():
    fmt = FrameFormat.for_run(SPEC, micro_batch=4)  # k = d_model, fp32: the largest allowed
    frame = Activations(2**62 - 1, 2**62 - 1, torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8, 32))
    raw = encode_frame(frame, fmt)
    assert len(raw) - 4 <= fmt.max_frame_bytes
    assert len(FrameDecoder(fmt).feed(raw)) == 1
    assert fmt.max_frame_bytes == 4 * 8 * 32 * 4 + 4 * 8 * 4 + 1024


def test_encode_refuses_local_mistakes():
    with pytest.raises(TypeError):
        encode_frame(activations())  # activations need the format
    with pytest.raises(ValueError, match="shape"):
        encode_frame(activations(b=3), FMT)  # more sequences than the micro-batch
    with pytest.raises(ValueError):
        encode_frame(Grads(0, 0, torch.zeros(2, 8, 8, dtype=torch.float64)))
    with pytest.raises(ValueError):
        encode_frame(Activations(0, 0, torch.zeros(2, 7, dtype=torch.long), torch.zeros(2, 8, 8)), FMT)
    with pytest.raises(TypeError):
        encode_frame({"t": "bye"})
    with pytest.raises(ValueError):
        FrameFormat.for_run(SPEC, k=33)
    with pytest.raises(ValueError):
        FrameFormat(micro_batch=0, seq_len=8, k=4, d_model=16, vocab_size=256)


# --- stream reassembly -------------------------------------------------------------------------


MIXED = [HELLO, activations(seed=1), grads(), activations(b=1, dtype=torch.bfloat16, seed=2), Reject("x" * 40), Bye()]
MIXED_BYTES = stream(MIXED)


@FAST
@given(st.lists(st.integers(0, len(MIXED_BYTES)), max_size=12))
def test_any_split_points_give_the_same_frames(cuts):
    decoder, out, last = FrameDecoder(FMT), [], 0
    for cut in sorted(cuts) + [len(MIXED_BYTES)]:
        out += decoder.feed(MIXED_BYTES[last:cut])
        last = cut
    assert len(out) == len(MIXED) and decoder.buffered == 0
    for a, b in zip(MIXED, out):
        same(a, b)


def test_byte_by_byte():
    decoder = FrameDecoder(FMT)
    out = [f for i in range(len(MIXED_BYTES)) for f in decoder.feed(MIXED_BYTES[i : i + 1])]
    assert [type(f) for f in out] == [type(f) for f in MIXED]


# --- hostile bytes -----------------------------------------------------------------------------


def feed_all(data, chunk=None):
    """Feed bytes; only FrameError may escape, and frames that come out are well-formed."""
    decoder = FrameDecoder(FMT)
    try:
        pieces = [data] if chunk is None else [data[i : i + chunk] for i in range(0, len(data), chunk)]
        frames = [f for p in pieces for f in decoder.feed(p)]
    except FrameError:
        return None
    for f in frames:
        if isinstance(f, (Activations, Grads)):
            assert f.values.shape[1:] == (FMT.seq_len, FMT.k) and 1 <= f.values.shape[0] <= FMT.micro_batch
            assert bool(torch.isfinite(f.values).all())
        if isinstance(f, Activations):
            assert f.tokens.shape == f.values.shape[:2] and int(f.tokens.min()) >= 0 and int(f.tokens.max()) < FMT.vocab_size
    return frames


@FAST
@given(st.binary(max_size=300))
def test_random_bytes_raise_only_frame_error(data):
    feed_all(data)
    feed_all(struct.pack(">I", len(data)) + data)


@FAST
@given(st.data())
def test_mutated_frames_raise_only_frame_error(data):
    raw = bytearray(MIXED_BYTES)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "set", "cut", "insert"]))
        pos = data.draw(st.integers(0, len(raw) - 1))
        if op == "flip":
            raw[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "set":
            raw[pos] = data.draw(st.integers(0, 255))
        elif op == "cut":
            del raw[pos : pos + data.draw(st.integers(1, 16))]
        else:
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
        if not raw:
            return
    feed_all(bytes(raw), chunk=data.draw(st.sampled_from([None, 1, 7, 100])))


MSG_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20) | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@FAST
@given(st.sampled_from(MIXED), st.data())
def test_fields_replaced_by_arbitrary_values_raise_only_frame_error(frame, data):
    msg = wire(frame)
    key = data.draw(st.sampled_from(sorted(msg) + ["extra"]))
    msg[key] = data.draw(MSG_VALUES)
    feed_all(framed(msg))


def test_mutated_float_payloads_are_checked():
    # NaN and inf injected into otherwise valid tensor frames, in every wire dtype
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for bad in (float("nan"), float("inf"), float("-inf")):
            for frame in (activations(dtype=dtype), grads(dtype=dtype)):
                values = frame.values.clone()
                values[1, 3, 5] = bad
                msg = wire(frame)
                msg["data"] = values.contiguous().view(torch.uint8).numpy().tobytes()
                with pytest.raises(FrameError, match="non-finite"):
                    FrameDecoder(FMT).feed(framed(msg))


def mutate(frame, **changes):
    msg = wire(frame)
    for k, v in changes.items():
        if v is DELETE:
            del msg[k]
        else:
            msg[k] = v
    return framed(msg)


DELETE = object()
ACT = activations()
ACT_TOKENS = len(wire(ACT)["tokens"])


@pytest.mark.parametrize(
    "raw, match",
    [
        (mutate(ACT, shape=[2, 8, 9]), "shape"),
        (mutate(ACT, shape=[3, 8, 8]), "shape"),
        (mutate(ACT, shape=[0, 8, 8]), "shape"),
        (mutate(ACT, shape=[2, 7, 8]), "shape"),
        (mutate(ACT, shape=[2, 8]), "shape"),
        (mutate(ACT, shape=[2, 8, 8.0]), "shape"),
        (mutate(ACT, shape="2x8x8"), "shape"),
        (mutate(ACT, shape=[1, 8, 8]), "data must be"),  # the data is for two sequences
        (mutate(ACT, dtype="fp64"), "dtype"),
        (mutate(ACT, dtype=1), "dtype"),
        (mutate(ACT, dtype="fp32"), "data must be"),  # fp16 bytes read as fp32: wrong length
        (mutate(ACT, data=b"\x00" * 10), "data must be"),
        (mutate(ACT, data="text"), "data must be"),
        (mutate(ACT, tokens=b"\x00" * (ACT_TOKENS - 1)), "tokens must be"),
        (mutate(ACT, tokens=None), "tokens must be"),
        (mutate(ACT, mb=-1), "'mb'"),
        (mutate(ACT, mb=True), "'mb'"),
        (mutate(ACT, mb=1.0), "'mb'"),
        (mutate(ACT, step=2**63), "'step'"),
        (mutate(ACT, step="7"), "'step'"),
        (mutate(ACT, mb=DELETE), "missing"),
        (mutate(ACT, extra=1), "unexpected"),
        (mutate(ACT, t="activation"), "unknown frame type"),
        (mutate(ACT, t=None), "unknown frame type"),
        (mutate(grads(), tokens=b""), "unexpected"),
        (mutate(HELLO, stage=-1), "'stage'"),
        (mutate(HELLO, round=None), "'round'"),
        (mutate(HELLO, v="1"), "'v'"),
        (mutate(HELLO, run=b"digest"), "'run'"),
        (mutate(HELLO, chain=""), "'chain'"),
        (mutate(HELLO, chain="c" * 200), "'chain'"),
        (mutate(HELLO, role=DELETE), "missing"),
        (mutate(Reject("x"), reason=5), "'reason'"),
        (mutate(Reject("x"), reason="r" * 600), "'reason'"),
        (mutate(Bye(), reason="done"), "unexpected"),
        (mutate(Close(3), step=-1), "'step'"),
        (mutate(Close(3), step=2**62), "'step'"),
        (mutate(Close(3), step=True), "'step'"),
        (mutate(Close(3), step=DELETE), "missing"),
        (mutate(Close(3), mb=0), "unexpected"),
        (framed([1, 2, 3]), "must be a map"),
        (framed({1: 2}), "not valid msgpack"),  # non-string keys
        (framed(msgpack.ExtType(1, b"x")), "not valid msgpack"),
        (struct.pack(">I", 3) + b"\xa3\xff\xfe\xfd", "not valid msgpack"),  # 3 bytes of invalid utf-8
        (struct.pack(">I", 2) + b"\x81\xa1", "not valid msgpack"),  # truncated inside the frame
        (struct.pack(">I", 2) + b"\xc0\xc0", "not valid msgpack"),  # two objects in one frame
        (struct.pack(">I", 1) + b"\xc1", "not valid msgpack"),  # a reserved byte
        (struct.pack(">I", 0), "empty frame"),
    ],
)
def test_malformed_frames(raw, match):
    with pytest.raises(FrameError, match=match):
        FrameDecoder(FMT).feed(raw)


def test_token_ids_out_of_range():
    fmt = FrameFormat.for_run(SPEC.replace(model={"vocab_size": 300}), micro_batch=2, k=8)
    frame = activations(fmt=fmt)
    msg = msgpack.unpackb(encode_frame(frame, fmt)[4:], raw=False)
    ids = frame.tokens.clone()
    ids[0, 0] = 300  # fits the 2-byte width, not the vocabulary
    msg["tokens"] = ids.numpy().astype("<u2").tobytes()
    with pytest.raises(FrameError, match="token ids"):
        FrameDecoder(fmt).feed(framed(msg))
    wide = FrameFormat(micro_batch=2, seq_len=8, k=8, d_model=32, vocab_size=70000)
    msg = msgpack.unpackb(encode_frame(Activations(0, 0, torch.zeros(2, 8, dtype=torch.long), frame.values), wide)[4:], raw=False)
    msg["tokens"] = b"\xff\xff\xff\xff" + msg["tokens"][4:]  # -1 as int32
    with pytest.raises(FrameError, match="token ids"):
        FrameDecoder(wide).feed(framed(msg))


def test_oversized_length_is_rejected_before_its_body():
    decoder = FrameDecoder(FMT)
    assert decoder.feed(struct.pack(">I", FMT.max_frame_bytes)[:3]) == []
    with pytest.raises(FrameError, match="exceeds the limit"):
        decoder.feed(struct.pack(">I", FMT.max_frame_bytes + 1)[3:])
    assert decoder.buffered == 0
    with pytest.raises(FrameError, match="already failed"):  # the stream lost its framing
        decoder.feed(encode_frame(Bye()))
    # a bad prefix fails the whole feed, frames in front of it included: the link is dropped
    decoder = FrameDecoder(FMT)
    with pytest.raises(FrameError):
        decoder.feed(encode_frame(Bye()) + b"\xff\xff\xff\xff")
    # the limit applies as soon as the four prefix bytes are in, however little body follows
    with pytest.raises(FrameError):
        FrameDecoder(FMT).feed(struct.pack(">I", 2**32 - 1) + b"\x80")


def test_a_frame_at_the_limit_waits_for_its_body():
    decoder = FrameDecoder(FMT)
    assert decoder.feed(struct.pack(">I", FMT.max_frame_bytes) + b"\x00" * 100) == []
    assert decoder.buffered == 104


def test_decode_body_alone():
    assert decode_body(body({"t": "bye"}), FMT) == Bye()
    with pytest.raises(FrameError):
        decode_body(b"", FMT)


# --- handshake ---------------------------------------------------------------------------------


EXPECT = dict(run_digest=SPEC.digest(), chain_id="ch-0123456789abcdef", stage=1, round=5, role="upstream")


def test_check_hello_accepts_the_expected_neighbour():
    (frame,) = FrameDecoder(FMT).feed(encode_frame(HELLO))
    assert check_hello(frame, **EXPECT) == HELLO
    assert HELLO.version == LINK_VERSION


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(version=LINK_VERSION + 1), "protocol version"),
        (dict(version=1), "protocol version 1 is not 2"),  # a stage of before the close frame
        (dict(run="0000000000000000"), "run spec"),
        (dict(chain="ch-ffffffffffffffff"), "chain"),
        (dict(stage=2), "stage 2"),
        (dict(role="downstream"), "downstream"),
        (dict(role="sideways"), "unknown role"),
        (dict(round=4), "round 4"),
    ],
)
def test_check_hello_rejects_with_a_reason(change, match):
    fields = dict(run=HELLO.run, chain=HELLO.chain, stage=HELLO.stage, round=HELLO.round, role=HELLO.role, version=HELLO.version)
    fields.update(change)
    (frame,) = FrameDecoder(FMT).feed(encode_frame(Hello(**fields)))
    with pytest.raises(FrameError, match=match) as info:
        check_hello(frame, **EXPECT)
    # the reason fits a reject frame and survives the trip
    (reject,) = FrameDecoder(FMT).feed(encode_frame(Reject(str(info.value))))
    assert reject.reason == str(info.value)


@pytest.mark.parametrize("frame", [HelloOk(), Bye(), Reject("no"), grads()], ids=lambda f: type(f).__name__)
def test_check_hello_needs_a_hello(frame):
    with pytest.raises(FrameError, match="expected a hello"):
        check_hello(frame, **EXPECT)
