"""A process's helpers (hivemind's DHT and the p2pd it starts) leave the terminal's process group,
ignore its Ctrl+C, and die with their main process even when it is killed hard
(swarm/helper_processes.py). Real processes: a small main that starts a real hivemind DHT."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

MAIN = textwrap.dedent(
    """
    import json, os, subprocess, sys, threading, time
    import hivemind
    from swarm.helper_processes import on_stop_signals, starting_helpers

    stopped = threading.Event()
    on_stop_signals(lambda *_: stopped.set())
    pids = {}

    def fork_in_thread():
        pid = os.fork()
        if pid == 0:
            time.sleep(600)
            os._exit(0)
        pids["thread_child"] = pid

    with starting_helpers():
        dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        t = threading.Thread(target=fork_in_thread)  # another thread's fork, while armed: not a helper
        t.start(); t.join()
    # after it, a subprocess with a session of its own still gets one (a helper's group would refuse setsid)
    other = subprocess.Popen(["sleep", "600"], preexec_fn=lambda: None, start_new_session=True)
    pids["dht"], pids["session_child"] = dht.pid, other.pid
    print(json.dumps(pids), flush=True)
    stopped.wait()
    print("stopping", flush=True)
    dht.shutdown()
    os.kill(pids["thread_child"], 9)
    other.kill()
    print("stopped", flush=True)
    """
)


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def start_main(tmp_path):
    log = open(tmp_path / "main.log", "w+")
    proc = subprocess.Popen([sys.executable, "-c", MAIN], stdout=subprocess.PIPE, stderr=log, text=True,
                            start_new_session=True, cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.getcwd()})
    pids = json.loads(proc.stdout.readline())
    dht = psutil.Process(pids["dht"])
    deadline = time.monotonic() + 30
    while not [c for c in dht.children() if "p2pd" in c.name()]:
        assert time.monotonic() < deadline, "the DHT started no p2pd"
        time.sleep(0.1)
    p2pd = [c for c in dht.children() if "p2pd" in c.name()][0]
    return proc, log, dht, p2pd, psutil.Process(pids["thread_child"]), pids["session_child"]


def test_ctrl_c_reaches_the_main_process_only_and_it_stops_its_helpers(tmp_path):
    proc, log, dht, p2pd, thread_child, session_child = start_main(tmp_path)
    try:
        assert os.getsid(session_child) == session_child
        assert os.getpgid(dht.pid) == dht.pid  # a group of its own, and so has p2pd
        assert os.getpgid(p2pd.pid) in (dht.pid, p2pd.pid)
        assert os.getpgid(thread_child.pid) == proc.pid  # a fork from another thread is left as it was
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl+C does
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and out.split()[-2:] == ["stopping", "stopped"], out
        deadline = time.monotonic() + 10
        while (alive(dht) or alive(p2pd)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(dht) and not alive(p2pd)
        log.seek(0)
        text = log.read()
        assert "Traceback" not in text and "No such file" not in text, text
    finally:
        for p in (proc, dht, p2pd, thread_child):
            try:
                p.kill()
            except Exception:
                pass


def test_a_main_process_killed_hard_leaves_no_helper_behind(tmp_path):
    proc, log, dht, p2pd, thread_child, session_child = start_main(tmp_path)
    try:
        os.kill(proc.pid, signal.SIGKILL)  # the out-of-memory killer: the main process only
        proc.wait(10)
        deadline = time.monotonic() + 10
        while (alive(dht) or alive(p2pd)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(dht), "the DHT process outlived its main process"
        assert not alive(p2pd), "p2pd outlived its main process"
    finally:
        for p in (dht, p2pd, thread_child):
            try:
                p.kill()
            except Exception:
                pass
        try:
            os.kill(session_child, signal.SIGKILL)  # in a session of its own: not the main process's to end
        except ProcessLookupError:
            pass
