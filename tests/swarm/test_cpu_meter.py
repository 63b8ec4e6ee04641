"""swarm/cpu_meter.py: the CPU seconds of a peer's helper processes and their children, per call."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import psutil

from swarm.cpu_meter import UNSEEN, HelperCpu, thread_cpu

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\nimport sys; sys.stdout.write('done\\n'); sys.stdout.flush()\ntime.sleep(60)\n"


def _burning_child(seconds: float) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", BURN.format(s=seconds)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "done\n"  # it has spent its seconds and now sleeps
    return child


def test_a_helpers_seconds_count_once_and_an_exited_helper_takes_nothing_back():
    roots = []
    meter = HelperCpu(lambda: roots)
    assert meter.since_last() == 0.0  # no helper started yet
    helper = _burning_child(0.4)
    roots.append(helper.pid)
    try:
        first = meter.since_last()
        assert 0.35 <= first <= 5.0, first  # its 0.4 s of CPU (and its start-up), once
        assert meter.since_last() < 0.1  # asleep since: nothing new
    finally:
        helper.kill()
        helper.wait()
    assert meter.since_last() < 0.1  # gone: nothing new, and nothing negative for what it took with it


def test_only_the_named_helpers_count_not_the_peers_other_children():
    other = _burning_child(0.3)  # e.g. a compile worker: a child of the peer, not a helper
    try:
        meter = HelperCpu(lambda: [None])  # a helper not started yet
        assert meter.since_last() == 0.0
    finally:
        other.kill()
        other.wait()


def test_a_helpers_child_counts_too():
    code = f"import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', {BURN.format(s=0.3)!r}], stdout=subprocess.PIPE, text=True); print(c.stdout.readline(), end='', flush=True); c.wait()"
    helper = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    meter = HelperCpu(lambda: [helper.pid])
    try:
        assert helper.stdout.readline() == "done\n"
        time.sleep(0.05)
        assert meter.since_last() >= 0.25  # its child's (as p2pd is the DHT process's)
    finally:
        for p in psutil.Process(helper.pid).children(recursive=True):
            p.kill()
        helper.kill()
        helper.wait()


def test_unreadable_counters_give_none_once_said(monkeypatch, caplog):
    meter = HelperCpu(lambda: [1])

    def refuse(self):
        raise psutil.AccessDenied(pid=self.pid)

    monkeypatch.setattr(psutil.Process, "cpu_times", refuse)
    with caplog.at_level("INFO", logger="voloco.peer"):
        assert meter.since_last() is None and meter.since_last() is None
    assert sum("cannot be read" in r.getMessage() for r in caplog.records) == 1


def test_a_rounds_helper_seconds_split_where_its_inner_steps_ended(monkeypatch):
    """peer/round/report.py RoundMeters: ``helpers_cpu`` is the whole round's, ``helpers_exchange_cpu``
    the part after ``exchange_began``; a round that wrote no record adds its seconds to the next."""
    import peer.round.report as report

    spent = iter([0.0, 1.0, 0.5, 2.0, 0.25, 4.0, None, 1.0])  # the baseline, then what each call saw

    class Meter:
        def __init__(self, roots):
            pass

        def since_last(self):
            return next(spent)

    monkeypatch.setattr(report, "HelperCpu", Meter)
    meters = report.RoundMeters(object())
    record = report.RoundRecord(1, "h", ["me"], 1, {}, 0, 0, 0.0, 0.0, 1.0)
    meters.exchange_began()  # 1.0 while training
    meters.fill(record)  # 0.5 in the exchange
    assert (record.helpers_cpu, record.helpers_exchange_cpu) == (1.5, 0.5) and record.exchange_s >= 0.0
    meters.exchange_began()  # 2.0: a deferred round, no record
    meters.exchange_began()  # 0.25
    meters.fill(record)  # 4.0
    assert (record.helpers_cpu, record.helpers_exchange_cpu) == (6.25, 4.0)
    meters.exchange_began()  # unreadable
    meters.fill(record)
    assert (record.helpers_cpu, record.helpers_exchange_cpu) == (None, 1.0)


def _burner(seconds: float, burnt: threading.Event, go: threading.Event):
    def burn():
        t = time.thread_time()
        while time.thread_time() - t < seconds:
            pass
        burnt.set()
        go.wait(30)
    return burn


def test_a_threads_seconds_count_under_its_name():
    go, burnt = threading.Event(), [threading.Event(), threading.Event()]
    workers = [threading.Thread(target=_burner(0.3, burnt[i], go), name=f"burner-{i}", daemon=True) for i in range(2)]
    for w in workers:
        w.start()
    try:
        assert all(b.wait(30) for b in burnt)
        cpu = thread_cpu()
    finally:
        go.set()
    assert cpu is not None and 0.55 <= cpu["burner"] <= 3.0, cpu  # both burners' 0.3 s under one name
    assert "main" in cpu and all(v >= 0 for v in cpu.values())


def _gone(*threads: threading.Thread, timeout: float = 10.0) -> None:
    """Wait until the OS no longer lists ``threads`` (Python's join returns before the OS thread ends)."""
    ids, deadline = {t.native_id for t in threads}, time.monotonic() + timeout
    while ids & {t.id for t in psutil.Process().threads()} and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_thread_joined_in_python_but_still_listed_by_the_os_is_not_counted_twice(monkeypatch):
    """CI once read a thread's seconds both as ended (under its name) and as a live "other" thread: Python's
    join had returned, and the OS still listed it. Its seconds count once, under its name, until it is gone."""
    from types import SimpleNamespace

    from swarm import cpu_meter

    threads = [SimpleNamespace(id=1, user_time=0.5, system_time=0.0)]
    monkeypatch.setattr(cpu_meter, "psutil", SimpleNamespace(
        Process=lambda: SimpleNamespace(threads=lambda: threads, cpu_times=lambda: SimpleNamespace(user=0.5, system=0.0)),
        Error=Exception))
    monkeypatch.setattr(cpu_meter, "_threads_seen", {1: ("exchange", 0.4)})  # seen alive under its name before
    monkeypatch.setattr(cpu_meter, "_threads_ended", {})
    assert cpu_meter.thread_cpu() == {"exchange": 0.5}  # Python forgot it ("other"); the OS still lists it
    threads.clear()
    assert cpu_meter.thread_cpu() == {"exchange": 0.5}  # gone: its seconds stay, once


def test_an_ended_threads_seconds_stay_counted():
    go, burnt = threading.Event(), threading.Event()
    seen = threading.Thread(target=_burner(0.3, burnt, go), name="seen-1", daemon=True)
    seen.start()
    assert burnt.wait(30)
    before = thread_cpu()
    assert before["seen"] >= 0.25  # alive at this call
    go.set()
    seen.join()
    burnt2 = threading.Event()
    unseen = threading.Thread(target=_burner(0.3, burnt2, go), name="unseen-1")
    unseen.start()
    unseen.join()
    _gone(seen, unseen)  # a joined thread can linger in the OS a moment: counted live ("other") until then
    cpu = thread_cpu()
    assert cpu["seen"] >= 0.25, cpu  # ended, still under its name
    assert cpu.get(UNSEEN, 0.0) - before.get(UNSEEN, 0.0) >= 0.25, (before, cpu)  # lived only between two calls
