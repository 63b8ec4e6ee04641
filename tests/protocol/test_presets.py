"""Model presets in the run spec (protocol/spec/presets.py), and the memory estimate that decides full
replica or chain stage (protocol/model/capacity.py) against the real peak of an inner step on the CPU.

The 350m and 1.3b models are never built here: their shapes and parameter counts are checked by
arithmetic only.
"""

from __future__ import annotations

import pytest

from bench import memory_peak
from peer.training.resources import HEADROOM
from protocol.model.capacity import replica_bytes
from protocol.errors import SpecError
from protocol.spec.presets import PRESETS, preset_param_count
from protocol.spec import ModelSpec, RunSpec
from swarm.jsonout import loads_strict

# parameters at vocab_size 256 (the byte-level run): untied embedding and head, no biases
PARAM_COUNTS_256 = {"demo": 869_504, "125m": 85_347_072, "350m": 308_855_808, "1.3b": 1_215_399_936}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_fills_the_shape(name):
    spec = RunSpec.from_toml(f'[model]\npreset = "{name}"\n')
    for field, value in PRESETS[name].items():
        assert getattr(spec.model, field) == value
    assert spec.model.vocab_size == 256
    assert spec.model.num_params() == preset_param_count(name) == PARAM_COUNTS_256[name]


def test_preset_shapes_are_llama_style():
    assert PRESETS["125m"] == {"d_model": 768, "n_layers": 12, "n_heads": 12, "ffn_hidden": 2048, "seq_len": 1024}
    assert PRESETS["350m"] == {"d_model": 1024, "n_layers": 24, "n_heads": 16, "ffn_hidden": 2816, "seq_len": 1024}
    assert PRESETS["1.3b"] == {"d_model": 2048, "n_layers": 24, "n_heads": 32, "ffn_hidden": 5504, "seq_len": 2048}
    for p in PRESETS.values():
        head_dim = p["d_model"] // p["n_heads"]
        assert p["d_model"] % p["n_heads"] == 0 and head_dim % 2 == 0
        assert 2.5 <= p["ffn_hidden"] / p["d_model"] <= 2.9  # SwiGLU: about 8/3 d
        assert p["ffn_hidden"] % 32 == 0


def test_param_counts_with_the_runs_vocabulary():
    """The counts follow the run's vocab_size (a BPE run's 32000 tokens: the size classes' names)."""
    for name in PRESETS:
        spec = ModelSpec(preset=name, vocab_size=32000)
        assert spec.num_params() == preset_param_count(name, 32000)
    assert ModelSpec(preset="125m", vocab_size=32000).num_params() == 134_105_856
    assert ModelSpec(preset="350m", vocab_size=32000).num_params() == 373_867_520
    assert ModelSpec(preset="1.3b", vocab_size=32000).num_params() == 1_345_423_360


def test_explicit_fields_win_over_the_preset():
    spec = RunSpec.from_dict({"model": {"preset": "125m", "seq_len": 256, "n_layers": 6}})
    assert (spec.model.d_model, spec.model.n_layers, spec.model.seq_len) == (768, 6, 256)


def test_preset_is_expanded_not_stored():
    """A spec with a preset is the spec spelling its fields out: same digest, same TOML."""
    with_preset = RunSpec.from_toml('[model]\npreset = "demo"\n')
    assert with_preset == RunSpec()
    assert with_preset.digest() == RunSpec().digest()
    big = RunSpec.from_toml('[model]\npreset = "350m"\n')
    assert "preset" not in big.to_dict()["model"]
    assert RunSpec.from_toml(big.to_toml()) == big
    assert RunSpec.from_bytes(big.to_bytes()).digest() == big.digest()


@pytest.mark.parametrize("bad", ['"7b"', "3", '""', "true"])
def test_unknown_preset_is_one_spec_error(bad):
    with pytest.raises(SpecError, match=r"^model\.preset must be one of 'demo', '125m', '350m', '1\.3b', got"):
        RunSpec.from_toml(f"[model]\npreset = {bad}\n")


def test_explicit_field_that_breaks_the_preset_shape_names_the_field():
    with pytest.raises(SpecError, match="model.d_model .768. must be divisible by model.n_heads .7."):
        RunSpec.from_dict({"model": {"preset": "125m", "n_heads": 7}})


def test_big_presets_need_a_chain_on_a_small_machine():
    """The estimate deciding full replica or chain stage, for the shapes never built here."""
    for name, low, high in (("125m", 2e9, 60e9), ("350m", 5e9, 120e9), ("1.3b", 20e9, 500e9)):
        need = replica_bytes(RunSpec.from_dict({"model": {"preset": name}}))
        assert low < need < high, (name, need)


# --- the estimate against the real peak ----------------------------------------------------------
@pytest.mark.skipif(not memory_peak.can_measure(),
                    reason="needs Linux's /proc/self/clear_refs to reset the peak resident size")
@pytest.mark.parametrize("case", sorted(memory_peak.SHAPES))
def test_memory_estimate_bounds_the_real_peak(case):
    """A real peer's model built, AdamW, θ snapshot and strategy buffer, two inner steps (forward,
    backward, update), in a fresh process after the framework's own start-up:

    - the peak of the bytes malloc has handed out (glibc's mallinfo2, sampled after every aten op)
      lies below the estimate the peer compares with its memory, and the estimate is at most 2x it;
    - the peak resident size it adds, allocator fragmentation and library buffers included, which
      the estimate does not count, stays within the memory the decision leaves for them: a peer
      takes a full replica when the estimate is below HEADROOM (80 %) of its free memory.
    """
    m = memory_peak.measure(memory_peak.SHAPES[case])
    ratio = m["estimate"] / m["live"]
    print(f"{case}: live peak {m['live'] / 1e6:.1f} MB, resident peak {m['rss'] / 1e6:.1f} MB, estimate "
          f"{m['estimate'] / 1e6:.1f} MB (state {m['state'] / 1e6:.1f} + activations {m['activations'] / 1e6:.1f}),"
          f" estimate / live {ratio:.2f}")
    assert m["live"] <= m["estimate"], m
    assert ratio <= 2.0, m
    assert m["rss"] <= m["estimate"] / HEADROOM, m


@pytest.mark.skipif(not memory_peak.can_measure(),
                    reason="needs Linux's /proc/self/clear_refs to reset the peak resident size")
def test_memory_peak_bench_prints_its_table_and_json(tmp_path, capsys):
    out = tmp_path / "peak.json"
    assert memory_peak.main(["--shapes", "demo", "--json", str(out)]) == 0
    assert "estimate / live" in capsys.readouterr().out
    (row,) = loads_strict(out.read_text())["rows"]
    assert row["shape"] == "demo" and row["live"] > 0 and row["estimate_over_live"] == row["estimate"] / row["live"]
    with pytest.raises(SystemExit):
        memory_peak.main(["--shapes", "d9999"])
