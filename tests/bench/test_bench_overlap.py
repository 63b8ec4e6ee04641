"""bench/overlap.py and the simulation's overlap (peer/round/simulate.py ``overlap_steps``), on a tiny model."""

import json

import pytest

from peer.training.data import load_corpus
from peer.round.simulate import simulate
from protocol.spec import ModelSpec, RunSpec
from tests.support.bench_loader import load_bench

bo = load_bench("overlap")

SPEC = RunSpec(run_id="overlap-sim", seed=2, model=ModelSpec(d_model=32, n_layers=1, n_heads=2, ffn_hidden=64, seq_len=16)).replace(
    data={"batch_size": 4, "val_batches": 2}, outer={"strategy": "sparseloco", "inner_steps": 4})


def test_overlap_in_the_simulation_keeps_replicas_identical_and_tokens_equal():
    corpus = load_corpus("stdlib")
    base = simulate(SPEC, 3, 3, corpus=corpus, eval_every=0)
    again = simulate(SPEC, 3, 3, corpus=corpus, eval_every=0, overlap_steps=0)
    delayed = simulate(SPEC, 3, 3, corpus=corpus, eval_every=0, overlap_steps=2)  # asserts θ identical every round
    assert [h.params_hash for h in again.history] == [h.params_hash for h in base.history]
    assert delayed.tokens == base.tokens  # the same token budget
    assert delayed.history[0].params_hash == base.history[0].params_hash  # round 0 has no exchange before it
    assert delayed.history[-1].params_hash != base.history[-1].params_hash  # later rounds carry the local delta
    with pytest.raises(ValueError):
        simulate(SPEC, 3, 1, corpus=corpus, overlap_steps=5)


def test_bench_overlap_quick_writes_a_paired_summary(tmp_path, capsys):
    out = tmp_path / "o.json"
    assert bo.main(["--quick", "--strategies", "diloco", "--delays", "0,1", "--seeds", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [(s["strategy"], s["delay"]) for s in data["summary"]] == [("diloco", 0.0), ("diloco", 1.0)]
    assert data["summary"][0]["cost"] == 0.0 and all(r["tokens"] > 0 for r in data["rows"])
    assert "exchange ends after" in capsys.readouterr().out


def test_bench_overlap_pairs_each_outer_lr_with_the_base_and_refuses_bad_lrs(tmp_path, capsys):
    out = tmp_path / "o.json"
    assert bo.main(["--quick", "--strategies", "sparseloco", "--delays", "0,1", "--outer-lrs", "1,0.5", "--seeds", "1",
                    "--json", str(out)]) == 0
    summary = json.loads(out.read_text())["summary"]
    assert [(s["outer_lr"], s["delay"]) for s in summary] == [(1.0, 0.0), (1.0, 1.0), (0.5, 0.0), (0.5, 1.0)]
    assert summary[0]["vs_base"] == 0.0 and summary[2]["cost"] == 0.0  # each lr's own sequential run is its baseline
    assert summary[3]["vs_base"] == pytest.approx(summary[3]["losses"][0] / summary[0]["losses"][0] - 1)
    for bad in (["--outer-lrs", "x"], ["--outer-lrs", "0"], ["--outer-lrs", "1,1"], ["--quick", "--shape", "demo"],
                ["--delays", "0,x"], ["--delays", "0,0"]):
        with pytest.raises(SystemExit):
            bo.main(bad)
    capsys.readouterr()
