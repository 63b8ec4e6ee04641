"""bench/trust.py on its quick config: the direction check refuses a negated update, refuses no
honest one, without it the negated update costs loss, and each attacked arm is also compared with
its R + K honest control. Seconds."""

from __future__ import annotations

import json

from bench import trust


def test_quick_negate_is_refused_with_the_check_and_costs_loss_without(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert trust.main(["--quick", "--honest", "3", "--hostile", "1", "--attacks", "negate", "--kinds", "", "--seeds", "1",
                       "--jobs", "1", "--json", str(out)]) == 0
    summary = {(s["attack"], s["check"]): s for s in json.loads(out.read_text())["summary"]}
    on, off = summary[("negate", True)], summary[("negate", False)]
    assert on["hostile_refused"] == on["hostile_sent"] == 4 and on["honest_refused"] == 0
    assert on["gap"] == 0.0  # every hostile update refused: θ is the honest replicas' alone, bit for bit
    assert off["hostile_refused"] == 0 and off["gap"] > 0.01
    assert on["z_honest"][0] > 3 > on["z_hostile"][1]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["honest"], r["check"]) for r in rows if r["hostile"] == 0} >= {(4, True), (4, False)}  # the controls
    assert on["vs_control"] is not None and off["vs_control"] is not None
    assert "vs R + K honest" in capsys.readouterr().out
