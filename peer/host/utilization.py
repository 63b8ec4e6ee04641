"""How busy a peer's compute is, and what it computes on: the ``util`` and ``device`` of its progress record.

Utilization is the time spent in inner steps over the wall time of a window: from the end of one
round to the end of the next, so the wait for the group, the exchange, the evaluation and a
state download all count as idle. During the first round (no window closed yet) it is the ratio
so far.
"""

from __future__ import annotations

import time
from functools import lru_cache
from typing import Any, Callable, Dict, Optional

from protocol.dht.records import REACH

MAX_DEVICE_CHARS = 64  # protocol/dht/records.py: progress.device


class Utilization:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._start = clock()
        self._busy = 0.0
        self._last: float = -1.0  # the last closed window's ratio; < 0: none closed yet
        self.last_busy, self.last_steps = 0.0, 0  # the seconds of compute in the last closed window, its steps
        self._steps = 0

    def busy(self, seconds: float) -> None:
        """Count ``seconds`` of compute (one inner step) in the current window."""
        if seconds > 0:
            self._busy += seconds
            self._steps += 1

    def round_done(self) -> float:
        """Close the window (a round ended) and start the next; returns the closed window's ratio."""
        now = self._clock()
        self._last = self._ratio(self._busy, now - self._start)
        self._start, self.last_busy, self.last_steps, self._busy, self._steps = now, self._busy, self._steps, 0.0, 0
        return self._last

    @property
    def value(self) -> float:
        """In [0, 1]: the last round's utilization, or the current window's before any round ended."""
        if self._last >= 0:
            return self._last
        return self._ratio(self._busy, self._clock() - self._start)

    @staticmethod
    def _ratio(busy: float, wall: float) -> float:
        return min(1.0, max(0.0, busy / wall)) if wall > 0 else 0.0


@lru_cache(maxsize=8)
def device_label(device: str) -> str:
    """A short, printable name of a torch device: ``cpu``, ``cuda:0 NVIDIA H100 80GB HBM3``."""
    label = str(device)
    if label.startswith("cuda"):
        try:
            import torch

            dev = torch.device(label)
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            label = f"cuda:{index} {torch.cuda.get_device_name(index)}"
        except Exception:  # no CUDA here: the name as given
            pass
    label = "".join(ch if ch.isprintable() else "?" for ch in label)
    return label[:MAX_DEVICE_CHARS]


def device_peak_bytes(device: Any) -> Optional[int]:
    """The most GPU memory torch has allocated on ``device`` since the process started (its status
    file's ``device_peak_bytes``: what bench/gpu_swarm.py holds against the memory estimate); None on
    the CPU, where torch keeps no such counter."""
    if not str(device).startswith("cuda"):
        return None
    try:
        import torch

        return int(torch.cuda.max_memory_allocated(torch.device(str(device))))
    except Exception:  # no CUDA after all: unknown
        return None


def progress_extras(peer: Any) -> Dict[str, Any]:
    """What a peer's progress record says of its compute and reachability: device, util, reach.

    ``peer.reach`` is set by the reachability check (swarm/access/reachability.py); anything but a known
    value is published as ``unknown``, so a record this peer writes always parses."""
    reach = getattr(peer, "reach", "unknown")
    util = getattr(peer, "util", None)
    device = getattr(peer, "device", None) or getattr(getattr(peer, "opts", None), "device", "")
    return {
        "device": device_label(str(device)),
        "util": float(util.value) if util is not None else 0.0,
        "reach": reach if isinstance(reach, str) and reach in REACH else "unknown",
    }
