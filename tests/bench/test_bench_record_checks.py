"""bench/record_checks.py: what checking one DHT record costs, before and after the quick checks."""

from __future__ import annotations

import json

import pytest

from bench import record_checks


def test_every_check_is_timed_on_honest_records_and_reported(tmp_path, capsys):
    out = tmp_path / "checks.json"
    assert record_checks.main(["--records", "40", "--owners", "4", "--repeats", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "vs baseline" in printed and "schema: quick" in printed
    figures = json.loads(out.read_text())["us_per_record"]
    # times are reported, not compared: 40 records' microseconds are noise on a shared machine
    assert set(figures) == {"before (baseline)", "after", "schema: hivemind's", "schema: quick",
                            "signature: key parsed each time", "signature: key kept"}
    assert all(us > 0 for us in figures.values())


def test_no_records_is_a_usage_error():
    with pytest.raises(SystemExit):
        record_checks.main(["--records", "0"])
