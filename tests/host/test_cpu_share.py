"""A peer's share of the host's CPU (peer/host/cpu_share.py): which processes are peers, how many
cores a cgroup allows, and the thread count kept at the share as peers come and go."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from peer.host.cpu_share import (ThreadShare, cgroup_cores, count_peer_trees, is_peer_command, peer_roots,
                                 peers_on_host, process_table, quota_cores)
from peer.host.device_choice import Machine, choose, share


@pytest.mark.parametrize("argv, peer", [
    (["/usr/bin/python3", "/usr/local/bin/voloco", "peer", "--join", "x"], True),  # the console script
    (["/usr/local/bin/voloco", "peer"], True),
    (["python", "-m", "voloco", "peer", "--join", "x"], True),
    (["python", "-m", "peer", "--join", "x"], True),
    (["python", "-m", "voloco", "demo"], False),  # the demo starts peers, it is none
    (["voloco", "coordinator"], False),
    (["python", "-m", "coordinator"], False),
    (["python", "peer"], False),  # a script named peer, not the package
    (["vim", "voloco", "peer.txt"], False),
    (["python", "-m", "voloco"], False),
    ([], False),
])
def test_which_command_lines_are_peers(argv, peer):
    assert is_peer_command(argv) is peer


def test_a_peer_counts_once_with_its_forked_helpers_and_this_process_always_counts():
    peer = ["python", "-m", "voloco", "peer"]
    commands = {10: peer, 11: peer, 12: peer, 20: peer, 21: peer, 30: ["bash"], 40: ["python", "-m", "voloco", "demo"]}
    parents = {10: 1, 11: 10, 12: 10, 20: 40, 21: 20, 30: 1, 40: 30}
    assert count_peer_trees(commands, parents, me=10) == 2  # two trees: 10 (with 11, 12) and 20 (the demo's)
    assert count_peer_trees(commands, parents, me=11) == 2  # a helper asking counts as its peer
    assert count_peer_trees(commands, parents, me=99) == 3  # a peer started some other way (a test) is one more
    assert count_peer_trees({}, {}, me=5) == 1


@pytest.mark.parametrize("text, cores", [("max 100000", None), ("200000 100000", 2.0), ("150000 100000", 1.5),
                                         ("garbage", None), ("0 100000", None), ("", None)])
def test_a_cgroup_v2_quota(text, cores):
    assert quota_cores(text) == cores


def test_the_tightest_quota_over_the_cgroup_and_its_ancestors():
    root = Path("/cg")
    files = {root / "a" / "b" / "cpu.max": "max 100000", root / "a" / "cpu.max": "300000 100000",
             root / "cpu.max": "max 100000"}
    assert cgroup_cores("0::/a/b\n", files.get, root) == 3.0
    assert cgroup_cores("0::/\n", files.get, root) is None
    v1 = {root / "cpu,cpuacct" / "docker" / "c1" / "cpu.cfs_quota_us": "50000\n",
          root / "cpu,cpuacct" / "docker" / "c1" / "cpu.cfs_period_us": "100000\n",
          root / "cpu,cpuacct" / "docker" / "cpu.cfs_quota_us": "-1\n",
          root / "cpu,cpuacct" / "docker" / "cpu.cfs_period_us": "100000\n"}
    assert cgroup_cores("4:cpu,cpuacct:/docker/c1\n3:memory:/docker/c1\n", v1.get, root) == 0.5
    assert cgroup_cores("", files.get, root) is None
    # RHEL 7 lists the controllers as cpuacct,cpu; the mount is cpu,cpuacct (and cpu, a link to it)
    assert cgroup_cores("3:cpuacct,cpu:/docker/c1\n", v1.get, root) == 0.5
    linked = {root / "cpu" / "docker" / "c1" / "cpu.cfs_quota_us": "200000", root / "cpu" / "docker" / "c1" / "cpu.cfs_period_us": "100000"}
    assert cgroup_cores("3:cpuacct,cpu:/docker/c1\n", linked.get, root) == 2.0
    # inside a container the host's path is not under the mount: its root (".") holds the quota
    inside = {root / "cpu,cpuacct" / "cpu.cfs_quota_us": "150000", root / "cpu,cpuacct" / "cpu.cfs_period_us": "100000"}
    assert cgroup_cores("4:cpu,cpuacct:/docker/c1\n", inside.get, root) == 1.5


def test_the_share_in_the_choice_and_its_log_line():
    alone = Machine(cuda=False, cpu_threads=8, usable_cores=8, peers_here=1)
    c = choose("auto", None, None, alone)
    assert c.threads is None and c.shared and "torch's default" in c.why  # alone: as before
    two = Machine(cuda=False, cpu_threads=8, usable_cores=8, peers_here=2)
    c = choose("auto", None, None, two)
    assert c.threads == 4 and c.shared and "2 peers on this host share its 8 cores" in c.why
    assert "4 CPU threads" in c.describe(two)
    quota = Machine(cuda=False, cpu_threads=64, usable_cores=2, peers_here=1)  # a container's --cpus 2
    c = choose("auto", None, None, quota)
    assert c.threads == 2 and "the 2 cores this process may use" in c.why
    crowded = Machine(cuda=False, cpu_threads=2, usable_cores=2, peers_here=5)
    assert choose("auto", None, None, crowded).threads == 1  # never below 1
    fixed = choose("auto", None, 3, two)  # --threads: the user's count, never looked at again
    assert fixed.threads == 3 and not fixed.shared
    assert share(8, 3) == 2 and share(2, 0) == 2


def test_the_thread_count_follows_the_peers_on_the_host(caplog):
    peers = [1]
    set_to = []
    ts = ThreadShare(base=4, threads=4, share=share, count=lambda: peers[0], set_threads=set_to.append)
    assert ts.refresh() is None and set_to == []  # nothing counted yet: nothing set
    peers[0] = 2
    ts.poll()
    with caplog.at_level(logging.INFO, logger="voloco.peer"):
        assert ts.refresh() == 2
    assert set_to == [2] and "CPU threads 4 -> 2: 2 peer(s) on this host" in caplog.text
    assert ts.refresh() is None and set_to == [2, 2]  # unchanged: set again (another thread may have), not logged
    peers[0] = 1  # the other one stopped: the share comes back
    ts.poll()
    assert ts.refresh() == 4 and set_to[-1] == 4

    def broken():
        raise PermissionError("no /proc")

    ts._count = broken
    ts.poll()
    assert ts.refresh() is None and ts.threads == 4  # the process table unreadable: the last count stays


def test_the_counting_thread_counts_and_stops():
    counted = threading.Event()
    ts = ThreadShare(base=2, threads=2, share=share, count=lambda: counted.set() or 2, every_s=0.01).start()
    try:
        assert counted.wait(5.0)
        deadline = time.monotonic() + 5.0
        while ts.refresh() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ts.threads == 1
    finally:
        ts.stop()


def test_a_host_whose_cores_or_peers_cannot_be_read_still_starts(monkeypatch, caplog):
    from peer.host import cpu_share, device_choice

    def broken():
        raise UnicodeDecodeError("utf-8", b"\xc3", 0, 1, "a process name cut in the middle of a character")

    monkeypatch.setattr(cpu_share, "peers_on_host", broken)
    with caplog.at_level(logging.WARNING, logger="voloco.peer"):
        machine = device_choice.detect_machine()
    assert (machine.usable_cores, machine.peers_here) == (0, 1) and "could not read this host" in caplog.text
    assert device_choice.detect_machine(share=False).peers_here == 1  # --threads: nothing read at all


def test_peer_processes_on_this_host_are_found_in_the_process_table(tmp_path):
    """Real processes whose command line is a peer's: a script named ``voloco`` run with ``peer``, one
    of them with a forked child (as a peer's DHT process is), and one that is not a peer."""
    script = tmp_path / "voloco"
    script.write_text("import os, sys, time\n"
                      "if '--fork' in sys.argv:\n"
                      "    child = os.fork()\n"
                      "    if child == 0:\n"
                      "        time.sleep(60)\n"
                      "        os._exit(0)\n"
                      "    open(sys.argv[-1], 'w').write(str(child))\n"
                      "time.sleep(60)\n")
    child_file = tmp_path / "child.pid"
    procs = [subprocess.Popen([sys.executable, str(script), "peer", "--fork", str(child_file)]),
             subprocess.Popen([sys.executable, str(script), "peer"]),
             subprocess.Popen([sys.executable, str(script), "coordinator"])]
    child = None
    try:
        deadline = time.monotonic() + 10
        while not (child_file.exists() and child_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(child_file.read_text())
        commands, parents = process_table()
        roots = peer_roots(commands, parents)
        assert {procs[0].pid, procs[1].pid} <= roots  # both peers
        assert is_peer_command(commands[child]) and child not in roots  # the fork counts with its peer
        assert procs[2].pid not in roots and os.getpid() not in roots
        assert peers_on_host() >= 3  # the two, and this process (a peer started some other way)
    finally:
        for p in procs:
            p.kill()
            p.wait()
        if child is not None:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
