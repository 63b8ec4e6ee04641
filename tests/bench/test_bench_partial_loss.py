"""bench/partial_loss.py on its quick config: three arms at equal tokens, the equal-bytes arm's
payloads no larger than a slice owner's, gaps paired by seed. Seconds."""

from __future__ import annotations

import json

import pytest

from bench import partial_loss


def test_quick_arms_at_equal_tokens_and_equal_bytes(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert partial_loss.main(["--quick", "--seeds", "1", "--jobs", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    arms = {s["arm"]: s for s in doc["summary"]}
    assert list(arms) == ["full", "partial S=4", "full, equal bytes", "partial S=4, equal bytes"]  # DEFAULT_ARMS
    assert len({s["tokens"] for s in arms.values()}) == 1  # equal tokens
    assert 1 <= doc["equal_bytes_topk"] < partial_loss.DEFAULT_TOPK
    # the equal-bytes arm sends no more than the partial arm (payload sizes depend on top-k only)
    assert arms["full, equal bytes"]["sent"] <= arms["partial S=4"]["sent"] < arms["full"]["sent"]
    assert arms["full"]["gap"] is None and arms["partial S=4"]["gap"] is not None
    # the partial arm at equal bytes synchronises more often: a shorter H, about the full arm's bytes
    more = arms["partial S=4, equal bytes"]
    assert more["inner_steps"] == doc["equal_bytes_h"] < arms["full"]["inner_steps"]
    assert 0.6 * arms["full"]["sent"] <= more["sent"] <= 1.4 * arms["full"]["sent"]
    assert "vs full (paired)" in capsys.readouterr().out


def test_a_lower_topk_sets_every_arm_and_the_equal_bytes_search(tmp_path):
    out = tmp_path / "out.json"
    assert partial_loss.main(["--quick", "--seeds", "1", "--jobs", "1", "--topk", "25", "--arms", "full,full-bytes",
                              "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    arms = {s["arm"]: s for s in doc["summary"]}
    assert doc["topk"] == 25 and arms["full"]["topk"] == 25
    assert arms["full, equal bytes"]["topk"] == doc["equal_bytes_topk"] < 25


def test_fewer_than_two_owners_a_slice_is_refused():
    with pytest.raises(SystemExit, match="2 x --slices"):
        partial_loss.main(["--quick", "--replicas", "6", "--slices", "4"])
    with pytest.raises(SystemExit, match="--topk"):
        partial_loss.main(["--quick", "--topk", "1"])


def test_the_aggregate_flag_reaches_every_arm(tmp_path):
    """--aggregate mean divides each coordinate by every payload of its part: another run than the
    default chosen average on the same seed."""
    loss = {}
    for aggregate in ("chosen", "mean"):
        out = tmp_path / f"{aggregate}.json"
        assert partial_loss.main(["--quick", "--seeds", "1", "--jobs", "1", "--arms", "full", "--aggregate", aggregate,
                                  "--json", str(out)]) == 0
        doc = json.loads(out.read_text())
        assert doc["aggregate"] == aggregate
        loss[aggregate] = doc["summary"][0]["loss"]
    assert loss["chosen"] != loss["mean"]
    assert partial_loss.arm_spec(partial_loss.CONFIGS["quick"], 4, 0, aggregate="mean").outer.sparseloco.aggregate == "mean"


def test_the_slice_step_scales_only_sliced_tensors(tmp_path):
    """--slice-step moves the partial arm (its slices' outer step is scaled) and leaves the full arm,
    which has no sliced tensor, the same run bit for bit."""
    loss = {}
    for step in ("1.0", "0.5"):
        out = tmp_path / f"{step}.json"
        assert partial_loss.main(["--quick", "--seeds", "1", "--jobs", "1", "--arms", "full,partial",
                                  "--slice-step", step, "--json", str(out)]) == 0
        loss[step] = {s["arm"]: s["loss"] for s in json.loads(out.read_text())["summary"]}
    assert loss["1.0"]["full"] == loss["0.5"]["full"]
    assert loss["1.0"]["partial S=4"] != loss["0.5"]["partial S=4"]
    with pytest.raises(SystemExit, match="--slice-step"):
        partial_loss.main(["--quick", "--slice-step", "0"])


def test_points_give_the_gap_along_the_run_at_equal_tokens(tmp_path, capsys):
    """--rounds sets the run's length and --points evaluates θ at evenly spaced points of it, at the
    same tokens in every arm (the equal-bytes arm's shorter rounds included)."""
    out = tmp_path / "out.json"
    assert partial_loss.main(["--quick", "--seeds", "1", "--jobs", "1", "--rounds", "4", "--points", "2",
                              "--arms", "full,partial,partial-bytes", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    curves = {s["arm"]: s["curve"] for s in doc["summary"]}
    assert [c["tokens"] for c in curves["full"]] == [c["tokens"] for c in curves["partial S=4, equal bytes"]]
    assert len(curves["full"]) == 2 and curves["full"][0]["tokens"] * 2 == curves["full"][1]["tokens"]
    assert curves["full"][0]["gap"] is None and curves["partial S=4"][1]["gap"] is not None
    assert "along the run" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--points"):
        partial_loss.main(["--quick", "--rounds", "4", "--points", "3"])


def test_the_strategy_flag_runs_every_arm_on_diloco(tmp_path, capsys):
    """--strategy diloco: dense payloads (no top-k, so no full-bytes arm), the slice owners' payloads
    smaller by what they freeze, and their equal-bytes arm at a shorter H."""
    out = tmp_path / "out.json"
    assert partial_loss.main(["--quick", "--seeds", "1", "--jobs", "1", "--strategy", "diloco",
                              "--arms", "full,partial,partial-bytes", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    arms = {s["arm"]: s for s in doc["summary"]}
    assert doc["strategy"] == "diloco" and doc["equal_bytes_topk"] == 0
    assert all(s["topk"] == 0 for s in arms.values()) and "dense" in capsys.readouterr().out
    assert arms["partial S=4"]["sent"] < arms["full"]["sent"]
    assert arms["partial S=4, equal bytes"]["inner_steps"] < arms["full"]["inner_steps"]
    assert partial_loss.arm_spec(dict(partial_loss.CONFIGS["quick"], strategy="diloco"), 4, 0).outer.strategy == "diloco"
    with pytest.raises(SystemExit, match="full-bytes"):
        partial_loss.main(["--quick", "--strategy", "diloco", "--arms", "full,full-bytes"])


def test_the_equal_flops_arm_trains_what_a_full_replica_s_compute_pays_for(tmp_path):
    """A slice owner's step skips its frozen slices' weight gradients: at equal FLOPs it trains more
    rounds (rounded down, never more compute than a full replica), and more tokens than the full arm."""
    cfg = dict(partial_loss.CONFIGS["quick"], points=1)
    ratio = partial_loss.flops_ratio(cfg, 4)
    assert 1.05 < ratio < 1.5  # the MLP's weight-gradient share, three quarters of it skipped
    out = tmp_path / "out.json"
    assert partial_loss.main(["--quick", "--seeds", "1", "--jobs", "1", "--rounds", "6", "--arms", "full,partial-flops",
                              "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    arms = {s["arm"]: s for s in doc["summary"]}
    assert doc["flops_ratio"] == ratio and doc["flops_rounds"] == int(6 * ratio)
    more = arms["partial S=4, equal FLOPs"]
    assert arms["full"]["tokens"] < more["tokens"] <= ratio * arms["full"]["tokens"]
    assert more["gap"] is not None


def test_the_topk_arm_spends_a_full_payload_s_bytes_on_denser_slices_at_the_same_h(tmp_path):
    """partial-topk: slice owners at the config's H with the largest top-k whose payload fits a full
    one's at --topk; the diloco strategy, which keeps no top-k, refuses the arm."""
    out = tmp_path / "out.json"
    assert partial_loss.main(["--quick", "--seeds", "1", "--jobs", "1", "--topk", "25", "--arms", "full,partial-topk",
                              "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    arms = {s["arm"]: s for s in doc["summary"]}
    denser = arms["partial S=4, bytes by top-k"]
    assert denser["topk"] == doc["partial_topk"] > 25 and denser["inner_steps"] == arms["full"]["inner_steps"]
    cfg = partial_loss.CONFIGS["quick"]
    full = partial_loss.payload_bytes(partial_loss.arm_spec(cfg, 1, 0, 25), partial_loss.part_of(1))
    part = partial_loss.part_of(4, 0)
    assert partial_loss.payload_bytes(partial_loss.arm_spec(cfg, 4, 0, denser["topk"]), part) <= full
    assert partial_loss.payload_bytes(partial_loss.arm_spec(cfg, 4, 0, denser["topk"] + 1), part) > full
    assert 0.6 * arms["full"]["sent"] <= denser["sent"] <= arms["full"]["sent"]
    with pytest.raises(SystemExit, match="partial-topk"):
        partial_loss.main(["--quick", "--strategy", "diloco", "--arms", "full,partial-topk"])
