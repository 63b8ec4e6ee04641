"""bench/scale.py --quick end to end: a 4-peer swarm trains 6 rounds (5, and one more to sample
after the fifth) and the JSON holds together: a row per round, one θ and one group each round
(4 peers on loopback, quorum 4), positive byte counts, and peer 0's process tree sampled after
rounds 1 and 5 with positive memory, descriptors and threads."""

import json
import os
import subprocess
import sys

import pytest

from tests.support.bench_loader import load_bench

bs = load_bench("scale")

pytestmark = pytest.mark.slow


def test_quick_scale_run_reports_rounds_and_resources(tmp_path, capsys):
    out = tmp_path / "scale.json"
    assert bs.main(["--quick", "--workdir", str(tmp_path / "runs"), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "distinct θ" in printed and "fds tree" in printed
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 1  # --peers 4 is the long run's size: run once
    run = runs[0]
    assert run["peers"] == 4 and run["long"] and run["failure"] is None and run["rounds"] == 6
    assert [r["round"] for r in run["rows"]] == sorted({r["round"] for r in run["rows"]})
    assert len(run["rows"]) == 6
    for r in run["rows"]:
        assert r["peers"] == 4 and r["groups"] >= 1 and sum(r["group_sizes"]) <= 4
        assert 1 <= r["distinct_theta"] <= 4 and 0 <= r["alone"] <= 4
        assert r["payload_sent_per_peer"] >= 0 and r["round_s"] > 0
    assert any(r["payload_sent_per_peer"] > 0 for r in run["rows"])  # some round had a group to send to
    assert any(r["wire_per_peer"] for r in run["rows"])  # the status' wire, read after rounds (None where netlink is blocked)
    # the thread's and the helper processes' seconds, from each peer's second record on (None where the
    # helpers' counters cannot be read)
    cpu = [r["exchange_cpu_per_peer"] for r in run["rows"][1:]]
    assert all(c is None or c > 0 for c in cpu) and any(c is not None for c in cpu), cpu
    assert "exchange CPU/peer/round" in printed and "barrier wait/peer/round" in printed
    assert all(r["waited_per_peer"] is not None and r["waited_per_peer"] >= 0 for r in run["rows"])
    assert [u["after_rounds"] for u in run["usage"]] == [1, 5]
    for u in run["usage"]:
        assert u["rounds_ended"] >= u["after_rounds"]
        assert len(u["processes"]) >= 2  # the peer and at least its DHT's process (p2pd under it)
        assert u["rss_kib"] > 0 and u["pss_kib"] > 0 and u["fds"] > 0 and u["threads"] > 0
        assert all(p["rss_kib"] > 0 and p["fds"] > 0 for p in u["processes"])
        assert any(p["name"] == "p2pd" for p in u["processes"])


def test_a_size_given_twice_runs_in_a_folder_of_its_own(tmp_path, monkeypatch):
    """--peers 8,32,8,32 (A/B pairs): the second 8-peer swarm once reused the first one's folder, read
    its finished status files and reported nothing."""
    folders = []
    monkeypatch.setattr(bs, "run_size", lambda n, rounds, marks, args, folder: folders.append(folder.name) or
                        dict(peers=n, rounds=rounds, failure=None))
    monkeypatch.setattr(bs, "report", lambda runs: "")
    assert bs.main(["--peers", "8,32,8,32", "--rounds", "2", "--long-rounds", "0", "--workdir", str(tmp_path)]) == 0
    assert folders == ["peers8-rounds2", "peers32-rounds2", "peers8-rounds2-2", "peers32-rounds2-2"]


def test_bad_sizes_are_refused():
    with pytest.raises(SystemExit):
        bs.main(["--peers", "4,x"])
    with pytest.raises(SystemExit):
        bs.main(["--peers", "0"])


def test_cores_per_peer_must_be_positive():
    with pytest.raises(SystemExit):
        bs.main(["--peers", "4", "--cores-per-peer", "0"])


@pytest.mark.skipif(not os.path.exists("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") or os.geteuid() != 0,
                    reason="needs root and cgroup v1's cpu controller")
def test_a_cpu_quota_holds_the_processes_started_inside_it():
    """bench/common.py CpuQuota: a busy process started inside a 0.2-core quota gets about 0.2 s of CPU
    a wall second, where on its own it would take a whole core; the bench process leaves the cgroup."""
    from bench.common import CpuQuota

    quota = CpuQuota(0.2, f"voloco-test-{os.getpid()}")
    try:
        with quota.entered():
            busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.monotonic()\n"
                                     "while time.monotonic() - t < 2.0: pass\nimport os\nprint(sum(os.times()[:2]))"],
                                    stdout=subprocess.PIPE, text=True)
        with open(f"/proc/{os.getpid()}/cgroup") as f:
            assert f"voloco-test-{os.getpid()}" not in f.read()
        cpu = float(busy.communicate(timeout=30)[0])
    finally:
        quota.close()
    assert cpu < 0.8, cpu  # 2 wall seconds at 0.2 cores: about 0.4 s (about 2.0 on a core of its own)
    assert not os.path.exists(quota.path)


@pytest.mark.skipif(not os.path.exists("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") or os.geteuid() != 0,
                    reason="needs root and cgroup v1's cpu controller")
def test_a_cpu_quota_outlived_by_a_process_it_started_is_still_removed():
    """A peer's helpers (p2pd, its DHT) can outlive the peer in the cgroup: ``close`` waits a little,
    then kills what is left, and removes the cgroup."""
    from bench.common import CpuQuota

    quota = CpuQuota(0.5, f"voloco-test-left-{os.getpid()}")
    quota.EMPTY_WAIT_S = 1.0
    with quota.entered():
        left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        assert quota.pids() == [left.pid]
        quota.close()
        assert left.wait(timeout=10) == -9 and not os.path.exists(quota.path)
    finally:
        left.kill()
