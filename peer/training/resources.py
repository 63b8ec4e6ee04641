"""What this machine can give to training: memory (detected or declared) and link bandwidth."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import psutil
import torch

from protocol.model.capacity import fits_full_replica, replica_bytes
from protocol.spec import RunSpec

logger = logging.getLogger("voloco.resources")

DEFAULT_BANDWIDTH_MBPS = 100.0
HEADROOM = 0.8  # of detected memory: the framework, the Python process and the exchange need the rest
SHARED_GPU = 0.9  # a GPU with less of its memory free than this at start is shared (tests/training/test_resources.py)


@dataclass(frozen=True)
class Resources:
    memory_bytes: int
    bandwidth_mbps: float
    source: str  # how memory_bytes was found: "declared", "cuda" (or "cuda: ... free ..."), "ram"

    def fits(self, spec: RunSpec) -> bool:
        return fits_full_replica(spec, self.memory_bytes)

    def describe(self, spec: RunSpec) -> str:
        need = replica_bytes(spec)
        verdict = "holds a full replica" if self.fits(spec) else "too small for a full replica: joining a chain"
        return (
            f"{self.memory_bytes / 1e9:.2f} GB for training ({self.source}), a full replica needs "
            f"{need / 1e9:.2f} GB: {verdict}; link {self.bandwidth_mbps:g} Mbit/s"
        )


def detect(device: torch.device, max_memory_gb: Optional[float], bandwidth_mbps: Optional[float]) -> Resources:
    """Declared limits win; otherwise the device's memory (CUDA: the whole GPU's, or what other
    processes left free of it) or the available RAM, with headroom."""
    bandwidth = bandwidth_mbps if bandwidth_mbps else DEFAULT_BANDWIDTH_MBPS
    if max_memory_gb is not None:
        return Resources(int(max_memory_gb * 1e9), bandwidth, "declared")
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        free = min(total, torch.cuda.mem_get_info(device)[0])
        if free >= SHARED_GPU * total:
            return Resources(int(total * HEADROOM), bandwidth, "cuda")
        # other processes hold this GPU's memory (another peer on the same card): size to what is left
        return Resources(int(free * HEADROOM), bandwidth,
                         f"cuda: {free / 1e9:.1f} of its {total / 1e9:.1f} GB free, other processes hold the rest")
    return Resources(int(psutil.virtual_memory().available * HEADROOM), bandwidth, "ram")
