"""Logs a person reads, and a clean exit: hivemind's traceback for a round without a group is dropped (voloco
says it in words); a command's process ends with its exit code whatever threads still run."""

from __future__ import annotations

import logging
from pathlib import Path

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


def test_exit_process_ends_with_the_commands_code_and_flushed_output_whatever_threads_still_run(tmp_path):
    """swarm/console.py's ``exit_process``: the command's exit code, its last log line and printed
    output kept, a daemon thread still running and a child process left do not hold the exit."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import logging, multiprocessing, sys, threading, time
        from swarm.console import exit_process, setup_logging

        def command():
            setup_logging("info")
            threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
            multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,)).start()
            print("printed", end="")  # no newline: only a flush writes it
            logging.getLogger("voloco.peer").info("stopped")
            return 3

        exit_process(command)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=str(Path(__file__).resolve().parents[2]))
    assert done.returncode == 3
    assert done.stdout == "printed" and "stopped" in done.stderr
