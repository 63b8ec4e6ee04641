"""bench/state_serving.py on a small flood: both arms serve every downloader the same state, the gate
answers some of them busy, and the rows reach the JSON."""

import pytest

from swarm.jsonout import loads_strict
from tests.support.bench_loader import load_bench

serving = load_bench("state_serving")

pytestmark = pytest.mark.slow


def test_both_arms_serve_every_downloader_and_write_json(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert serving.main(["--downloaders", "3", "--state-mb", "4", "--json", str(out)]) == 0
    rows = loads_strict(out.read_text())["rows"]
    assert [r["arm"] for r in rows] == ["gate", "open"] and all(r["all_equal"] for r in rows)
    assert rows[1]["busy"] == 0  # no bound: nobody is answered busy
    assert "peak vs open" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [["--downloaders", "0"], ["--state-mb", "0"], ["--arms", "closed"]])
def test_bad_arguments_are_refused_with_a_message(bad, capsys):
    with pytest.raises(SystemExit) as e:
        serving.main(bad)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err
