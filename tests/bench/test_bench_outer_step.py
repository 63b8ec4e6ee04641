"""bench/outer_step.py on the tiny shape: every arm times every phase and end on the same θ. Seconds."""

from __future__ import annotations

import json

import pytest

from bench import outer_step


def test_both_arms_time_each_phase_and_agree_on_theta(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert outer_step.main(["--shapes", "tiny", "--groups", "1,3", "--repeats", "1", "--threads", "1",
                            "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    arms = ("reference", "current", "no check")
    assert [(r["group"], r["arm"]) for r in rows] == [(g, a) for g in (1, 3) for a in arms]
    for ref, cur, unchecked in (rows[0:3], rows[3:6]):
        # the direction check refuses none of the members' updates: the same θ with it and without
        assert ref["theta"] == cur["theta"] == unchecked["theta"] and len(cur["theta"]) >= 16
        for r in (ref, cur, unchecked):
            assert all(r[p] > 0 for p in outer_step.PHASES) and r["total"] == pytest.approx(sum(r[p] for p in outer_step.PHASES))
            assert r["ratio"] == pytest.approx(ref["total"] / r["total"])
    assert rows[0]["theta"] != rows[3]["theta"]  # three members' aggregate is not one member's
    assert "reference / this" in capsys.readouterr().out


def test_inner_steps_give_the_checks_share_of_a_round(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert outer_step.main(["--shapes", "tiny", "--groups", "3", "--repeats", "1", "--threads", "1",
                            "--inner-steps", "2", "--batch", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    current = next(r for r in rows["rows"] if r["arm"] == "current")
    (share,) = rows["shares"]
    assert share["batch"] == 2 and share["H"] == 30 and share["step_cpu"] > 0 and share["exchange_cpu"] > 0
    assert share["exchange_cpu"] == current["total_cpu"]
    assert share["round_cpu"] == pytest.approx(30 * share["step_cpu"] + share["exchange_cpu"])
    assert share["share"] == pytest.approx(share["check_cpu"] / share["round_cpu"])
    assert "check share" in capsys.readouterr().out


def test_a_bad_group_list_is_a_usage_error():
    with pytest.raises(SystemExit):
        outer_step.main(["--shapes", "tiny", "--groups", "0"])
    with pytest.raises(SystemExit):
        outer_step.main(["--shapes", "nope"])
    with pytest.raises(SystemExit):
        outer_step.main(["--shapes", "tiny", "--batch", "0"])
