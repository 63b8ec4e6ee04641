"""A peer's share of the host's CPU: its usable cores split evenly among the voloco peers running here.

Several peers on one host that each take every core oversubscribe it: torch's intra-op threads spin
while they wait for each other, and two peers of the default run on 2 cores, 2 threads each, trained
about a quarter of the tokens a second that the same two trained with 1 thread each
(bench/co_located.py).
Without ``--threads`` a peer therefore takes ``max(1, cores // peers here)`` threads
(peer/host/device_choice.py ``share``), where

- the cores are the ones it may run on (its CPU affinity), and no more than its cgroup's CPU quota
  allows (a container started with ``--cpus 2`` on a 64-core host has 2, not 64), and never more
  than torch's own default;
- the peers here are the processes of this host (as far as its process table shows them: a peer in
  another container is not seen, its cores are its container's) that run ``voloco peer``,
  ``python -m voloco peer`` or ``python -m peer``, counted once per process tree (a peer's DHT and
  averager processes are forks with its command line), this one included.

A thread of ``ThreadShare`` counts the peers every ``every_s`` (reading another process's command
line can block a while); ``refresh``, at the start of every round, sets the count from the training
thread (torch takes its thread count per thread; an exchange thread takes the count set last when it
starts, so one already running keeps the old count for the rest of its round). So a peer started
later makes the earlier ones give up their share, and one that stopped gives it back. θ does not
depend on the thread count (peer/outer/robust.py: sums in a fixed order;
tests/outer/test_thread_count.py). Kernels that ``--compile`` built on the CPU keep the count they
were compiled with. Guarded by tests/host/test_cpu_share.py.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence, Set, Tuple

import psutil

logger = logging.getLogger("voloco.peer")

CGROUP_ROOT = Path("/sys/fs/cgroup")


def is_peer_command(argv: Sequence[str]) -> bool:
    """Whether a command line runs a voloco peer: ``voloco peer …`` (the console script, run directly
    or by an interpreter), ``python -m voloco peer …`` or ``python -m peer …``."""
    args = list(argv)
    for i, a in enumerate(args[:-1]):
        if os.path.basename(a) == "voloco" and args[i + 1] == "peer":
            return True
        if a == "-m" and args[i + 1] == "peer":
            return True
        if a == "-m" and args[i + 1] == "voloco" and i + 2 < len(args) and args[i + 2] == "peer":
            return True
    return False


def quota_cores(cpu_max: str) -> Optional[float]:
    """The cores a cgroup v2 ``cpu.max`` ("QUOTA PERIOD", or "max PERIOD") allows, None for no limit."""
    parts = cpu_max.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def cgroup_cores(proc_cgroup: str, read: Callable[[Path], Optional[str]], root: Path = CGROUP_ROOT) -> Optional[float]:
    """The tightest CPU quota over this process's cgroup and its ancestors (cgroup v2: ``cpu.max``;
    v1: ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), None where none limits it. ``proc_cgroup``:
    the text of /proc/self/cgroup; ``read``: a file's text, None where it cannot be read."""
    limits = []
    for line in proc_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        rel = Path(path.lstrip("/"))
        chain = [rel, *rel.parents]
        if hierarchy == "0" and controllers == "":
            for p in chain:
                text = read(root / p / "cpu.max")
                cores = quota_cores(text) if text else None
                if cores is not None:
                    limits.append(cores)
        elif "cpu" in controllers.split(","):
            # mounted as cpu, or cpu,cpuacct (a symlink to the other), whatever order /proc lists them in
            mounts = ["cpu", controllers, ",".join(sorted(controllers.split(",")))]
            for p in chain:
                for mount in dict.fromkeys(mounts):
                    base = root / mount / p
                    quota, period = read(base / "cpu.cfs_quota_us"), read(base / "cpu.cfs_period_us")
                    cores = quota_cores(f"{quota.strip()} {period.strip()}") if quota and period else None
                    if cores is not None:
                        limits.append(cores)
                        break
    return min(limits) if limits else None


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text()
    except (OSError, ValueError):  # absent, unreadable, not text
        return None


def usable_cores() -> int:
    """The cores this process may use: its CPU affinity, capped by its cgroup's quota (rounded up)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = cgroup_cores(_read(Path("/proc/self/cgroup")) or "", _read)
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota - 1e-9)))
    return max(1, cores)


def peer_roots(commands: Dict[int, Sequence[str]], parents: Dict[int, int]) -> Set[int]:
    """The peer processes among ``commands`` (pid -> argv) whose parent (``parents``: pid -> parent
    pid) is not one: one a peer, its forked helpers (which carry its command line) left out."""
    peers = {pid for pid, argv in commands.items() if is_peer_command(argv)}
    return {pid for pid in peers if parents.get(pid) not in peers}


def count_peer_trees(commands: Dict[int, Sequence[str]], parents: Dict[int, int], me: int) -> int:
    """Peer process trees among ``commands`` with ``parents`` (``peer_roots``), plus this process ``me``
    where it is none (a peer started some other way)."""
    peers = {pid for pid, argv in commands.items() if is_peer_command(argv)}
    mine = me
    while mine in peers and parents.get(mine) in peers:
        mine = parents[mine]
    return len(peer_roots(commands, parents) | {mine})


def process_table() -> Tuple[Dict[int, Sequence[str]], Dict[int, int]]:
    """(pid -> argv, pid -> parent pid) of every process this one may read (psutil)."""
    commands: Dict[int, Sequence[str]] = {}
    parents: Dict[int, int] = {}
    for proc in psutil.process_iter(["cmdline", "ppid"]):
        info = proc.info  # a field psutil could not read is None
        if info.get("cmdline"):
            commands[proc.pid] = list(info["cmdline"])
        if info.get("ppid") is not None:
            parents[proc.pid] = info["ppid"]
    return commands, parents


def peers_on_host() -> int:
    """The voloco peers this host's process table shows, this one included (at least 1)."""
    commands, parents = process_table()
    return count_peer_trees(commands, parents, os.getpid())


class ThreadShare:
    """Keeps a peer's torch thread count at its share of the host (see the module doc). ``base``: the
    most it takes (torch's default capped by the usable cores); ``threads``: the count it starts with;
    ``count``: the peers on this host now; ``set_threads``: torch.set_num_threads. ``start`` counts
    every ``every_s`` in a daemon thread; ``poll`` is one such count."""

    def __init__(self, base: int, threads: int, share: Callable[[int, int], int], count: Callable[[], int] = peers_on_host,
                 set_threads: Optional[Callable[[int], None]] = None, every_s: float = 10.0):
        self.base, self.threads, self._share, self._count = base, threads, share, count
        self._set = set_threads
        self._every = every_s
        self._peers: Optional[int] = None  # the last count, None before the first
        self._stop = threading.Event()

    def poll(self) -> None:
        """Count the peers on this host once (a count that fails keeps the last one)."""
        try:
            self._peers = max(1, int(self._count()))
        except Exception:  # the process table unreadable: keep what we have
            logger.debug("could not count the peers on this host", exc_info=True)

    def start(self) -> "ThreadShare":
        def run():
            while not self._stop.wait(self._every):
                self.poll()

        threading.Thread(target=run, daemon=True, name="cpu-share").start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def refresh(self) -> Optional[int]:
        """At a round's start, in the thread that runs the inner steps: set this thread's count to the
        share (every time: another thread may have set torch's count since); the new count where the
        peers on this host changed it (logged), else None."""
        peers = self._peers
        if peers is None:
            return None
        threads = self._share(self.base, peers)
        if self._set is not None:
            self._set(threads)
        if threads == self.threads:
            return None
        logger.info(f"CPU threads {self.threads} -> {threads}: {peers} peer(s) on this host now share its {self.base} cores "
                    f"(--threads N fixes the count)")
        self.threads = threads
        return threads
