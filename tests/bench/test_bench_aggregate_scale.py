"""bench/aggregate_scale.py on its quick config: every aggregate at every R, paired gaps against the
first aggregate and the fewest replicas, and a floor at most one payload is the chosen average.
Seconds."""

from __future__ import annotations

import json

import pytest

from bench import aggregate_scale


def test_quick_runs_every_arm_and_pairs_the_gaps(tmp_path, capsys):
    out = tmp_path / "out.json"
    argv = ["--quick", "--replicas", "2,4", "--aggregates", "chosen,chosen/0.25,mean", "--seeds", "1", "--jobs", "1",
            "--json", str(out)]
    assert aggregate_scale.main(argv) == 0
    doc = json.loads(out.read_text())
    loss = {(r["aggregate"], r["replicas"]): r["val_loss"] for r in doc["runs"]}
    assert len(loss) == 6
    # at R = 4 a floor of 0.25 is one payload: the chosen average, bit for bit, so the same loss
    assert loss[("chosen/0.25", 4)] == loss[("chosen", 4)]
    assert loss[("mean", 4)] != loss[("chosen", 4)]
    summary = {(s["aggregate"], s["replicas"]): s for s in doc["summary"]}
    assert summary[("chosen", 2)]["vs_first"] is None and summary[("mean", 2)]["vs_first"] is not None
    assert summary[("chosen", 2)]["vs_fewest"] is None and summary[("chosen", 4)]["vs_fewest"] is not None
    assert "vs chosen (paired)" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--aggregates", "median"], ["--aggregates", "chosen/2"],
                                  ["--aggregates", "chosen/x"], ["--aggregates", "mean/0.5"],
                                  ["--aggregates", "chosen,chosen"], ["--replicas", "2,2"], ["--replicas", "0"],
                                  ["--seeds", "0"], ["--jobs", "0"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        aggregate_scale.main(argv)
