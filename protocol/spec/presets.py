"""Named model shapes for the run spec: ``[model] preset = "125m"``.

A preset fills the model fields the spec does not give; a field given explicitly wins over the
preset (``preset = "125m"`` with ``seq_len = 256`` is the 125m shape at a 256-token context). The
preset is expanded when the spec is read: the spec that is published, digested and checkpointed
holds the resulting fields and no ``preset`` key, so a spec written with a preset and one that
spells the same fields out are the same spec (same digest), and peers that predate presets read it.

The shapes are Llama-style (SwiGLU hidden ≈ 8/3 d rounded to a multiple of 32, head dim 64 or
128). The names follow the usual size classes, which count a 32k-50k token vocabulary; with this
run's vocabulary (256 bytes by default) the counts are lower, see ``preset_param_count``:
85.3M (125m), 308.9M (350m) and 1.215B (1.3b) parameters at vocab_size 256. Pure: no torch.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping

from protocol.errors import SpecError

# the model fields a preset sets; vocab_size, rope_theta, norm_eps and init_std stay the spec's
PRESET_FIELDS = ("d_model", "n_layers", "n_heads", "ffn_hidden", "seq_len")

PRESETS: Dict[str, Dict[str, int]] = {
    # the default model of `voloco demo`: 0.9M parameters, trains on one CPU core
    "demo": {"d_model": 128, "n_layers": 4, "n_heads": 4, "ffn_hidden": 352, "seq_len": 128},
    "125m": {"d_model": 768, "n_layers": 12, "n_heads": 12, "ffn_hidden": 2048, "seq_len": 1024},
    "350m": {"d_model": 1024, "n_layers": 24, "n_heads": 16, "ffn_hidden": 2816, "seq_len": 1024},
    "1.3b": {"d_model": 2048, "n_layers": 24, "n_heads": 32, "ffn_hidden": 5504, "seq_len": 2048},
}


def expand_preset(data: Mapping[str, Any]) -> Dict[str, Any]:
    """The model section's fields with its ``preset`` (if any) replaced by the preset's fields,
    the fields given explicitly kept as given. SpecError for an unknown preset."""
    out = dict(data)
    if "preset" not in out:
        return out
    name = out.pop("preset")
    if not isinstance(name, str) or name not in PRESETS:
        shown = repr(name)[:48]
        raise SpecError(f"model.preset must be one of {', '.join(repr(p) for p in PRESETS)}, got {shown}")
    for key, value in PRESETS[name].items():
        out.setdefault(key, value)
    return out


def preset_param_count(name: str, vocab_size: int = 256) -> int:
    """Parameters of a preset's model (untied embedding and head), by arithmetic alone."""
    p = PRESETS[name]
    d, f, n = p["d_model"], p["ffn_hidden"], p["n_layers"]
    per_block = 4 * d * d + 3 * d * f + 2 * d  # qkv + out, gate/up/down, two norms
    return n * per_block + 2 * vocab_size * d + d  # embedding, head, final norm


__all__ = ["PRESETS", "PRESET_FIELDS", "expand_preset", "preset_param_count"]
