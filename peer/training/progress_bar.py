"""The peer's live progress bar on a terminal (plain log lines elsewhere); byte counts: ``swarm.console.human_bytes``."""

from __future__ import annotations

import sys
import time


class ProgressBar:
    """``round 3 [########------] 18/30 loss 2.41 | 9.1k tok/s``, redrawn in place on a TTY.

    When stderr is not a terminal (a log file, the demo's children) it prints nothing: the peer's
    per-round log line carries the same figures.
    """

    def __init__(self, total: int, label: str, stream=None, width: int = 24):
        self.total, self.label, self.width = max(1, total), label, width
        self.stream = stream or sys.stderr
        self.enabled = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last = 0.0

    def update(self, done: int, note: str = "") -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < self.total and now - self._last < 0.1:
            return
        self._last = now
        filled = self.width * done // self.total
        bar = "#" * filled + "-" * (self.width - filled)
        self.stream.write(f"\r{self.label} [{bar}] {done}/{self.total} {note}\033[K")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r\033[K")
            self.stream.flush()
