"""A peer's or coordinator's helper processes stop when their main process stops them, or dies.

The helpers are the processes the main thread forks: hivemind's DHT and averager, and the p2pd
daemon the DHT starts. Ctrl+C in a terminal sends SIGINT to the whole foreground process group.
Left in that group, p2pd exits on it at once while the main process is still stopping the
helpers in order (checkpoint, averager, DHT): their last calls to p2pd then fail with tracebacks
("No such file or directory"), and a helper that kept the main process's handler raised
KeyboardInterrupt on the SIGTERM of hivemind's hard shutdown. So each helper, right after its fork:

- starts a process group of its own: a terminal's Ctrl+C reaches the main process only, which stops
  the helpers itself (uvloop runs these fork hooks when the DHT process starts p2pd, so p2pd does
  the same, and gets the parent-death signal of the DHT process);
- ignores SIGINT, and on SIGTERM ends its whole group (itself and its p2pd) at once;
- is sent SIGTERM by the kernel when its main process dies (Linux's parent-death signal), so a main
  process killed hard (SIGKILL, the out-of-memory killer) leaves no helper or p2pd behind, as a kill
  of the old shared group did.

Only forks from the main thread are changed: the parent-death signal follows the thread that forked,
and no helper is forked elsewhere. Guarded by tests/host/test_lifecycle.py (Ctrl+C to the group, a
main process killed hard) and tests/swarm/test_helper_processes.py.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from typing import Callable, List, Optional

import psutil

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_installed = False
_prctl: Optional[Callable[..., int]] = None  # libc's prctl, looked up before any fork (not in a forked child)
_forking: Optional[int] = None  # the pid of the process forking from its main thread, set just before the fork


def keep_helpers_off_the_terminal() -> None:
    """Make every later fork of the main thread a helper as the module describes (once per process)."""
    global _installed, _prctl
    if _installed:
        return
    _installed = True
    try:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: a helper outlives a main process killed hard
        _prctl = None
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


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


def signal_tree(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group of ``pid`` and to the group of every process under it: how a
    supervisor (the demo, a test) stops, freezes or kills a peer whole, its helpers included."""
    groups: List[int] = []
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)  # read before a SIGSTOP or SIGKILL changes the tree
    except psutil.NoSuchProcess:
        procs = []
    for proc in procs:
        try:
            group = os.getpgid(proc.pid)
        except ProcessLookupError:
            continue
        if group not in groups:
            groups.append(group)
    for group in groups or [pid]:  # a reaped leader's group may still hold its helpers
        try:
            os.killpg(group, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _before_fork() -> None:
    global _forking
    _forking = os.getpid() if threading.current_thread() is threading.main_thread() else None


def _after_fork_in_parent() -> None:
    global _forking
    _forking = None


def _after_fork_in_child() -> None:
    global _forking
    parent, _forking = _forking, None
    if parent is None:
        return
    try:
        os.setpgid(0, 0)
    except OSError:
        return  # still in the main process's group: leave the signals as they were
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the main process decides what a closed terminal means
    signal.signal(signal.SIGTERM, _end_group)
    if _prctl is None:
        return
    _prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent:  # the main process died before the signal was armed
        _end_group(signal.SIGTERM, None)


def _end_group(signum, frame) -> None:
    """SIGTERM in a helper: end its group (itself and the p2pd it started), at once."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if os.getpgid(0) == os.getpid():
        os.killpg(0, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGTERM)
