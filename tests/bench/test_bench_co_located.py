"""bench/co_located.py with the tests' tiny model: two peers on this host started without --threads
take a share of its cores each (at most half of torch's default), then two that take every core;
every figure read from their status files and logs. About a minute."""

from __future__ import annotations

import json

import pytest

from bench import co_located

pytestmark = pytest.mark.slow


def test_peers_without_threads_share_the_host_and_every_figure_is_reported(tmp_path, capsys):
    import torch

    every_core = torch.get_num_threads()
    out = tmp_path / "out.json"
    code = co_located.main(["--preset", "tiny", "--minutes", "0.4", "--repeats", "1", "--inner-steps", "5",
                            "--batch", "4", "--workdir", str(tmp_path / "runs"), "--json", str(out)])
    assert code == 0
    doc = json.loads(out.read_text())
    share, every = doc["runs"]
    assert (share["arm"], every["arm"]) == ("share", "every core") and doc["every_core"] == every_core
    for run in (share, every):
        assert run["failed"] == [] and run["one_theta"] and min(run["rounds"]) >= 3
        assert all(s and s > 0 for s in run["tokens_per_s"]) and run["swarm_tokens_per_s"] > 0
    # each shared peer ends at most at half the cores (its start may come before the other's)
    assert all(t != "?" and int(t.split(" -> ")[-1]) <= max(1, every_core // 2) for t in share["threads"]), share
    assert all(t == str(every_core) for t in every["threads"]), every
    printed = capsys.readouterr().out
    assert "vs every core" in printed and "1.00x" in printed


def test_threads_read_from_a_peer_s_log():
    log = "12:00 INFO training on cpu, torch.compile off, 2 CPU threads: ...\n12:01 INFO CPU threads 2 -> 1: 2 peer(s)\n"
    assert co_located.threads_of(log) == "2 -> 1"
    assert co_located.threads_of("") == "?"
