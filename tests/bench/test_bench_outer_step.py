"""bench/outer_step.py on the tiny shape: both arms time every phase and end on the same θ. Seconds."""

from __future__ import annotations

import json

import pytest

from bench import outer_step


def test_both_arms_time_each_phase_and_agree_on_theta(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert outer_step.main(["--shapes", "tiny", "--groups", "1,3", "--repeats", "1", "--threads", "1",
                            "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["group"], r["arm"]) for r in rows] == [(1, "reference"), (1, "current"), (3, "reference"), (3, "current")]
    for ref, cur in (rows[0:2], rows[2:4]):
        assert ref["theta"] == cur["theta"] and len(cur["theta"]) >= 16
        for r in (ref, cur):
            assert all(r[p] > 0 for p in outer_step.PHASES) and r["total"] == pytest.approx(sum(r[p] for p in outer_step.PHASES))
        assert ref["ratio"] == 1.0 and cur["ratio"] == pytest.approx(ref["total"] / cur["total"])
    assert rows[0]["theta"] != rows[2]["theta"]  # three members' aggregate is not one member's
    assert "reference / this" in capsys.readouterr().out


def test_a_bad_group_list_is_a_usage_error():
    with pytest.raises(SystemExit):
        outer_step.main(["--shapes", "tiny", "--groups", "0"])
    with pytest.raises(SystemExit):
        outer_step.main(["--shapes", "nope"])
