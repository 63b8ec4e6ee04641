"""Ctrl+C and SIGTERM stop a coordinator and a peer cleanly, as real processes.

A process manager (``kill``, ``docker stop``, systemd with KillMode=mixed) sends SIGTERM to the
main process only; Ctrl+C in a terminal sends SIGINT to the whole foreground process group (p2pd
and hivemind's processes too). Either way each process must: stop within a bounded time, exit 0,
leave a loadable checkpoint (the peer, with --checkpoint-dir), say "stopped" in its status file
(strict JSON), and leave no child behind (p2pd, hivemind's DHT and averager processes).
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from peer.checkpoints.contents import check_meta
from peer.checkpoints.files import first_usable
from swarm.jsonout import loads_strict
from tests.support.swarm_harness import Swarm

STOP_WITHIN_S = 60.0


def descendants(pid: int):
    return psutil.Process(pid).children(recursive=True)


def gone(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def stop_and_check(swarm: Swarm, name: str, proc, sig: int, group: bool) -> dict:
    """Signal ``proc``; it must exit 0 within STOP_WITHIN_S and take every descendant with it."""
    children = descendants(proc.proc.pid)
    names = [c.name() for c in children]
    assert any("p2pd" in n for n in names), names
    t0 = time.monotonic()
    (os.killpg if group else os.kill)(proc.proc.pid, sig)
    try:
        code = proc.proc.wait(STOP_WITHIN_S)
    except Exception:
        raise AssertionError(f"{name} did not stop within {STOP_WITHIN_S:.0f} s:\n{proc.text()[-3000:]}")
    took = time.monotonic() - t0
    print(f"{name} stopped in {took:.1f} s after {signal.Signals(sig).name}{' to its group' if group else ''}")
    assert code == 0, (name, code, proc.text()[-3000:])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(gone(c) for c in children):
        time.sleep(0.2)
    left = [f"{c.pid} {c.name()}" for c in children if not gone(c)]
    assert not left, f"{name} left {left} running:\n{proc.text()[-3000:]}"
    assert "Traceback" not in proc.text(), proc.text()[-3000:]
    return {"seconds": took, "children": names}


def checkpoint_meta(swarm: Swarm, name: str) -> dict:
    meta = first_usable(swarm.workdir / name / "ckpt", lambda tensors, meta: meta)
    assert meta is not None, f"no loadable checkpoint in {swarm.workdir / name / 'ckpt'}"
    check_meta(meta)
    return meta


def final_status(swarm: Swarm, name: str) -> dict:
    status = loads_strict((swarm.workdir / name / "status.json").read_text())  # strict JSON: no NaN
    assert status["state"] == "stopped", status["state"]
    return status


@pytest.mark.slow
def test_sigterm_mid_first_round_writes_a_checkpoint_and_stops(tmp_path):
    """SIGTERM to the main process only, while the first round trains: the peer abandons the round,
    still writes a checkpoint (of the round's start), stops p2pd and exits 0; then the coordinator."""
    swarm = Swarm(tmp_path, inner_steps=100000)  # the first round cannot end before the signal
    try:
        peer = swarm.add_peer("a")
        swarm.wait(lambda: (swarm.status("a") or {}).get("phase") == "training", 180, "the peer training")
        time.sleep(1.0)
        stop_and_check(swarm, "peer", peer, signal.SIGTERM, group=False)
        assert checkpoint_meta(swarm, "a")["round"] == 0
        final_status(swarm, "a")
        stop_and_check(swarm, "coordinator", swarm.coordinator, signal.SIGTERM, group=False)
    finally:
        swarm.close()


@pytest.mark.slow
def test_ctrl_c_after_rounds_stops_peer_and_coordinator(tmp_path):
    """SIGINT to the whole process group (Ctrl+C) after a few rounds, mid-round: exit 0, the last
    round's checkpoint is there and loads, nothing is left running."""
    swarm = Swarm(tmp_path, inner_steps=20)
    try:
        peer = swarm.add_peer("a")
        swarm.wait(lambda: swarm.round_of("a") >= 2, 240, "two rounds")
        time.sleep(0.5)
        stop_and_check(swarm, "peer", peer, signal.SIGINT, group=True)
        status = final_status(swarm, "a")
        assert checkpoint_meta(swarm, "a")["round"] == status["round"] >= 2
        stop_and_check(swarm, "coordinator", swarm.coordinator, signal.SIGINT, group=True)
    finally:
        swarm.close()
