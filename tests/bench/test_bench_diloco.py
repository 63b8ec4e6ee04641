"""bench/diloco.py end to end on a tiny configuration: every arm runs, the table prints, ratios are sane."""

import json

import pytest

from tests.support.bench_loader import load_bench

bd = load_bench("diloco")


def test_every_arm_runs_at_equal_tokens(tmp_path, capsys):
    out = tmp_path / "d.json"
    assert bd.main(["--quick", "--steps", "8", "--H", "4", "--warm-start", "4", "--threads", "1", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    for arm in ("single", "diloco R=2", "diloco R=4", "dp R=4"):
        assert arm in table
    rows = {r["arm"].split(" (")[0]: r for r in json.loads(out.read_text())["rows"]}
    assert len({r["tokens"] for r in rows.values()}) == 1  # equal tokens in every arm
    assert rows["single"]["loss_ratio"] == 1.0
    # R=4: 2 rounds of 4 steps; each peer sends its dense fp32 payload to 3 others per round
    r4 = rows["diloco R=4"]
    assert r4["rounds"] == 2 and r4["sent_per_peer"] == 2 * 3 * r4["payload_bytes"]
    assert r4["payload_bytes"] >= 4 * json.loads(out.read_text())["params"]
    assert r4["bytes_ratio"] == pytest.approx(2 * 4 / 4, rel=0.01)  # ~2H/R
    assert rows["dp R=4"]["steps_per_replica"] == 8 and rows["single"]["steps_per_replica"] == 32


def test_bad_arms_are_refused():
    with pytest.raises(SystemExit):
        bd.main(["--quick", "--arms", "1,3"])
