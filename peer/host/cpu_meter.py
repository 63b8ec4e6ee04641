"""CPU seconds a peer's helper processes spend, round by round.

A peer's network work runs outside its own process: hivemind's DHT process (the records it reads and
serves), the gather process (matchmaking, payloads, set lists and fetches: peer/exchange/gatherer.py)
and the p2p daemon (p2pd, a child of the DHT's) that carries every byte of both. None of them trains:
what they spend between two round ends is the round's exchange and control plane, and it grows with
what a peer reads, serves and receives (the scale issue's "CPU seconds of the exchange per peer").

``ChildCpu.since_last()`` sums user and system seconds over the process's descendants (psutil),
against the totals of the previous call, per pid: a helper that exited takes its seconds with it, one
that started counts from zero. None where the counters cannot be read (not Linux, a sandbox).
Guarded by tests/host/test_cpu_meter.py.
"""

from __future__ import annotations

import logging
import os
from typing import Dict, Optional

import psutil

logger = logging.getLogger("voloco.peer")


class ChildCpu:
    def __init__(self, pid: Optional[int] = None):
        self._pid = os.getpid() if pid is None else pid
        self._seen: Dict[int, float] = {}
        self._broken = False

    def _totals(self) -> Dict[int, float]:
        out = {}
        for child in psutil.Process(self._pid).children(recursive=True):
            try:
                t = child.cpu_times()
                out[child.pid] = t.user + t.system
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue  # exited between the listing and the read: its seconds are gone with it
        return out

    def since_last(self) -> Optional[float]:
        """CPU seconds the descendants spent since the previous call (the first call: since they started)."""
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
