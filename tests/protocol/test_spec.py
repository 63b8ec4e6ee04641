"""The run spec: TOML in and out, digests, validation."""

import hashlib

import pytest

from protocol import PROTOCOL_VERSION
from protocol.errors import SpecError
from protocol.spec import (
    DEFAULT_OUTER_LR,
    DENSE_DTYPES,
    MAX_TENSORS,
    SPARSE_AGGREGATES,
    SPEC_VERSION,
    STRATEGIES,
    InnerSpec,
    ModelSpec,
    RunSpec,
)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"outer": {"strategy": "dct", "lr": 2.0, "dct": {"topk": 16}}},
        {"data": {"corpus": '/data/a "quoted" \\ path'}, "partial": {"slices": 2, "attention": True}},
        {"max_rounds": 7, "inner": {"lr": 1e-05}, "chain": {"rank": 12}},
        {"outer": {"max_overlap": 0.5}},  # left out of the serialization only at its default, 1.0
    ],
)
def test_toml_round_trip(changes):
    spec = RunSpec().replace(**changes)
    back = RunSpec.from_toml(spec.to_toml())
    assert back == spec
    assert back.digest() == spec.digest()


def test_unset_options_are_left_out():
    text = RunSpec().to_toml()
    assert "lr = " in text and "\nlr = null" not in text  # outer.lr is None: omitted, not null
    assert "[outer.sparseloco]" in text


def test_bad_toml_is_a_spec_error():
    with pytest.raises(SpecError, match="not valid TOML"):
        RunSpec.from_toml("[model\nd_model = 3")
    with pytest.raises(SpecError, match="d_model"):
        RunSpec.from_toml("[model]\nd_model = 'big'")


# hex digests of these specs' bytes (as the hand-written dataclass spec gave them, updated when a field is
# added: outer.overlap and outer.min_inner_fraction): the serialization must stay byte-stable. (The spec's
# digest also names the protocol version: the test below.)
DIGESTS = [
    ({}, "a610adcc2d33dd2e"),
    ({"outer": {"strategy": "diloco", "lr": 0.5}}, "bd82bd27f38869d5"),
    ({"partial": {"slices": 4, "attention": True}}, "2de97160ac710516"),
    ({"chain": {"rank": 16}}, "db82e6621c312525"),
    ({"model": {"d_model": 64, "n_layers": 2}}, "1a962167cdebf9a9"),
    (
        {
            "run_id": "combo-1",
            "seed": 7,
            "max_rounds": 100,
            "outer": {"strategy": "dct", "inner_steps": 10, "dct": {"topk": 16}},
            "swarm": {"min_group_size": 3, "round_wait": 12.5},
            "data": {"batch_size": 8},
            "inner": {"lr": 1e-3, "warmup_steps": 5},
        },
        "dea567470a0f4ffb",
    ),
]


@pytest.mark.parametrize("changes, digest", DIGESTS)
def test_digests_are_unchanged(changes, digest):
    spec = RunSpec().replace(**changes)
    of_bytes = lambda s: hashlib.sha256(s.to_bytes()).hexdigest()[:16]  # noqa: E731
    assert of_bytes(spec) == digest
    assert of_bytes(RunSpec.from_bytes(spec.to_bytes())) == digest
    assert of_bytes(RunSpec.from_toml(spec.to_toml())) == digest
    assert RunSpec.from_toml(spec.to_toml()).digest() == spec.digest()


def test_the_digest_names_the_protocol_version(monkeypatch):
    """Peers of two protocol versions refuse each other's payloads, so they must never group: their
    digests, which every record and payload carries, differ."""
    import protocol.spec

    spec = RunSpec()
    now = spec.digest()
    assert now == hashlib.sha256(b"voloco protocol %d\x00" % PROTOCOL_VERSION + spec.to_bytes()).hexdigest()[:16]
    monkeypatch.setattr(protocol.spec, "PROTOCOL_VERSION", PROTOCOL_VERSION - 1)
    assert spec.digest() != now


def test_to_dict_keeps_keys_order_and_types():
    d = RunSpec().to_dict()
    assert list(d) == ["run_id", "seed", "max_rounds", "model", "data", "inner", "outer", "swarm", "partial", "chain", "version"]
    assert list(d["outer"]) == ["strategy", "inner_steps", "lr", "momentum", "nesterov", "overlap", "min_inner_fraction",
                                "dense_dtype", "sparseloco", "dct"]
    assert d["outer"]["lr"] is None and d["outer"]["nesterov"] is True
    assert type(d["model"]["rope_theta"]) is float and type(d["model"]["d_model"]) is int


def test_a_float_field_takes_an_int_and_stores_a_float():
    spec = RunSpec.from_toml("[inner]\nlr = 1\n[outer]\nlr = 2")
    assert type(spec.inner.lr) is float and spec.inner.lr == 1.0 and type(spec.outer.lr) is float
    assert spec.digest() == RunSpec().replace(inner={"lr": 1.0}, outer={"lr": 2.0}).digest()


def test_api_survives():
    spec = RunSpec(run_id="api", model=ModelSpec(d_model=32, n_layers=2, n_heads=2, ffn_hidden=64))
    assert spec.model.d_model == 32 and spec.outer.effective_lr == DEFAULT_OUTER_LR["sparseloco"]
    assert spec.chain.effective_rank(spec.model.d_model) == 3 and spec.partial.attn_slices == 1
    assert list(spec.param_shapes()) == list(spec.model.param_shapes())
    assert spec == RunSpec.from_dict(spec.to_dict()) and hash(spec) == hash(RunSpec.from_dict(spec.to_dict()))
    assert spec.replace(outer={"sparseloco": {"bits": 3}}).outer.sparseloco.topk == spec.outer.sparseloco.topk
    assert InnerSpec(warmup_steps=2, total_steps=10).lr_at(0) == pytest.approx(1e-3)
    with pytest.raises(Exception):
        spec.seed = 3  # frozen
    assert (SPEC_VERSION, STRATEGIES, DENSE_DTYPES, SPARSE_AGGREGATES) == (1, ("diloco", "sparseloco", "dct"), ("fp32", "fp16"), ("chosen", "mean"))


BAD_TOML = [
    ("[model]\nn_layers = 2147483648", r"^model\.n_layers must be an integer in \[1, 1024\], got 2147483648$"),
    ("seed = 18446744073709551616", r"^seed must be an integer in \[0, 2\*\*63\), got 18446744073709551616$"),
    ("[swarm]\nheartbeat_period = 1e308", r"^swarm\.heartbeat_period must be a finite number in \(0, 3600\]"),
    ("[swarm]\nround_wait = nan", r"^swarm\.round_wait must be a finite number"),
    ("[inner]\nlr = -inf", r"^inner\.lr must be a finite number in \(0, 1000\], got -inf$"),
    ("[inner]\nlr = " + "9" * 400 + ".0", r"^inner\.lr must be a finite number"),
    ("seed = " + "9" * 5000, r"not valid TOML"),
    ("[model]\nd_model = 4.0", r"^model\.d_model must be an integer"),
    ("[data]\nbatch_size = true", r"^data\.batch_size must be an integer"),
    ("[outer]\nnesterov = 1", r"^outer\.nesterov must be true or false, got 1$"),
    ("[outer]\nmax_overlap = 0", r"^outer\.max_overlap must be a finite number in \(0, 1\]"),
    ("[outer]\nstrategy = 'adam'", r"^outer\.strategy must be one of 'diloco', 'sparseloco', 'dct', got 'adam'$"),
    ("[model]\nfoo = 1", r"^unknown field\(s\) in the run spec: model\.foo$"),
    ("[outer.sparseloco.x]\ny = 1", r"^unknown field\(s\) in the run spec: outer\.sparseloco\.x$"),
    ("model = 5", r"^model must be a table/map, got int$"),
    ("[model]\nd_model = 33", r"model\.d_model \(33\) must be divisible by model\.n_heads"),
    ("[model]\nd_model = 12\nn_heads = 4", r"must be even"),
    ("[model]\nd_model = 65536\nn_heads = 256\nn_layers = 1024\nffn_hidden = 262144", r"^model has .* parameters"),
    ("[partial]\nslices = 3", r"MLP slices"),
    ("[partial]\nslices = 32\n[model]\nd_model = 8\nn_heads = 2\nn_layers = 1024\nffn_hidden = 1024\n[chain]\nrank = 8",
     r"^model\.n_layers \(1024\) x partial\.slices \(32\) make 102403 tensors, more than the limit of 65536$"),
    ("[chain]\nrank = 200", r"chain\.rank \(200\) must be <= model\.d_model"),
    ("[inner]\nwarmup_steps = 3000", r"inner\.total_steps .* must be greater than inner\.warmup_steps"),
    ("[outer.sparseloco]\nchunk = 8\ntopk = 65", r"outer\.sparseloco\.topk \(65\) must be <="),
    ("[outer.dct]\nchunk = 300", r"^outer\.dct\.chunk must be an integer in \[1, 256\], got 300$"),
    ("[swarm]\nmin_group_size = 5\nmax_group_size = 3", r"swarm\.max_group_size \(3\) must be >= swarm\.min_group_size"),
    ("version = 2\nnew_field = 1", r"^spec version 2 is not supported"),
    ("run_id = 'Bad Id'", r"^run_id 'Bad Id' must be 1-48 characters"),
    ('run_id = "ok\\n"', r"^run_id 'ok\\n' must be"),  # a trailing newline: refused (was accepted)
    ("[data]\ncorpus = ''", r"^data\.corpus must be a string of 1 to 4096 characters"),
]


@pytest.mark.parametrize("text, match", BAD_TOML)
def test_every_bad_spec_is_one_spec_error_line(text, match):
    with pytest.raises(SpecError, match=match) as info:
        RunSpec.from_toml(text)
    assert type(info.value) is SpecError and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "data, match",
    [
        ({"seed": 2**64 - 1}, r"^seed must be an integer"),
        ({"outer": {"lr": None, "momentum": [1]}}, r"^outer\.momentum must be a finite number in \[0, 1\), got \[1\]$"),
        ({"model": {"n_layers": 2**31}}, r"^model\.n_layers must be an integer in \[1, 1024\]"),
        ({"model": "x" * 1000}, r"^model must be a table/map, got str$"),
        ({"chain": {"link_timeout": float("inf")}}, r"^chain\.link_timeout must be a finite number"),
    ],
)
def test_bad_msgpack_is_one_spec_error_line(data, match):
    import msgpack

    with pytest.raises(SpecError, match=match):
        RunSpec.from_bytes(msgpack.packb(data, use_bin_type=True))


def test_direct_construction_raises_spec_error_too():
    with pytest.raises(SpecError, match=r"^model\.n_layers must be an integer in \[1, 1024\], got 2147483648$"):
        ModelSpec(n_layers=2**31)
    with pytest.raises(SpecError, match=r"^model\.n_layers must be an integer in \[1, 1024\], got an integer of"):
        RunSpec.from_dict({"model": {"n_layers": 1 << 20000}})
    with pytest.raises(SpecError, match=r"^inner\.lr must be a finite number"):
        InnerSpec(lr="x")
    with pytest.raises(SpecError, match=r"^unknown field\(s\) in the run spec: 1$"):
        RunSpec.from_dict({1: 2})
    with pytest.raises(SpecError, match=r"^run spec must be a table/map"):
        RunSpec.from_dict([("seed", 1)])
    with pytest.raises(SpecError, match=r"^unknown field\(s\) in the run spec: model\.zzz$"):
        RunSpec().replace(model={"zzz": 1})


def test_the_tensor_limit_counts_the_real_layout():
    spec = RunSpec().replace(model={"n_layers": 1024, "d_model": 64, "n_heads": 16, "ffn_hidden": 1024}, chain={"rank": 8},
                             partial={"slices": 8, "attention": True})
    assert len(spec.layout()) == 3 + 1024 * (2 + 2 * 8 + 3 * 8) <= MAX_TENSORS
