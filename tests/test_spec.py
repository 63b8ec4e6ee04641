"""The run spec: TOML in and out, digests, validation."""

import pytest

from protocol.errors import SpecError
from protocol.spec import RunSpec


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"outer": {"strategy": "dct", "lr": 2.0, "dct": {"topk": 16}}},
        {"data": {"corpus": '/data/a "quoted" \\ path'}, "partial": {"slices": 2, "attention": True}},
        {"max_rounds": 7, "inner": {"lr": 1e-05}, "chain": {"rank": 12}},
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
