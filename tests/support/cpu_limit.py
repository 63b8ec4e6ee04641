"""A CPU quota for a process tree, as a cgroup v2 group: a host that computes slower than this
machine (``CpuLimit``). Used beside tests/support/netns_hosts.py by bench/wan.py, whose peers must
compute alike whatever else the machine runs. ``throttle``: a slower process without cgroups
(stopped and continued by signals), for the mixed-speed tests.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from typing import List, Optional, Tuple


_CGROUP = "/sys/fs/cgroup"
_CPU_PERIOD_US = 100_000


def _cpu_cgroup_root() -> Tuple[Optional[str], int]:
    """Where this machine's cpu controller takes new groups, and its cgroup version (0: none)."""
    try:
        if "cpu" in open(os.path.join(_CGROUP, "cgroup.subtree_control")).read().split():
            return _CGROUP, 2  # unified hierarchy with the cpu controller enabled for children
    except OSError:
        pass
    v1 = os.path.join(_CGROUP, "cpu")
    return (v1, 1) if os.path.isfile(os.path.join(v1, "cpu.cfs_quota_us")) else (None, 0)


def cpu_limit_unavailable() -> Optional[str]:
    """Why ``CpuLimit`` cannot work here (a reason to print), or None if it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "cgroups need root"
    root, version = _cpu_cgroup_root()
    if root is None:
        return "no cgroup cpu controller (cgroup v2 cpu.max or v1 cpu.cfs_quota_us)"
    probe = os.path.join(root, f"voloco-{os.getpid()}-probe")
    try:
        os.mkdir(probe)
        os.rmdir(probe)
    except OSError as e:
        return f"cannot create a cgroup under {root}: {e}"
    return None


class CpuLimit:
    """At most ``cpus`` CPUs (0.4: 40 ms of every 100 ms) for the processes started inside it.

    A cgroup with a CFS quota: v2 ``cpu.max``, else v1 ``cpu.cfs_quota_us``. Start a process with
    ``preexec_fn=limit.join`` (e.g. ``hosts.popen(name, argv, preexec_fn=limit.join)``), or move it
    later with ``add_tree(pid)``: it and every child it forks (a DHT process, p2pd) share the quota. ``__exit__`` SIGKILLs whatever is
    still inside and removes the group. Needs root.
    """

    def __init__(self, cpus: float, label: str = "cpu"):
        if not 0.01 <= cpus <= (os.cpu_count() or 1):
            raise ValueError(f"cpus must be in [0.01, {os.cpu_count()}], got {cpus}")
        if not re.fullmatch(r"[A-Za-z0-9_]+", label):
            raise ValueError(f"label {label!r}: use letters, digits and _")
        self.cpus, self.label = cpus, label
        self.path: Optional[str] = None

    def __enter__(self) -> "CpuLimit":
        root, version = _cpu_cgroup_root()
        if root is None:
            raise RuntimeError(cpu_limit_unavailable() or "no cgroup cpu controller")
        self.path = os.path.join(root, f"voloco-{os.getpid()}-{self.label}")
        if os.path.isdir(self.path):  # an earlier instance of this process left it: empty it
            self._empty()
        else:
            os.mkdir(self.path)
        quota = max(1000, int(self.cpus * _CPU_PERIOD_US))
        if version == 2:
            self._write("cpu.max", f"{quota} {_CPU_PERIOD_US}")
        else:
            self._write("cpu.cfs_period_us", str(_CPU_PERIOD_US))
            self._write("cpu.cfs_quota_us", str(quota))
        return self

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def join(self) -> None:
        """Move the calling process into the group (a ``preexec_fn``: runs in the child before exec)."""
        self._write("cgroup.procs", str(os.getpid()))

    def add_tree(self, pid: int) -> int:
        """Move process ``pid`` and all its descendants into the group (e.g. once it has started up);
        how many were moved."""
        import psutil

        moved = 0
        try:
            procs = [psutil.Process(pid)]
            procs += procs[0].children(recursive=True)
        except psutil.NoSuchProcess:
            return 0
        for p in procs:
            try:
                self._write("cgroup.procs", str(p.pid))
                moved += 1
            except OSError:  # it exited meanwhile
                pass
        return moved

    def pids(self) -> List[int]:
        try:
            return [int(p) for p in open(os.path.join(self.path, "cgroup.procs")).read().split()]
        except (OSError, TypeError):
            return []

    def _empty(self) -> None:
        for pid in self.pids():  # only what was started inside it: ours
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def __exit__(self, *exc) -> None:
        if self.path is None:
            return
        deadline = time.monotonic() + 10
        while True:
            self._empty()
            try:
                os.rmdir(self.path)
                break
            except FileNotFoundError:
                break
            except OSError:  # busy until the killed processes are reaped
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        self.path = None


def cleanup_stale_cpu_limits() -> List[str]:
    """Remove the groups of ``CpuLimit`` instances whose process is gone (killed runs); their names."""
    root, _ = _cpu_cgroup_root()
    removed = []
    for name in os.listdir(root) if root else []:
        m = re.fullmatch(r"voloco-(\d+)-\w+", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            stale = CpuLimit(1.0)
            stale.path = os.path.join(root, name)
            stale.__exit__(None, None, None)
            removed.append(name)
    return removed


def throttle(pid: int, stop: threading.Event, run_s: float = 0.15, pause_s: float = 0.15) -> threading.Thread:
    """Make a process about twice as slow: stopped for ``pause_s`` after every ``run_s``."""

    def loop() -> None:
        try:
            while not stop.is_set():
                os.kill(pid, signal.SIGSTOP)
                stop.wait(pause_s)
                os.kill(pid, signal.SIGCONT)
                stop.wait(run_s)
        except ProcessLookupError:
            pass
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t
