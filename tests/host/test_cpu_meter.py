"""peer/host/cpu_meter.py: the CPU seconds of a process's descendants, per call, from psutil."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from peer.host.cpu_meter import ChildCpu

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\nimport sys; sys.stdout.write('done\\n'); sys.stdout.flush()\ntime.sleep(60)\n"


def _burning_child(seconds: float) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", BURN.format(s=seconds)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "done\n"  # it has spent its seconds and now sleeps
    return child


def test_a_childs_cpu_seconds_count_once_and_an_exited_child_takes_nothing_back():
    meter = ChildCpu()
    meter.since_last()  # the pytest process's other children, if any, counted from here
    child = _burning_child(0.4)
    try:
        first = meter.since_last()
        assert 0.35 <= first <= 5.0, first  # its 0.4 s of CPU (and its start-up), once
        assert meter.since_last() < 0.1  # asleep since: nothing new
    finally:
        child.kill()
        child.wait()
    assert meter.since_last() >= 0.0  # gone: no negative seconds for what it took with it


def test_unreadable_counters_give_none_once_said(monkeypatch, caplog):
    meter = ChildCpu()

    def refuse(self, recursive=False):
        raise psutil.AccessDenied(pid=self.pid)

    monkeypatch.setattr(psutil.Process, "children", refuse)
    with caplog.at_level("INFO", logger="voloco.peer"):
        assert meter.since_last() is None and meter.since_last() is None
    assert sum("cannot be read" in r.getMessage() for r in caplog.records) == 1


def test_a_grandchild_counts_too():
    meter = ChildCpu()
    meter.since_last()
    code = f"import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', {BURN.format(s=0.3)!r}], stdout=subprocess.PIPE, text=True); print(c.stdout.readline(), end='', flush=True); c.wait()"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "done\n"
        time.sleep(0.05)
        assert meter.since_last() >= 0.25
    finally:
        for p in psutil.Process(child.pid).children(recursive=True):
            p.kill()
        child.kill()
        child.wait()
