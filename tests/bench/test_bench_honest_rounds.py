"""bench/honest_rounds.py on a short run: three honest peers, every round counted, the rows reach the JSON."""

import pytest

from swarm.jsonout import loads_strict
from tests.support.bench_loader import load_bench

honest = load_bench("honest_rounds")


@pytest.mark.slow
def test_a_short_run_counts_every_round_and_writes_json(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert honest.main(["--seeds", "1", "--rounds", "3", "--H", "3", "--load", "1", "--nice", "0,5",
                        "--timeout", "300", "--json", str(out)]) == 0
    rows = loads_strict(out.read_text())["rows"]
    assert len(rows) == 1 and rows[0]["rounds"] == 3
    assert rows[0]["apart"] == 0  # honest peers end every round on one θ
    assert {"excluded", "short", "took_set", "late_joins", "lost_s", "load"} <= set(rows[0])
    assert "late joins" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [["--peers", "1"], ["--rounds", "0"], ["--load", "-1"], ["--nice", "x"]])
def test_bad_arguments_are_refused_with_a_message(bad, capsys):
    with pytest.raises(SystemExit) as e:
        honest.main(bad)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err
