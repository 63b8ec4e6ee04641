"""What bench/wan.py runs on a test host besides hivemind's worker (bench/wan_hivemind.py).

    python -m bench.wan_host peer BUSY_FILE SLOWDOWN -- PEER FLAGS...   a real `voloco peer`
    python -m bench.wan_host probe RUN_TOML SLOWDOWN SECONDS OUT          tokens/s of inner steps

Every worker of the benchmark, voloco's or hivemind's, keeps a ``BusyLog``: the seconds it spent in
inner steps (forward, backward, local optimizer step), the wall-clock times of its first and last
one, and its step count, rewritten atomically after every step. The bench reads it to compute each
worker's compute utilization over the same window for every arm (its first step to the arm's end),
whatever the peer's own status reports. For a voloco peer it wraps ``Utilization.busy``
(peer/host/utilization.py), which the round loop calls with the duration of every inner step: the same
figure the peer's own ``util`` is made of.

``SLOWDOWN`` makes a worker's device that many times slower: after every inner step it waits
(SLOWDOWN - 1) times the step's duration before the next one, and that wait counts as compute (a
slower GPU would be busy for it). A CPU quota cannot do this on a shared machine: it is only a
ceiling, and when other work loads the cores every process gets less than its ceiling, the
capped-hardest one least of all (0.4 against 0.2 CPU measured 1.33x, not 2x, under load).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from typing import Optional

from swarm.jsonout import loads_strict, write_atomic


class BusyLog:
    """Seconds of compute, first/last step times (``time.time()``) and steps, kept in a JSON file."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.busy_s, self.first, self.last, self.steps = 0.0, None, None, 0

    def add(self, seconds: float) -> None:
        end = time.time()
        if self.first is None:
            self.first = end - seconds
        self.busy_s += max(0.0, seconds)
        self.last, self.steps = end, self.steps + 1
        write_atomic(self.path, {"busy_s": self.busy_s, "first": self.first, "last": self.last, "steps": self.steps})

    @staticmethod
    def read(path: Path) -> dict:
        """What a worker logged so far ({} before its first step)."""
        return read_json(path) or {}


def read_json(path: Path) -> Optional[dict]:
    """A JSON file another process rewrites atomically; None while it is missing or unreadable."""
    try:
        return loads_strict(Path(path).read_text())
    except (OSError, ValueError):
        return None


def slowed(step, slowdown: float):
    """``step`` (a function) that then waits ``slowdown - 1`` times its own duration."""
    if slowdown <= 1:
        return step

    def slow_step(*args, **kw):
        t = time.perf_counter()
        out = step(*args, **kw)
        time.sleep((slowdown - 1) * (time.perf_counter() - t))
        return out

    return slow_step


def run_peer(busy_file: str, slowdown: float, flags: list) -> int:
    """``voloco peer FLAGS`` in this process, ``slowdown`` times slower per inner step (peer/training/inner.py's
    ``InnerTrainer.step``: the round loop times it, waits included), every step's duration in ``busy_file``."""
    from peer.training import inner
    from peer.host import utilization
    from voloco.cli import main

    inner.InnerTrainer.step = slowed(inner.InnerTrainer.step, slowdown)
    log = BusyLog(Path(busy_file))
    busy = utilization.Utilization.busy

    def logged_busy(self, seconds: float) -> None:
        busy(self, seconds)
        log.add(seconds)

    utilization.Utilization.busy = logged_busy
    return main(["peer", *flags])


def probe(run_toml: str, slowdown: float, seconds: float, out: str) -> int:
    """Inner steps of the run's model for ``seconds`` (after one warm-up step), ``slowdown`` times
    slower as a peer's; tokens/s into ``out``."""
    import torch

    from peer.training.data import TrainStream, load_corpus
    from peer.training.inner import InnerTrainer
    from peer.training.model import build_model
    from protocol.spec import RunSpec

    torch.set_num_threads(1)
    spec = RunSpec.from_toml(Path(run_toml).read_text())
    trainer = InnerTrainer(build_model(spec.model, spec.seed), spec.inner)
    stream = TrainStream(load_corpus(spec.data.corpus, spec.data.val_fraction), spec.model.seq_len,
                         spec.data.batch_size, spec.seed, shard="probe")
    step = slowed(trainer.step, slowdown)
    step(*stream.next_batch())
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or steps < 2:
        step(*stream.next_batch())
        steps += 1
    write_atomic(Path(out), {"tokens_per_s": steps * stream.tokens_per_batch / (time.perf_counter() - t0), "steps": steps})
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["peer"] and len(argv) >= 4 and argv[3] == "--":
        return run_peer(argv[1], float(argv[2]), argv[4:])
    if argv[:1] == ["probe"] and len(argv) == 5:
        return probe(argv[1], float(argv[2]), float(argv[3]), argv[4])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
