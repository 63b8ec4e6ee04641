"""A benchmark stopped with SIGTERM tears its test hosts down: bench/common.py's ``exit_on_sigterm``
turns the signal into SystemExit, so ``with`` blocks and ``finally`` clauses run (before, the
peers of bench/faults.py kept running in their network namespaces, and the namespaces stayed)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys, time
sys.path.insert(0, {root!r})
from bench.common import exit_on_sigterm
exit_on_sigterm()
try:
    print("armed", flush=True)
    time.sleep(60)
finally:
    open({done!r}, "w").write("torn down")
"""


def test_sigterm_runs_the_benchmarks_cleanup(tmp_path):
    done = tmp_path / "done"
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT.format(root=str(ROOT), done=str(done))],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "armed"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    assert done.read_text() == "torn down"
