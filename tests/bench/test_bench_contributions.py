"""bench/contributions.py on its quick config: with K set, each round takes K contributions whatever
the swarm's size, and a peer decodes K payloads where the all-gather decodes them all. Seconds."""

from __future__ import annotations

import json

import pytest

from bench import contributions


def test_quick_k_takes_k_a_round_and_decodes_k_whatever_the_size(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert contributions.main(["--quick", "--seeds", "1", "--jobs", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    runs = {(r["n"], r["k"]): r for r in doc["runs"]}
    for n in (8, 24):
        every, k = runs[(n, 0)], runs[(n, 4)]
        assert every["tokens"] == k["tokens"]  # equal tokens
        assert max(k["contributors"]) <= 4 and 2 < k["decodes_per_round"] <= 4  # fewer when a round had few senders
        assert every["decodes_per_round"] == n and max(every["contributors"]) > 4
    assert runs[(24, 4)]["download_per_round"] < runs[(24, 0)]["download_per_round"] / 4
    assert all(s["gap"] is not None for s in doc["summary"] if s["k"])
    assert "vs all (paired)" in capsys.readouterr().out


def test_the_floor_reaches_the_spec_and_a_bad_one_is_refused(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(contributions, "run_summarized", lambda fn, work, *a, **k: seen.extend(work))
    assert contributions.main(["--quick", "--seeds", "1", "--min-share", "0.5"]) == 0
    assert seen and all(job[-1] == 0.5 for job in seen)
    for bad in ("-0.1", "1.5", "nan"):
        with pytest.raises(SystemExit):
            contributions.main(["--quick", "--min-share", bad])
