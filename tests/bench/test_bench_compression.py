"""bench/compression.py on its quick configuration: the arms run from a shared warm start, ratios and goals print,
and the payload sizes by model size meet the 200x goal at 99.5M."""

import json

from tests.support.bench_loader import load_bench

bc = load_bench("compression")


def test_quick_arms_with_a_warm_start(tmp_path, capsys):
    out = tmp_path / "c.json"
    argv = ["--quick", "--only", "diloco fp32,sparseloco", "--warm-start", "20", "--threads", "1", "--json", str(out)]
    assert bc.main(argv) == 0
    text = capsys.readouterr().out
    assert "warm start: 20 single-process steps" in text and "payload>=140x" in text
    result = json.loads(out.read_text())
    assert result["config"]["warm_start"] == 20
    rows = {r["arm"]: r for r in result["rows"]}
    assert set(rows) == {"diloco fp32", "sparseloco"}
    assert rows["diloco fp32"]["tokens"] == rows["sparseloco"]["tokens"]
    # every arm starts from the warm start, not from the seed's initialization
    assert rows["diloco fp32"]["initial_val_loss"] == rows["sparseloco"]["initial_val_loss"] < 5.0
    assert rows["sparseloco"]["payload_vs_fp32"] > 50
    assert result["crossover_group"] > 2
    # payload sizes by model size: Rice-coded indices put SparseLoCo >= 200x under fp32 at 99.5M
    largest = result["payload_ratio_by_model"][-1]
    assert largest["model"] == "768x12 (99.5M)" and largest["sparseloco_ratio"] >= 200
    assert largest["sparseloco_idx_bytes"] * 8 < 7.6 * largest["sparseloco_kept"]
    assert "Goal SparseLoCo >= 200x at 768x12 (99.5M): " in text and "x ok" in text
