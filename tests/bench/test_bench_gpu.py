"""bench/gpu.py: the CPU smoke mode (tiny shape) writes every table's rows as strict JSON, and
without a GPU the default mode says so and exits 0."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))  # last: bench/tokenizers.py must not hide the tokenizers package
import gpu  # noqa: E402

from swarm.jsonout import loads_strict  # noqa: E402


def test_cpu_smoke_mode_writes_steps_memory_and_codec_rows(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert gpu.main(["--device", "cpu", "--shapes", "tiny", "--threads", "1", "--codec-repeats", "1",
                     "--mem-steps", "1", "--json", str(out)]) == 0
    data = loads_strict(out.read_text())
    assert [r["precision"] for r in data["steps"]] == ["bf16", "fp32"]
    assert all(r["tokens_per_s"] > 0 and r["mfu"] is None for r in data["steps"])  # no known peak on a CPU
    peers = {r["peer"]: r for r in data["memory"]}
    assert set(peers) == {"full", "partial S=4", "partial S=4 +attn"}
    assert peers["full"]["state_ratio"] == 1.0
    assert peers["partial S=4 +attn"]["state_bytes"] < peers["partial S=4"]["state_bytes"] < peers["full"]["state_bytes"]
    assert all(r["peak_mem_bytes"] is None for r in data["memory"])  # no GPU memory on a CPU
    (codec,) = data["codecs"]
    assert codec["codec"] == "sparseloco" and codec["H"] == 30 and codec["sent_equals_decoded"] is True
    assert 0 < codec["fraction"] and codec["payload_bytes"] > 0
    printed = capsys.readouterr().out
    assert "tokens/s" in printed and "peak / full" in printed and "(enc+dec)/H" in printed


def test_mfu_uses_the_peak_of_the_device_or_the_override(tmp_path):
    assert gpu.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert gpu.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert gpu.peak_tflops("NVIDIA H200") == 989.0
    assert gpu.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu.peak_tflops("NVIDIA L40S") == 362.0
    assert gpu.peak_tflops("Some Future GPU") is None
    spec = gpu.shape_spec("125m", 8)
    assert spec.model.seq_len == 1024 and spec.data.batch_size == 8
    assert gpu.flops_per_token(spec) == 6 * spec.model.num_params() + 12 * 12 * 1024 * 768
    out = tmp_path / "out.json"
    assert gpu.main(["--device", "cpu", "--shapes", "tiny", "--precisions", "fp32", "--steps", "1", "--warmup", "0",
                     "--mem-steps", "1", "--codec-repeats", "1", "--threads", "1", "--peak-tflops", "1",
                     "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["steps"]
    assert row["mfu"] == pytest.approx(row["flops_per_token"] * row["tokens_per_s"] / 1e12)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message is for machines without a GPU")
def test_without_a_gpu_it_says_so_and_exits_0(capsys):
    assert gpu.main([]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out


def test_steps_only_with_a_compiled_arm(tmp_path):
    """``--parts steps --compile``: the eager and the torch.compile rows, no memory or codec rows."""
    out = tmp_path / "out.json"
    assert gpu.main(["--device", "cpu", "--shapes", "tiny", "--threads", "1", "--precisions", "fp32", "--steps", "2",
                     "--warmup", "1", "--parts", "steps", "--compile", "--json", str(out)]) == 0
    data = loads_strict(out.read_text())
    assert [r["precision"] for r in data["steps"]] == ["fp32", "fp32+compile"]
    assert data["steps"][0]["speedup_vs_last"] == 1.0 and data["steps"][1]["warmup_s"] > 0
    assert data["memory"] == [] and data["codecs"] == []
