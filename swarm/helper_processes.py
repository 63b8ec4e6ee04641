"""A peer's or coordinator's helper processes stop when their main process stops them, or dies.

The helpers are hivemind's DHT and averager processes, forked by the main thread while
``starting_helpers()`` is in force, and the p2pd daemon the DHT process starts. Ctrl+C in a
terminal sends SIGINT to the whole foreground process group. Left in that group, p2pd exits on it
at once while the main process is still stopping the helpers in order (checkpoint, averager, DHT):
their last calls to p2pd then fail with tracebacks ("No such file or directory"), and a helper that
kept the main process's handler raised KeyboardInterrupt on the SIGTERM of hivemind's hard
shutdown. So each helper, right after its fork:

- starts a process group of its own: a terminal's Ctrl+C reaches the main process only, which stops
  the helpers itself (uvloop runs fork hooks when the DHT process spawns p2pd, so p2pd does the
  same, with the DHT process as its parent);
- ignores SIGINT and SIGHUP, and dies on SIGTERM (the default action, which a helper stuck in C
  code cannot delay);
- is sent SIGTERM by the kernel when its parent dies (Linux's parent-death signal), so a main
  process killed hard (SIGKILL, the out-of-memory killer) takes its DHT process with it, and that
  one its p2pd, as a kill of the old shared group did.

Only forks of the thread that armed the hooks, while armed, are changed: the parent-death signal
follows the thread that forked, and another fork (a subprocess with a session of its own) must keep
its own rules. Guarded by tests/swarm/test_helper_processes.py and tests/host/test_lifecycle.py.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, List, Optional

import psutil

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_hooked = False
_prctl: Optional[Callable[..., int]] = None  # libc's prctl, looked up before any fork (not in a forked child)
# (pid, thread id) of the process and thread whose forks are helpers now; a helper inherits it, with
# its own pid put in after the fork, so that the p2pd it spawns is a helper of its own
_armed: Optional[tuple] = None


@contextmanager
def starting_helpers() -> Iterator[None]:
    """While in force, the calling thread's forks are helper processes (see the module docstring).
    Used around starting hivemind's DHT and averager."""
    global _armed
    _install()
    before, _armed = _armed, (os.getpid(), threading.get_ident())
    try:
        yield
    finally:
        _armed = before


def on_stop_signals(handler: Callable[[int, object], None]) -> None:
    """Run ``handler`` on SIGINT (Ctrl+C), SIGTERM (a process manager's stop) and SIGHUP (the terminal
    closed), except a SIGHUP already ignored (started under ``nohup``). Main thread only, as Python
    requires."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, handler)


def signal_tree(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to the process group of ``proc`` (started with a session of its own) and to the
    group of every process under it: how a supervisor (the demo, a test) freezes or kills a peer
    whole, its helpers included. Once ``proc`` is reaped only its own group is signalled, as its pid
    may name another process by then; the caller's own group never is."""
    groups: List[int] = [proc.pid]
    if proc.poll() is None:
        try:
            root = psutil.Process(proc.pid)
            under = root.children(recursive=True)  # read before a SIGSTOP or SIGKILL changes the tree
        except psutil.NoSuchProcess:
            under = []
        for child in under:
            try:
                group = os.getpgid(child.pid)
            except ProcessLookupError:
                continue
            if group not in groups:
                groups.append(group)
    for group in groups:
        if group == os.getpgrp():
            continue
        try:
            os.killpg(group, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _install() -> None:
    global _hooked, _prctl
    if _hooked:
        return
    _hooked = True
    try:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: a helper outlives a main process killed hard
        _prctl = None
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _after_fork_in_child() -> None:
    global _armed
    if _armed is None or threading.get_ident() != _armed[1]:
        return
    parent = _armed[0]
    _armed = (os.getpid(), _armed[1])  # this helper's own forks (p2pd) are helpers of it
    try:
        os.setpgid(0, 0)
    except OSError:
        _armed = None
        return  # still in its parent's group: leave the signals as they were
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the main process decides what a closed terminal means
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if _prctl is None:
        return
    _prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)
