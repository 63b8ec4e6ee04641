"""bench/send_rate.py: the eligibility table's steady state, pure and fast."""

from __future__ import annotations

import json

from bench import send_rate


def test_senders_settle_near_the_target_and_fresh_members_send_less(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert send_rate.main(["--ks", "8", "--sizes", "200", "--rounds", "300", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["target"] == 10 and 8 < row["senders"] < 14 and row["taken"] > 0.85
    assert "rounds short of K" in capsys.readouterr().out
    # half of them fresh (a quarter of the rate each): p rises to keep about the target sending
    mixed = send_rate.run(8, 200, 300, 0.5)
    assert 8 < mixed["senders"] < 14


def test_first_rounds_set_todays_rule_against_the_rule_before(tmp_path, capsys):
    out = tmp_path / "young.json"
    assert send_rate.main(["--first-rounds", "8", "--ks", "8", "--sizes", "32", "--runs", "20", "--json", str(out)]) == 0
    today, before = json.loads(out.read_text())["rows"]
    assert (today["rule"], before["rule"]) == ("today", "before") and today["senders"][0] == before["senders"][0] == 32
    assert sum(today["senders"][1:]) < sum(before["senders"][1:])  # the weight the rounds gave is counted
    assert "vs before" in capsys.readouterr().out
