"""bench/gpu_swarm.py on the CPU with the tests' tiny model: a coordinator, two full peers and a
two-stage chain as processes, every figure read from their status files. Half a minute of training."""

from __future__ import annotations

import json

import pytest

from bench import gpu_swarm

pytestmark = pytest.mark.slow


def test_a_tiny_swarm_of_full_peers_and_a_chain_reports_every_figure(tmp_path, capsys):
    out = tmp_path / "out.json"
    code = gpu_swarm.main(["--preset", "tiny", "--device", "cpu", "--minutes", "0.6", "--inner-steps", "5", "--batch", "4",
                           "--threads", "1", "--workdir", str(tmp_path / "run"), "--json", str(out)])
    assert code == 0
    doc = json.loads(out.read_text())
    roles = sorted(p["role"] for p in doc["peers"])
    assert roles == ["blocks 0-0", "blocks 1-1", "full", "full"]  # the chain formed
    assert doc["one_theta_every_round"] and doc["failed"] == [] and len(doc["distinct_theta"]) >= 3
    for p in doc["peers"]:
        assert p["rounds"] >= 3 and 0.0 < p["util"] <= 1.0 and p["tokens_per_s"] > 0
        assert p["device_peak_bytes"] is None and p["peak_vs_estimate"] is None  # the CPU keeps no peak counter
        assert p["estimate_bytes"] > 0
        phases = p["phases"]  # where a steady round's seconds go
        assert 0.0 < phases["busy_s"] <= phases["seconds"] and phases["exchange_s"] > 0.0, phases
    [chain] = doc["chains"]
    assert chain["stages"] == 2 and chain["vs_full"] > 0
    printed = capsys.readouterr().out
    assert "one θ every round" in printed and "where a steady round's seconds go" in printed


def test_no_cuda_measures_nothing_and_bad_flags_are_refused(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_swarm.main(["--minutes", "1"]) == 0
    assert "nothing measured" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="chain-stages"):
        gpu_swarm.main(["--chain-stages", "1"])
    with pytest.raises(SystemExit, match="minutes"):
        gpu_swarm.main(["--minutes", "0"])
