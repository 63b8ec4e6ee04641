"""The layout table: names and order as before, kinds and slices right, chain splits partition it."""

import hashlib
import itertools
import json

import pytest

from protocol.errors import SpecError
from protocol.model.layout import KINDS, TensorInfo, in_block_range, parse_name, tensor_layout, tensor_name
from protocol.spec import ModelSpec

SMALL = dict(d_model=32, n_layers=2, n_heads=2, ffn_hidden=64, vocab_size=64)

# sha256 of json.dumps(list(ModelSpec(**kw).param_shapes(mlp, attn).items())) as the hand-written
# param_shapes (before the layout table) gave them: (kw, mlp_slices, attn_slices, tensors, digest)
RECORDED = [
    (dict(), 1, 1, 31, "9982a60a79741c47"),
    (dict(), 4, 1, 67, "990a4d06ee246ff7"),
    (dict(), 4, 4, 91, "38b6f564c8e9cc9a"),
    (dict(), 2, 2, 51, "32006fb84f88bce0"),
    (SMALL, 1, 1, 17, "4bfe246010520220"),
    (dict(d_model=32, n_layers=3, n_heads=4, ffn_hidden=96, vocab_size=64), 3, 2, 48, "9838a5532f36a555"),
    (dict(d_model=64, n_layers=1, n_heads=8, ffn_hidden=128), 8, 8, 45, "07147c63e149fd4a"),
]


@pytest.mark.parametrize("kw, mlp, attn, count, digest", RECORDED)
def test_names_shapes_and_order_are_unchanged(kw, mlp, attn, count, digest):
    layout = tensor_layout(ModelSpec(**kw), mlp, attn)
    items = [(name, list(t.shape)) for name, t in layout.items()]
    assert len(items) == count
    assert hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16] == digest
    assert ModelSpec(**kw).param_shapes(mlp, attn) == {n: t.shape for n, t in layout.items()}


def test_one_sliced_block_spelled_out():
    m = ModelSpec(**{**SMALL, "n_layers": 1})
    layout = tensor_layout(m, mlp_slices=2, attn_slices=2)
    assert [(n, t.shape, t.block, t.kind, t.slice) for n, t in layout.items()] == [
        ("embed.weight", (64, 32), -1, "embed", None),
        ("blocks.0.attn_norm.weight", (32,), 0, "attn_norm", None),
        ("blocks.0.attn.qkv.0.weight", (48, 32), 0, "qkv", 0),
        ("blocks.0.attn.qkv.1.weight", (48, 32), 0, "qkv", 1),
        ("blocks.0.attn.out.0.weight", (32, 16), 0, "attn_out", 0),
        ("blocks.0.attn.out.1.weight", (32, 16), 0, "attn_out", 1),
        ("blocks.0.mlp_norm.weight", (32,), 0, "mlp_norm", None),
        ("blocks.0.mlp.gate.0.weight", (32, 32), 0, "gate", 0),
        ("blocks.0.mlp.gate.1.weight", (32, 32), 0, "gate", 1),
        ("blocks.0.mlp.up.0.weight", (32, 32), 0, "up", 0),
        ("blocks.0.mlp.up.1.weight", (32, 32), 0, "up", 1),
        ("blocks.0.mlp.down.0.weight", (32, 32), 0, "down", 0),
        ("blocks.0.mlp.down.1.weight", (32, 32), 0, "down", 1),
        ("norm.weight", (32,), 1, "norm", None),
        ("head.weight", (64, 32), 1, "head", None),
    ]


@pytest.mark.parametrize("mlp, attn", [(1, 1), (2, 1), (2, 2), (4, 2)])
def test_infos_are_consistent(mlp, attn):
    m = ModelSpec(**{**SMALL, "n_layers": 3, "n_heads": 4, "ffn_hidden": 96})
    layout = tensor_layout(m, mlp, attn)
    for name, t in layout.items():
        assert isinstance(t, TensorInfo) and t.name == name and t.kind in KINDS
        assert t.residual == (t.kind in ("attn_out", "down"))
        assert t.is_vector == (t.kind in ("attn_norm", "mlp_norm", "norm"))
        assert t.numel == (t.shape[0] if t.is_vector else t.shape[0] * t.shape[1])
        sliced = (t.kind in ("gate", "up", "down") and mlp > 1) or (t.kind in ("qkv", "attn_out") and attn > 1)
        assert (t.slice is not None) == sliced
        parts = parse_name(name)
        assert parts is not None and (parts.kind, parts.slice) == (t.kind, t.slice)
        assert parts.block == (t.block if 0 <= t.block < m.n_layers else None)
        assert tensor_name(t.kind, parts.block, t.slice) == name
    assert sum(t.numel for t in layout.values()) == m.num_params()


@pytest.mark.parametrize(
    "name",
    ["blocks.0.attn_norm.1.weight", "blocks.0.embed.weight", "head.0.weight", "blocks.x.mlp.up.weight",
     "blocks.0.mlp.side.weight", "blocks.0.mlp.up.weight.1", "norm.bias", "attn_norm.weight", ""],
)
def test_parse_name_refuses_what_the_model_never_names(name):
    assert parse_name(name) is None


def test_slices_must_divide():
    with pytest.raises(SpecError, match="MLP slices"):
        tensor_layout(ModelSpec(**SMALL), mlp_slices=3)
    with pytest.raises(SpecError, match="attention slices"):
        tensor_layout(ModelSpec(**SMALL), attn_slices=4)


def _splits(n_layers):
    """Every split of [0, n_layers) into consecutive non-empty ranges."""
    for k in range(n_layers):
        for cuts in itertools.combinations(range(1, n_layers), k):
            bounds = (0,) + cuts + (n_layers,)
            yield list(zip(bounds, bounds[1:]))


@pytest.mark.parametrize("n_layers, mlp, attn", [(1, 1, 1), (3, 2, 1), (4, 2, 2), (5, 1, 1)])
def test_in_block_range_partitions_every_chain_split(n_layers, mlp, attn):
    layout = tensor_layout(ModelSpec(**{**SMALL, "n_layers": n_layers}), mlp, attn)
    for ranges in _splits(n_layers):
        for t in layout.values():
            owners = [r for r in ranges if in_block_range(t, *r, n_layers)]
            assert len(owners) == 1, (t.name, ranges, owners)
            start, end = owners[0]
            if t.kind == "embed":
                assert start == 0
            elif t.kind in ("norm", "head"):
                assert end == n_layers
            else:
                assert start <= t.block < end
