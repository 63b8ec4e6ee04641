"""bench/honest_rounds.py on a short run: three honest peers, every round counted, the rows reach the JSON."""

import pytest

from swarm.jsonout import loads_strict
from tests.support.bench_loader import load_bench

honest = load_bench("honest_rounds")


@pytest.mark.slow
def test_a_short_run_counts_every_round_and_writes_json(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert honest.main(["--seeds", "1", "--rounds", "3", "--H", "3", "--load", "1", "--nice", "0,5",
                        "--timeout", "300", "--json", str(out), "--workdir", str(tmp_path / "runs")]) == 0
    rows = loads_strict(out.read_text())["rows"]
    assert len(rows) == 1 and rows[0]["rounds"] == 3
    assert rows[0]["apart"] == 0  # honest peers end every round on one θ
    assert {"excluded", "refused", "short", "took_set", "states", "cleared", "late_joins", "lost_s", "load"} <= set(rows[0])
    assert "late joins" in capsys.readouterr().out
    assert (tmp_path / "runs" / "seed1" / "p0.log").exists()  # --workdir keeps the logs


def test_a_peer_that_caught_up_by_state_or_stopped_ends_the_wait():
    """Its own count of rounds stays below the run's round after a state download: the wait for
    the counted rounds reads the round it is at (a run of 5 peers hung for its whole timeout)."""
    assert honest._done({"round": 105, "rounds": 94, "state": "training"}, 100)
    assert honest._done({"round": 60, "rounds": 50, "state": "stopped"}, 100)
    assert not honest._done({"round": 60, "rounds": 60, "state": "training"}, 100)
    assert not honest._done(None, 100)


@pytest.mark.parametrize("bad", [["--peers", "1"], ["--rounds", "0"], ["--load", "-1"], ["--nice", "x"]])
def test_bad_arguments_are_refused_with_a_message(bad, capsys):
    with pytest.raises(SystemExit) as e:
        honest.main(bad)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_the_spec_forms_several_groups_with_a_max_group_size_below_the_peers():
    for swarm in ("tests", "defaults"):
        text = honest.spec_text(1, 5, swarm, max_group_size=3)
        assert text.count("[swarm]") == 1 and text.rstrip().endswith("max_group_size = 3")
    assert "max_group_size" not in honest.spec_text(1, 5)


@pytest.mark.parametrize("bad", [["--arms", "fast"], ["--arms", ","], ["--max-group-size", "-1"]])
def test_bad_arms_are_refused_with_a_message(bad, capsys):
    with pytest.raises(SystemExit) as e:
        honest.main(bad)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err
