"""bench/hostile.py on its quick configuration: real processes, the clean run and one poisoned run, the table."""

import json
import re
from pathlib import Path

import pytest

from bench import hostile as bh


@pytest.mark.slow
def test_quick_clean_and_poisoned(tmp_path, capsys):
    out = tmp_path / "h.json"
    assert bh.main(["--quick", "--attacks", "poison-1e29", "--workdir", str(tmp_path / "runs"), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "attacker excluded/clipped" in text and "poison-1e29" in text
    results = {r["attack"]: r for r in json.loads(out.read_text())["results"]}
    assert list(results) == ["clean", "clean-3", "poison-1e29"]  # the clean runs are added first
    clean, poisoned = results["clean"], results["poison-1e29"]
    assert clean["honest"] == 4 and poisoned["honest"] == 3
    for r in (clean, poisoned):
        assert r["honest_ok"] == r["honest"] and r["hashes_equal"] and r["rounds"] == 3, (r, what_happened(tmp_path / "runs" / r["attack"]))
        assert r["val_loss"] < r["initial_val_loss"]
    assert poisoned["attacker_excluded"] and not clean["attacker_excluded"]
    assert results["clean-3"]["honest"] == 3 and results["clean-3"]["honest_ok"] == 3
    assert poisoned["loss_vs_clean3"] < 1.05


def what_happened(run: Path) -> str:
    """The lines of a run's peer logs that tell how their parameters could have parted."""
    pattern = re.compile(r"done \||no group|merged|download|installed|refused|resync|start|excluded|not waiting|Error")
    return "\n".join(f"{log.stem}: {line[:220]}" for log in sorted(run.glob("peer*.log"))
                     for line in log.read_text(errors="replace").splitlines() if pattern.search(line))


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit):
        bh.main(["--help"])
    text = capsys.readouterr().out
    for flag in ("--quick", "--attacks", "--rounds", "--seeds", "--timeout", "--workdir", "--json", "--table", "--as-peer"):
        assert flag in text


def test_scale_payload_keeps_the_payload_well_formed():
    import torch

    from peer.outer.strategies import make_strategy
    from protocol.spec import RunSpec

    spec = RunSpec().replace(model={"d_model": 16, "n_layers": 1, "n_heads": 2, "ffn_hidden": 32, "seq_len": 8})
    for strategy in ("sparseloco", "diloco", "dct"):
        s = make_strategy(spec.replace(outer={"strategy": strategy}))
        gen = torch.Generator().manual_seed(0)
        data, pending = s.encode({n: torch.randn(sh, generator=gen) * 1e-2 for n, sh in s.layout.items()}, 0)
        scaled = s.decode(bh.scale_payload(data, 1e2), 0)
        for name, t in pending.sent.items():
            want = t * 1e2  # exact for float32 wires; DCT's fp16 coefficients are rounded again after the scaling
            assert float((scaled[name] - want).abs().max()) <= 1e-2 * float(want.abs().max()) + 1e-9


def test_each_attack_is_compared_with_a_clean_run_of_as_many_honest_trainers():
    assert bh.ATTACKS["poison-1e4"].baseline == "clean" and bh.ATTACKS["state-poison"].baseline == "clean"
    for name in ("stall", "forged-round", "framer", "invented-owners", "forged-records"):
        assert bh.ATTACKS[name].baseline == "clean-3", name
    runs = [dict(attack=a, val_loss=v, mean_round_s=t) for a, v, t in
            [("clean", 2.0, 10.0), ("clean-3", 2.2, 8.0), ("poison-1e4", 2.02, 11.0), ("stall", 2.2, 12.0)]]
    bh.compare(runs)
    by = {r["attack"]: r for r in runs}
    # loss: against 3 honest peers (equal honest tokens) and against 4; time: as many training processes
    assert by["poison-1e4"]["loss_vs_clean3"] == pytest.approx(2.02 / 2.2) and by["poison-1e4"]["loss_vs_clean"] == pytest.approx(1.01)
    assert by["poison-1e4"]["time_vs_clean"] == pytest.approx(1.1)
    assert by["stall"]["loss_vs_clean3"] == pytest.approx(1.0) and by["stall"]["time_vs_clean"] == pytest.approx(1.5)


def test_seeds_are_paired_with_their_own_clean_runs_and_reported_as_mean_and_std(tmp_path, capsys):
    def run(attack, seed, val, t):
        return dict(attack=attack, seed=seed, val_loss=val, mean_round_s=t, rounds=3, target_rounds=3,
                    hashes_equal=True, honest=3, honest_ok=3, attacker_excluded=["x"] if attack == "negate" else [])

    runs = [run("clean", 0, 2.0, 10.0), run("clean-3", 0, 2.2, 8.0), run("negate", 0, 2.2, 8.0),
            run("clean", 1, 3.0, 10.0), run("clean-3", 1, 3.3, 8.0), run("negate", 1, 3.63, 12.0)]
    for seed in (0, 1):
        bh.compare([r for r in runs if r["seed"] == seed])
    rows = {r["attack"]: r for r in bh.over_seeds(runs)}
    negate = rows["negate"]
    # per seed: +0 % and +10 % against that seed's clean-3, not against the mean of the clean runs
    assert negate["loss_vs_clean3"] == pytest.approx(1.05) and negate["loss_vs_clean3_std"] == pytest.approx(0.05)
    assert negate["honest"] == negate["honest_ok"] == 6 and negate["seeds"] == [0, 1] and negate["attacker_excluded"] == ["x"]
    out = tmp_path / "h.json"
    out.write_text(json.dumps(dict(results=runs)))
    assert bh.main(["--table", str(out)]) == 0
    text = capsys.readouterr().out
    assert "+5.00 % ± 5.00" in text and "over 2 seeds" in text


def test_a_served_state_poison_changes_theta_but_not_its_layout(monkeypatch):
    import torch

    from peer.round.state_sync import StateSync

    monkeypatch.setattr(StateSync, "shareable_state", lambda self: ({"round": 3}, [torch.ones(4, 4), torch.zeros(2)]))
    bh.serve_poison("shift")
    meta, tensors = StateSync.shareable_state(None)
    assert meta == {"round": 3} and [t.shape for t in tensors] == [(4, 4), (2,)]
    assert all(bool(torch.isfinite(t).all()) for t in tensors) and not torch.equal(tensors[0], torch.ones(4, 4))
    with pytest.raises(SystemExit):
        bh.serve_poison("bogus")
