"""End-of-round checkpoints written in the background, at a bounded cost.

At the 125m shape a checkpoint (θ, the strategy's buffers, AdamW's moments: 1.4 GB) takes about
6 s to check, digest, serialize and fsync, while a GPU peer trains a round of H = 30 steps in
0.5 s. Written by the round's exchange every round, it would hold the next round's inner steps for
as long, and a GPU peer would spend most of its time waiting on it.

So a checkpoint is collected at the end of a round (a consistent copy, in memory), then written by
this writer's own thread while training goes on; and a new one is due only when the writer is idle
and the time since the last write ended is at least ``COST_RATIO`` times that write's duration. A
small model's checkpoint (milliseconds) is still written every round; a large one's at most a tenth
of the wall time. The stop waits for a write in progress before its own final checkpoint.
Guarded by tests/checkpoints/test_checkpoint_writer.py.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

logger = logging.getLogger("voloco.peer")

COST_RATIO = 10.0  # wall time between two writes >= this x the last write's duration


class CheckpointWriter:
    def __init__(self, cost_ratio: float = COST_RATIO, clock: Callable[[], float] = time.monotonic):
        self.cost_ratio = cost_ratio
        self._clock = clock
        self._thread: Optional[threading.Thread] = None
        self._last_end: Optional[float] = None  # when the last write ended
        self._last_s = 0.0  # how long it took
        self.written = 0
        self.failed = 0

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def due(self) -> bool:
        """Whether a round's checkpoint should be collected now (no write in progress, and enough
        time since the last one for its cost)."""
        if self.busy:
            return False
        return self._last_end is None or self._clock() - self._last_end >= self.cost_ratio * self._last_s

    def submit(self, write: Callable[[], object], done: Callable[[], None] = lambda: None) -> None:
        """Run ``write()`` in the writer's thread (after a write still in progress), then ``done()``.
        A failure is logged (the checkpoints on disk stay as they were) and never reaches training."""
        self.wait()

        def run() -> None:
            start = self._clock()
            try:
                write()
                done()
                self.written += 1
            except Exception as e:  # a full disk, a permission: training goes on, the stop tries again
                self.failed += 1
                logger.error(f"could not write a checkpoint: {e!r}")
            finally:
                self._last_end = self._clock()
                self._last_s = self._last_end - start

        self._thread = threading.Thread(target=run, daemon=True, name="checkpoint-writer")
        self._thread.start()

    def wait(self) -> None:
        """Until the write in progress, if any, has ended."""
        thread = self._thread
        if thread is not None:
            thread.join()
