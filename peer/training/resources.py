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


@dataclass(frozen=True)
class Resources:
    memory_bytes: int
    bandwidth_mbps: float
    source: str  # how memory_bytes was found: "declared", "cuda", "ram"

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
    """Declared limits win; otherwise the device's memory (CUDA) or the available RAM, with headroom."""
    bandwidth = bandwidth_mbps if bandwidth_mbps else DEFAULT_BANDWIDTH_MBPS
    if max_memory_gb is not None:
        return Resources(int(max_memory_gb * 1e9), bandwidth, "declared")
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return Resources(int(total * HEADROOM), bandwidth, "cuda")
    return Resources(int(psutil.virtual_memory().available * HEADROOM), bandwidth, "ram")
