"""bench/chains.py: a tiny heterogeneous run trains, keeps θ identical, counts link bytes right."""

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))  # last: bench/tokenizers.py must not hide the tokenizers package

import chains  # noqa: E402

from protocol.spec import RunSpec  # noqa: E402

TINY = dict(
    model=dict(d_model=32, n_layers=2, n_heads=2, ffn_hidden=64, seq_len=16),
    batch_size=4,
    inner_steps=3,
    rounds=2,
    lr=3e-3,
    warmup=2,
    extra=False,
)


def test_link_bytes_reference_point():
    # bytes per token (docs/chains.md): d 1024, k 160, fp16 -> 160·2 + id forward, 160·2 backward
    spec = RunSpec().replace(model={"d_model": 1024, "n_heads": 8, "ffn_hidden": 2048, "seq_len": 16})
    link = chains.link_bytes(spec, 160)
    assert (link["forward"], link["backward"]) == (321, 320)  # 1-byte ids: 256-token vocabulary
    assert link["plain_fp16"] == 4096 and link["ratio"] == pytest.approx(4096 / 641)
    assert link["frame_total"] > link["total"]  # real frames add a header


@pytest.mark.parametrize("arm", [chains.ARMS[2], chains.ARMS[3]], ids=["selective", "uniform"])
def test_tiny_arm_runs(arm):
    row = chains.run_arm((TINY, arm, 1, 0))  # asserts θ bit-identical across members every round
    assert math.isfinite(row["val_loss"]) and row["val_loss"] < row["initial_val_loss"]
    assert row["k"] == 3 and row["members"] == (5 if arm.chains == 1 else 8)
    assert row["link"]["ratio"] >= 8
    assert row["tokens"] == chains.R * TINY["rounds"] * TINY["inner_steps"] * TINY["batch_size"] * 16
    torch.set_num_threads(1)
