"""bench/stalls.py on the tiny shape: both arms run a real peer alone, the checkpoint arm leaves a
checkpoint on disk, and the rows reach the JSON."""


import pytest

from swarm.jsonout import loads_strict
from tests.support.bench_loader import load_bench

stalls = load_bench("stalls")

pytestmark = pytest.mark.slow


def test_both_arms_measure_a_lone_peer_and_write_json(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert stalls.main(["--shape", "tiny", "--rounds", "2", "--skip", "1", "--threads", "1", "--timeout", "240",
                        "--json", str(out)]) == 0
    rows = loads_strict(out.read_text())["rows"]
    assert [r["checkpoints"] for r in rows] == [False, True]
    assert all(r["rounds"] >= 2 and 0 < r["util"] <= 1 for r in rows)
    assert rows[0]["files"] == [] and "checkpoint.safetensors" in rows[1]["files"]
    assert "util / baseline" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [["--rounds", "0"], ["--H", "0"], ["--skip", "-1"], ["--shape", "huge"]])
def test_bad_arguments_are_refused_with_a_message(bad, capsys):
    with pytest.raises(SystemExit) as e:
        stalls.main(bad)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err
