"""bench/mixed_speed.py on its quick config: beside a peer that closes its rounds early, the clip that
counts each payload's steps scales the full-speed peer's update less, and that costs less loss, than
the clip that compares norms as they are; an amplifier claiming every step is still clipped. Seconds."""

from __future__ import annotations

import json

from bench import mixed_speed


def test_a_full_speed_peer_beside_an_early_closer_is_clipped_less_once_steps_count(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert mixed_speed.main(["--quick", "--shapes", "2/1", "--seeds", "1", "--jobs", "1", "--amplifier",
                             "--json", str(out)]) == 0
    summary = {(s["clip"], s["amplifier"]): s for s in json.loads(out.read_text())["summary"]}
    uncounted, counted, off = summary[("uncounted", False)], summary[("counted", False)], summary[("off", False)]
    assert uncounted["fast_clipped"] == uncounted["fast_sent"] == 4  # every round, before steps counted
    assert counted["fast_clipped"] < uncounted["fast_clipped"] and counted["min_scale"] > 2 * uncounted["min_scale"]
    assert off["fast_clipped"] == 0 and off["gap"] == 0.0
    assert counted["gap"] < uncounted["gap"]
    for clip in ("uncounted", "counted"):  # x1e4, claiming H steps: kept at a few times an honest norm at most
        assert summary[(clip, True)]["hostile_scale"] < 1e-3
    assert "vs clip off (paired)" in capsys.readouterr().out
