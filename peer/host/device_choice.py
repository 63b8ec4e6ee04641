"""What a peer trains on, chosen from its flags and the machine: the device, torch.compile, CPU threads.

``choose`` is pure (what the machine has is an argument), so every combination is a table row in
tests/host/test_device_choice.py; ``detect_machine`` reads torch. The peer logs ``Choice.describe()``
once at start, so an operator sees what was chosen and why.

- ``--device auto`` (the default): the first CUDA device when torch sees one, else the CPU.
- ``--compile`` / ``--no-compile``; neither: on for a CUDA full or partial peer (about 2x the
  tokens/s at the 125m and 350m shapes, bench/gpu.py ``--compile``), off on the CPU (compiling costs
  more than it saves at the shapes a CPU trains). A failed compile falls back to eager
  (peer/training/inner.py). Chain stages run eagerly (their forward is split around the links).
- ``--threads N``; none: torch's own choice (the host's cores), which the exchange's decode and
  aggregate use between rounds, where this peer has the host to itself; where other peers run on it,
  or a cgroup's quota allows fewer cores, its share of them (``share``; peer/host/cpu_share.py looks
  again every round).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Tuple

logger = logging.getLogger("voloco.peer")

AUTO = "auto"


@dataclass(frozen=True)
class Machine:
    """What the host offers: whether torch sees a CUDA device, the names of its GPUs (by index), the
    CPU threads torch would use."""

    cuda: bool
    cuda_names: Tuple[str, ...] = ()
    cpu_threads: int = 1  # torch's default
    usable_cores: int = 0  # the CPU affinity capped by a cgroup quota (peer/host/cpu_share.py); 0: unknown
    peers_here: int = 1  # voloco peers on this host, this one included

    def gpu_name(self, device: str) -> str:
        """The name of the GPU ``device`` ("cuda", "cuda:N") names, "" where unknown."""
        index = int(device.partition(":")[2] or 0)
        return self.cuda_names[index] if 0 <= index < len(self.cuda_names) else ""

    @property
    def base_threads(self) -> int:
        """The most threads a peer without ``--threads`` takes: torch's default, within the usable cores."""
        return max(1, min(self.cpu_threads, self.usable_cores or self.cpu_threads))


@dataclass(frozen=True)
class Choice:
    device: str  # a torch device string: "cpu", "cuda", "cuda:N"
    compile: bool
    threads: Optional[int]  # None: torch's default
    why: str
    shared: bool = False  # the thread count is this peer's share of the host, looked at again every round

    def describe(self, machine: Machine) -> str:
        threads = self.threads if self.threads is not None else machine.cpu_threads
        name = machine.gpu_name(self.device) if self.device.startswith("cuda") else ""
        return (f"training on {self.device}{f' ({name})' if name else ''}"
                f", torch.compile {'on' if self.compile else 'off'}, {threads} CPU thread{'' if threads == 1 else 's'}: {self.why}")


def share(base: int, peers: int) -> int:
    """A peer's threads where ``peers`` peers share ``base`` cores: an even split, at least 1."""
    return max(1, base // max(1, peers))


def choose(device: str, compile: Optional[bool], threads: Optional[int], machine: Machine) -> Choice:
    """The device, compile and threads a peer uses. ``device``: ``--device`` ("auto", "cpu", "cuda",
    "cuda:N"; checked by the CLI); ``compile``: ``--compile`` True, ``--no-compile`` False, neither
    None; ``threads``: ``--threads`` or None."""
    reasons = []
    if device == AUTO:
        device = "cuda" if machine.cuda else "cpu"
        reasons.append("--device auto found a CUDA device" if machine.cuda else "--device auto found no CUDA device")
        if len(machine.cuda_names) > 1:  # one peer a GPU: another peer on cuda:0 would share its memory
            reasons.append(f"the first of {len(machine.cuda_names)} GPUs: start one peer per GPU with "
                           f"--device cuda:0 ... cuda:{len(machine.cuda_names) - 1}")
    else:
        reasons.append(f"--device {device}")
    on_cuda = device.startswith("cuda")
    if compile is None:
        compile = on_cuda
        reasons.append("compile on by default on CUDA (--no-compile turns it off)" if on_cuda
                       else "compile off by default on the CPU (--compile turns it on)")
    else:
        reasons.append("--compile" if compile else "--no-compile")
    if threads:
        reasons.append(f"--threads {threads}")
        return Choice(device, compile, threads, "; ".join(reasons))
    base = machine.base_threads
    mine = share(base, machine.peers_here)
    if machine.peers_here > 1:
        reasons.append(f"threads: {machine.peers_here} peers on this host share its {base} cores (--threads N fixes the count)")
    elif base < machine.cpu_threads:
        reasons.append(f"threads: the {base} cores this process may use (CPU affinity, cgroup quota)")
    else:
        reasons.append("threads: torch's default")
    return Choice(device, compile, None if mine == machine.cpu_threads else mine, "; ".join(reasons), shared=True)


def detect_machine(share: bool = True) -> Machine:
    """What torch sees on this host and, where ``share`` (no ``--threads``), its usable cores and the
    peers running on it (where these cannot be read: unknown, and this peer alone, with a warning)."""
    import torch

    from peer.host.cpu_share import peers_on_host, usable_cores

    cuda = torch.cuda.is_available()
    usable, peers = 0, 1
    if share:
        try:
            usable, peers = usable_cores(), peers_on_host()
        except Exception as e:  # never a reason not to start
            logger.warning(f"could not read this host's usable cores or its other peers ({e!r}): taking torch's default threads")
    names = tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) if cuda else ()
    return Machine(cuda=cuda, cuda_names=names, cpu_threads=torch.get_num_threads(),
                   usable_cores=usable, peers_here=peers)
