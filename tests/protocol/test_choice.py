"""The choice of a round's contributions (protocol/round/choice.py) and the payload header it reads."""

import random

import pytest
import torch

from protocol.round.choice import choose, weight
from protocol.codecs import make_codec
from protocol.errors import PayloadError
from protocol.wire.payload import decode_claimed_payload, encode_payload, payload_part
from protocol.spec import RunSpec
from protocol.round.standing import ESTABLISHED


def test_every_contribution_when_k_is_off_or_a_part_has_no_more_than_k():
    parts = {f"p{i}": -1 for i in range(5)}
    assert choose(parts, 0, "seed", {}) == sorted(parts)
    assert choose(parts, 5, "seed", {}) == sorted(parts)
    assert choose({}, 3, "seed", {}) == []


def test_k_of_each_part_and_the_same_choice_in_any_order():
    parts = {f"full{i}": -1 for i in range(40)}
    parts.update({f"slice{i}": 2 for i in range(3)})
    parts.update({f"stage{i}": (0, 2) for i in range(12)})
    chosen = choose(parts, 8, "abc:7", {})
    assert sum(s.startswith("full") for s in chosen) == 8
    assert sum(s.startswith("slice") for s in chosen) == 3  # fewer than K: all of that part
    assert sum(s.startswith("stage") for s in chosen) == 8
    shuffled = list(parts.items())
    random.Random(1).shuffle(shuffled)
    assert choose(dict(shuffled), 8, "abc:7", {}) == chosen
    assert choose(parts, 8, "abc:8", {}) != chosen  # another round, another draw


def test_each_sender_is_chosen_about_as_often_as_its_weight_says():
    senders = [f"old{i}" for i in range(10)] + [f"new{i}" for i in range(10)]
    table = {f"old{i}": ESTABLISHED for i in range(10)}
    counts = {s: 0 for s in senders}
    for r in range(2000):
        for s in choose({s: -1 for s in senders}, 5, f"theta:{r}", table):
            counts[s] += 1
    old = sum(counts[s] for s in senders if s.startswith("old")) / 2000
    new = sum(counts[s] for s in senders if s.startswith("new")) / 2000
    assert old + new == 5
    assert weight(0) == 1 and weight(ESTABLISHED) == 4 and weight(10 * ESTABLISHED) == 4  # in quarters
    assert new < 1.5 < 3.5 < old  # a fresh identity draws at a quarter of the weight (~1.0 of 5 places)
    assert min(counts[s] for s in senders if s.startswith("old")) > 200  # nobody is shut out


def test_keys_are_compared_exactly_as_u_to_the_power_one_over_w():
    import math

    from protocol.round.choice import D, _order, uniform

    rng = random.Random(3)
    for _ in range(2000):
        a = (f"a{rng.random()}", rng.randrange(1, 2**64 + 1), rng.randrange(1, 5))
        b = (f"b{rng.random()}", rng.randrange(1, 2**64 + 1), rng.randrange(1, 5))
        ka, kb = math.log(a[1] / D) / a[2], math.log(b[1] / D) / b[2]
        if abs(ka - kb) > 1e-9 * max(abs(ka), abs(kb)):  # where floats can tell them apart, they agree
            assert _order(a, b) == (-1 if ka > kb else 1) == -_order(b, a)
    assert _order(("x", 5, 2), ("y", 5, 2)) == -1 and _order(("y", 5, 2), ("x", 5, 2)) == 1
    assert 1 <= uniform("seed", "sender") <= 2**64


@pytest.mark.parametrize("part", [-1, 1, (0, 1)])
def test_the_header_reader_finds_the_part_that_decoding_finds(part):
    spec = RunSpec().replace(model={"d_model": 16, "n_layers": 2, "n_heads": 2, "ffn_hidden": 32, "seq_len": 8},
                             partial={"slices": 2})
    codec = make_codec(spec)
    layout = spec.param_shapes()
    tensors = {n: torch.randn(s) for n, s in layout.items()}
    data, _ = encode_payload(codec, tensors, run_digest="run", round=3, steps=1, part=part)
    kw = dict(run_digest="run", round=3, max_bytes=len(data))
    layouts = lambda p: layout if p == part else None  # noqa: E731
    assert payload_part(data, codec, layouts, **kw) == decode_claimed_payload(data, codec, layouts, **kw)[0] == part
    with pytest.raises(PayloadError, match="round"):
        payload_part(data, codec, layouts, **{**kw, "round": 4})
    with pytest.raises(PayloadError, match="not a part"):
        payload_part(data, codec, lambda p: None, **kw)
    with pytest.raises(PayloadError, match="exceeds"):
        payload_part(data, codec, layouts, **{**kw, "max_bytes": len(data) - 1})


def test_any_bytes_give_a_part_or_a_payload_error():
    spec = RunSpec().replace(model={"d_model": 16, "n_layers": 1, "n_heads": 2, "ffn_hidden": 32, "seq_len": 8})
    codec = make_codec(spec)
    layout = spec.param_shapes()
    data, _ = encode_payload(codec, {n: torch.randn(s) for n, s in layout.items()}, run_digest="run", round=0, steps=1)
    rng = random.Random(0)
    samples = [b"", b"\x80", b"\xc1", b"\x81\xa1t\xc0", data[:20], data[:-1] + b"\xff", bytes(rng.randrange(256) for _ in range(64))]
    for _ in range(300):
        mutated = bytearray(data[:200])
        for _ in range(4):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        samples.append(bytes(mutated))
    for sample in samples:
        try:
            payload_part(sample, codec, lambda p: layout if p == -1 else None, run_digest="run", round=0, max_bytes=len(data))
        except PayloadError:
            pass
