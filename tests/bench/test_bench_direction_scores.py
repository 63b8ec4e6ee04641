"""bench/direction_scores.py on the quick model: both statistics scored on the same contributions,
a negated update far below chance under the one in use, and a replica that closes its rounds early
(a quarter of H, rounded up; the pooled statistic scored one that trained 2 of 10 steps below
chance) above the bar. Seconds."""

from __future__ import annotations

import json

import peer.outer.engine as engine
import pytest

from bench import direction_scores


def test_both_statistics_on_the_same_contributions(tmp_path, capsys):
    out, robust_step = tmp_path / "out.json", engine.robust_step
    assert direction_scores.main(["--quick", "--seeds", "1", "--jobs", "1", "--attacks", "negate", "--hostile", "3:1",
                                  "--kinds", "slow", "--slice-rounds", "0", "--no-chain", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = {(s["arm"], s["role"], s["statistic"]): s for s in doc["summary"]}
    for stat in direction_scores.STATISTICS:  # the same contributions, so the same count under each
        assert rows[("R=3 K=1 negate", "hostile", stat)]["n"] == 4
    assert rows[("R=3 K=1 negate", "hostile", "per-tensor")]["max"] < -3
    assert rows[("R=3 K=1 negate", "honest", "per-tensor")]["wrong_side"] == 0
    slow = rows[("R=4 slow", "odd", "per-tensor")]
    assert slow["wrong_side"] == 0 and slow["min"] > 3
    assert "wrong side of 3" in capsys.readouterr().out
    assert engine.robust_step is robust_step  # run in this process, it put the engine's function back


@pytest.mark.parametrize("flags", [["--attacks", "negat"], ["--kinds", "odd"], ["--hostile", "3-1"], ["--hostile", "3:1:2"]])
def test_an_unknown_attack_or_a_malformed_count_is_refused_before_any_run(flags, capsys):
    with pytest.raises(SystemExit) as e:
        direction_scores.main(flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and ("unknown attack" in err or "--hostile wants" in err), err
