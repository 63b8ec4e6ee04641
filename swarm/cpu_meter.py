"""CPU seconds a peer's helper processes spend, round by round.

A peer's network work runs outside its own process: hivemind's DHT process (the records it reads and
serves), the gather process (matchmaking, payloads, set lists and fetches: peer/exchange/gatherer.py)
and the p2p daemon (p2pd, a child of the DHT's) that carries every byte of both. None of them trains:
what they spend between two round records is the exchange and the control plane, and it grows with
what a peer reads, serves and receives (the scale issue's "CPU seconds of the exchange per peer").

``HelperCpu(roots).since_last()`` sums user and system seconds over the processes ``roots()`` names
and their descendants (psutil), against the totals of the previous call, per pid: a helper that
exited takes its seconds with it, one that started counts from zero. Only those processes: a
compile worker pool (torch.compile) or a data loader the peer may also start are not helpers. The
first call takes the baseline. None where the counters cannot be read (not Linux, a sandbox).
Guarded by tests/swarm/test_cpu_meter.py.
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, Iterable, Optional

import psutil

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
            try:
                root = psutil.Process(pid)
                procs += [root, *root.children(recursive=True)]
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
        self._seen = now
        return spent
