"""CPU seconds a peer's helper processes spend, round by round.

A peer's network work runs outside its own process: hivemind's DHT process (the records it reads and
serves), the gather process (matchmaking, payloads, set lists and fetches: peer/exchange/gatherer.py)
and the p2p daemon (p2pd, a child of the DHT's) that carries every byte of both. None of them trains:
what they spend between two round records is the exchange and the control plane, and it grows with
what a peer reads, serves and receives (the scale issue's "CPU seconds of the exchange per peer").

``HelperCpu(roots).since_last()`` sums user and system seconds over the processes ``roots()`` names
and their descendants (from /proc's children lists; their seconds from psutil), against the totals of the previous call, per pid: a helper that
exited takes its seconds with it, one that started counts from zero. Only those processes: a
compile worker pool (torch.compile) or a data loader the peer may also start are not helpers. The
first call takes the baseline. None where the counters cannot be read (not Linux, a sandbox).
Guarded by tests/swarm/test_cpu_meter.py.

``thread_cpu()`` is the other half: the CPU seconds of this process's own threads, by name, since
they started (a peer's status carries it as ``cpu_by_thread``): what its training, its exchange,
its wire meter and its heartbeat each spent, where the round records give only the exchange's.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Callable, Dict, Iterable, Optional, Tuple

import psutil

from swarm.wire.meter import process_tree

logger = logging.getLogger("voloco.peer")


class HelperCpu:
    def __init__(self, roots: Callable[[], Iterable[Optional[int]]]):
        """``roots()``: the pids of the helper processes now (None for one not started)."""
        self._roots = roots
        self._seen: Dict[int, float] = {}
        self._broken = False

    def _totals(self) -> Dict[int, float]:
        procs = []
        for pid in self._roots():
            if pid is None:
                continue
            for member in process_tree(pid):  # /proc's children lists: psutil's walk reads every process on the host
                try:
                    procs.append(psutil.Process(member))
                except psutil.NoSuchProcess:
                    continue  # a helper that exited: nothing of it to count
        out = {}
        for p in procs:
            try:
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                continue  # exited between the listing and the read: its seconds are gone with it
        return out

    def since_last(self) -> Optional[float]:
        """CPU seconds the helpers spent since the previous call (the first call: since they started)."""
        if self._broken:
            return None
        try:
            now = self._totals()
        except (psutil.Error, OSError) as e:
            self._broken = True
            logger.info(f"the CPU time of this peer's DHT and p2p processes cannot be read ({e}); it is not reported")
            return None
        spent = sum(max(0.0, t - self._seen.get(pid, 0.0)) for pid, t in now.items())
        # a live helper this walk missed (a /proc read that raced a thread's exit) keeps its mark: found again,
        # it counts from there, not its whole life at once; an exited one is forgotten (bounded)
        self._seen = {**{p: t for p, t in self._seen.items() if p not in now and psutil.pid_exists(p)}, **now}
        return spent


_threads_seen: Dict[int, Tuple[str, float]] = {}  # native id -> (name, seconds) at the last call
_threads_ended: Dict[str, float] = {}  # name -> seconds of threads seen alive once and gone since
_threads_lock = threading.Lock()
UNSEEN = "ended, unnamed"  # threads that started and ended between two calls (a round's exchange thread)


def thread_cpu() -> Optional[Dict[str, float]]:
    """CPU seconds (user + system) of this process's threads since it started, summed by name:
    Python threads by their name less a trailing number ("exchange-4" and "exchange-5" count as
    "exchange"), the main thread as "main", threads Python did not start (torch's workers, hivemind's
    native ones) as "other". A thread seen alive at an earlier call keeps its seconds under its name
    once it has ended; what threads that lived only between two calls spent is ``UNSEEN`` (the
    process's total less the named). None where the counters cannot be read
    (tests/swarm/test_cpu_meter.py::test_a_threads_seconds_count_under_its_name)."""
    with _threads_lock:  # callers on two threads (the exchange's and the training's) read in turn
        try:
            proc = psutil.Process()
            threads, times = proc.threads(), proc.cpu_times()
        except (psutil.Error, OSError, AttributeError):
            return None
        names = {t.native_id: ("main" if t is threading.main_thread() else re.sub(r"[-_ ]?\d+$", "", t.name) or "thread")
                 for t in threading.enumerate() if t.native_id is not None}
        live = {t.id: (names.get(t.id, "other"), t.user_time + t.system_time) for t in threads}
        for tid, (name, seconds) in _threads_seen.items():
            now = live.get(tid)
            if now is None or now[1] < seconds or now[0] not in (name, "other"):  # gone (or its id taken by a newer thread)
                _threads_ended[name] = _threads_ended.get(name, 0.0) + seconds
            elif now[0] != name:  # joined in Python, not yet gone from the OS: still that thread, under its name
                live[tid] = (name, now[1])
        _threads_seen.clear()
        _threads_seen.update(live)
        out = dict(_threads_ended)
    for name, seconds in live.values():
        out[name] = out.get(name, 0.0) + seconds
    unseen = times.user + times.system - sum(out.values())
    if unseen >= 0.001:
        out[UNSEEN] = unseen
    return {name: round(v, 3) for name, v in sorted(out.items(), key=lambda kv: -kv[1])}
