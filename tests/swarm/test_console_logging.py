"""Logs a person reads: hivemind's traceback for a round without a group is dropped (voloco says it in words)."""

from __future__ import annotations

import logging

from swarm.console import setup_logging


class _Keep(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_no_group_traceback_is_dropped_and_other_errors_stay():
    setup_logging("info")
    setup_logging("info")  # twice: one filter, not two
    averager = logging.getLogger("hivemind.averaging.averager")
    keep = _Keep()
    averager.addHandler(keep)
    try:
        try:
            raise RuntimeError("Averaging step failed: could not find a group")
        except RuntimeError as e:
            averager.exception(e)
        averager.error("a real failure")
    finally:
        averager.removeHandler(keep)
    assert [r.getMessage() for r in keep.records] == ["a real failure"]
    assert sum(type(f).__name__ == "_NoGroupFilter" for f in averager.filters) == 1
