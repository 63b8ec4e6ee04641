"""bench/call_cost.py: what a small P2P call costs in CPU, unary against a stream, both sides counted."""

from __future__ import annotations

import json

import pytest

from bench import call_cost


def test_each_kind_of_call_is_made_and_reported_with_its_cpu(tmp_path, capsys):
    out = tmp_path / "calls.json"
    assert call_cost.main(["--calls", "10", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "vs unary" in printed and "stream, 2 answers" in printed
    doc = json.loads(out.read_text())
    assert [r["kind"] for r in doc["rows"]] == list(call_cost.KINDS)
    # CPU is reported, not compared: on a shared machine 10 calls' seconds are noise
    assert all(r["calls"] == 10 and isinstance(r["cpu_s"], float) and r["seconds"] > 0 for r in doc["rows"])


def test_too_few_calls_are_refused_with_a_usage_error():
    with pytest.raises(SystemExit):
        call_cost.main(["--calls", "3"])
