"""A swarm whose processes a test can hurt: a coordinator and peers on hosts of their own (network
namespaces on a shaped bridge, tests/support/netns_hosts.py), each process in its own session
(tests/support/swarm_harness.py's Proc), so a fault hits one peer's whole tree (its DHT and averager processes,
p2pd) the way an out-of-memory killer, a suspended laptop or a pulled cable would:

    kill(name)          SIGKILL                    pause(name) / resume(name)   SIGSTOP / SIGCONT
    restart(name)       start it again (same identity, checkpoint directory and host)
    link_down(name) / link_up(name)                its host's eth0 (``ip link set ... down/up``)
    kill_coordinator() / start_coordinator()       same key and port: same run key, same address

A ``Recorder`` thread reads every peer's status file every 0.2 s and keeps each round record it
ever saw (a restarted peer starts a new status file), with the time it first saw it: what the
outcome checks (tests/support/fault_scenarios.py) read.
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from bench.swarm_check import SEQUENTIAL
from bench.wire_bytes import TINY_MODEL
from peer.checkpoints.files import CheckpointError, checkpoint_paths, read_checkpoint
from protocol.spec import RunSpec
from tests.support.netns_hosts import Hosts
from swarm.helper_processes import signal_tree
from tests.support.swarm_harness import Proc, voloco, wait_for

COORD_PORT = 31337  # in the coordinator's own namespace: a restarted coordinator keeps its address


def fault_spec(inner_steps: int = 20) -> RunSpec:
    """The tests' tiny run (d 64, 2 layers) with sequential rounds (no overlap, no early close: every
    round is H steps from the round's θ, as in the in-process simulation of the undisturbed run) and
    short deadlines, so a fault costs seconds."""
    return RunSpec(run_id="faults", seed=1).replace(
        model=TINY_MODEL, data={"batch_size": 8, "val_batches": 2}, inner={"lr": 3e-3, "warmup_steps": 5},
        outer={"strategy": "sparseloco", "inner_steps": inner_steps, **SEQUENTIAL},
        swarm={"matchmaking_time": 2.0, "round_wait": 10.0, "gather_timeout": 5.0, "heartbeat_period": 0.5},
    )


class Recorder(threading.Thread):
    """Every round record of every peer, across restarts: name -> round -> record (+ ``seen``: the
    monotonic time it was read with its θ, changed by a later union take or repair; ``first_seen``:
    when the round's record first appeared: when its start θ was known, the round begun)."""

    def __init__(self, swarm: "FaultSwarm", interval: float = 0.2):
        super().__init__(daemon=True, name="fault-recorder")
        self.swarm, self.interval = swarm, interval
        self.records: Dict[str, Dict[int, dict]] = {}
        self.ids: Dict[str, str] = {}
        self.lock = threading.Lock()
        self._stop = threading.Event()

    def poll(self) -> None:
        now = time.monotonic()
        for name in list(self.swarm.peers):
            s = self.swarm.status(name)
            if not s or not s.get("peer_id"):
                continue
            with self.lock:
                self.ids[name] = s["peer_id"]
                mine = self.records.setdefault(name, {})
                latest = {rec["round"]: rec for rec in s.get("history", [])}  # a round twice: the later record
                for rec in latest.values():
                    old = mine.get(rec["round"])
                    if old is None or old["params_hash"] != rec["params_hash"]:
                        mine[rec["round"]] = {**rec, "seen": now, "first_seen": old["first_seen"] if old else now}

    def run(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def stop(self) -> None:
        self._stop.set()
        self.poll()

    def of(self, name: str) -> Dict[int, dict]:
        with self.lock:
            return dict(self.records.get(name, {}))

    def statuses(self, names: Optional[Sequence[str]] = None) -> List[dict]:
        """What ``swarm_harness.assert_groups_identical`` reads: peer id and every round it recorded."""
        with self.lock:
            return [{"peer_id": self.ids[n], "history": [self.records[n][r] for r in sorted(self.records[n])]}
                    for n in (names or list(self.records)) if n in self.ids and n in self.records]


class FaultSwarm:
    """A context manager: the hosts, the coordinator, the recorder; ``add_peer`` starts peers."""

    def __init__(self, workdir: Path, hosts: Sequence[str], rate: str = "100mbit", spec: Optional[RunSpec] = None,
                 log=print):
        self.workdir, self.spec, self.log = workdir, spec or fault_spec(), log
        self.hosts = Hosts(["coord", *hosts], rate=rate)
        self.peers: Dict[str, Proc] = {}
        self.coordinator: Optional[Proc] = None
        self.incarnations: Dict[str, int] = {}
        self.recorder = Recorder(self)
        self.t0 = time.monotonic()
        self.join: List[str] = []

    def __enter__(self) -> "FaultSwarm":
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "run.toml").write_text(self.spec.to_toml())
        self.hosts.__enter__()
        try:
            self.start_coordinator()
            self.recorder.start()
        except BaseException:
            self.hosts.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.recorder.stop()
        procs = [p for p in [*self.peers.values(), self.coordinator] if p is not None]
        for p in procs:  # all at once: each writes its last checkpoint while the others stop too
            self._signal(p, signal.SIGCONT)
            self._signal(p, signal.SIGINT)
        deadline = time.monotonic() + 15
        for p in procs:
            try:
                p.proc.wait(max(0.1, deadline - time.monotonic()))
            except Exception:
                pass
            p.kill()
        self.hosts.__exit__(*exc)

    # ---- processes ------------------------------------------------------------------------------
    def _start(self, host: str, args: List[str], log_name: str) -> Proc:
        return Proc(self.hosts.prefix(host) + voloco(*args), self.workdir / log_name)

    def _next_log(self, name: str) -> str:
        n = self.incarnations[name] = self.incarnations.get(name, -1) + 1
        return f"{name}.log" if n == 0 else f"{name}.{n}.log"

    def start_coordinator(self) -> None:
        addr = self.workdir / "coordinator.addr"
        addr.unlink(missing_ok=True)
        self.coordinator = self._start("coord", [
            "coordinator", "--config", str(self.workdir / "run.toml"), "--address-file", str(addr),
            "--host-maddrs", f"/ip4/0.0.0.0/tcp/{COORD_PORT}", "--identity", str(self.workdir / "coordinator.key"),
            "--dashboard-port", "0"], self._next_log("coord"))
        self.wait(lambda: addr.is_file() and addr.read_text().strip() or self.coordinator.proc.poll() is not None,
                  90, "the coordinator's address")
        mine = [a for a in addr.read_text().split() if f"/ip4/{self.hosts.addr('coord')}/" in a]
        assert mine, f"the coordinator announces no address on its host's link:\n{self.coordinator.text()[-2000:]}"
        self.join = ["--join", mine[0], "--run-key", (self.workdir / "coordinator.addr.run-key").read_text().strip()]

    def kill_coordinator(self) -> None:
        self.coordinator.kill()

    def add_peer(self, name: str, *extra: str) -> Proc:
        """Start peer ``name`` on its host (again, after a fault: same identity and checkpoints)."""
        d = self.workdir / name
        d.mkdir(exist_ok=True)
        self.recorder.poll()  # keep what the last incarnation reported before its file is replaced
        (d / "status.json").unlink(missing_ok=True)
        self.peers[name] = self._start(name, [
            "peer", *self.join, "--threads", "1", "--status-file", str(d / "status.json"),
            "--checkpoint-dir", str(d / "ckpt"), "--identity", str(d / "identity.key"), *extra], self._next_log(name))
        return self.peers[name]

    restart = add_peer

    def kill(self, name: str) -> None:
        self.recorder.poll()
        self.peers[name].kill()

    @staticmethod
    def _signal(p: Proc, sig: int) -> None:
        signal_tree(p.proc, sig)  # a frozen machine: the peer's helpers too

    def pause(self, name: str) -> None:
        self._signal(self.peers[name], signal.SIGSTOP)

    def resume(self, name: str) -> None:
        self._signal(self.peers[name], signal.SIGCONT)

    def link_down(self, name: str) -> None:
        self.hosts.link_down(name)

    def link_up(self, name: str) -> None:
        self.hosts.link_up(name)

    def alive(self, name: str) -> bool:
        return name in self.peers and self.peers[name].proc.poll() is None

    # ---- what the peers report --------------------------------------------------------------------
    def status(self, name: str) -> Optional[dict]:
        try:
            return json.loads((self.workdir / name / "status.json").read_text())
        except (OSError, ValueError):
            return None

    def texts(self) -> Dict[str, str]:
        """Every log of this swarm, each incarnation's."""
        return {p.name: p.read_text(errors="replace") for p in sorted(self.workdir.glob("*.log"))}

    def wait(self, predicate, timeout: float, what: str) -> None:
        wait_for(predicate, timeout, what, self.texts)

    def last_round(self, name: str) -> int:
        recs = self.recorder.of(name)
        return max(recs) if recs else -1

    def wait_rounds(self, names: Sequence[str], more: int, timeout: float, what: str) -> None:
        """Until each of ``names`` recorded ``more`` rounds past the one it is at now."""
        start = {n: self.last_round(n) for n in names}
        self.wait(lambda: all(self.last_round(n) >= start[n] + more for n in names), timeout, what)

    def period(self, name: str) -> float:
        """The median time between two of ``name``'s last rounds (8 s before it has any)."""
        seen = sorted(r["seen"] for r in self.recorder.of(name).values())[-6:]
        gaps = sorted(b - a for a, b in zip(seen, seen[1:]))
        return gaps[len(gaps) // 2] if gaps else 8.0

    def tx_bytes(self, name: str) -> int:
        return self.hosts.link_stats(name)["tx_bytes"]


def recovered(swarm: FaultSwarm, names: Sequence[str], after: int) -> Optional[Tuple[int, float]]:
    """The first round past ``after`` that every one of ``names`` ended in one group (each in the
    others' group, none excluded) with one θ, and when the last of them reported it; None if none yet."""
    recs = {n: swarm.recorder.of(n) for n in names}
    ids = {n: swarm.recorder.ids.get(n) for n in names}
    common = set.intersection(*(set(r) for r in recs.values())) if recs else set()
    for rnd in sorted(r for r in common if r > after):
        rows = [recs[n][rnd] for n in names]
        if len({r["params_hash"] for r in rows}) != 1:
            continue
        if all(set(ids.values()) <= set(r["group"]) and not set(r["excluded"]) & set(ids.values()) for r in rows):
            return rnd, max(r["seen"] for r in rows)
    return None


def first_round_after(swarm: FaultSwarm, name: str, t: float, grouped: bool = False,
                      begun: bool = False) -> Optional[dict]:
    """The first round record ``name`` reported after time ``t`` (its first round once back); with
    ``grouped``, its first round in a group (a peer that cannot reach anyone yet, or ends a round
    it began before the fault, legitimately trains alone meanwhile); with ``begun``, only a round it
    began after ``t`` (its record of the round's start first appeared after ``t``, or there is none:
    the round began from a state it installed, which a held peer cannot do while held): a round begun
    while its link was down or it was stopped may end apart from its group, and the whole run's
    repaired-split check judges that one. A record of round R is the θ with which round R starts."""
    recs = swarm.recorder.of(name)
    later = [r for r in recs.values()
             if r["seen"] > t and (not grouped or len(r["group"]) > 1)
             and (not begun or recs.get(r["round"] - 1, {}).get("first_seen", math.inf) > t)]
    return min(later, key=lambda r: r["round"]) if later else None


def identical_to_group(swarm: FaultSwarm, name: str, rec: dict) -> bool:
    """Whether ``rec`` (a round of ``name``) was a real group's round and every groupmate that
    recorded it holds the same θ."""
    by_id = {v: k for k, v in swarm.recorder.ids.items()}
    mates = [by_id[m] for m in rec["group"] if m in by_id and by_id[m] != name]
    theirs = [swarm.recorder.of(m).get(rec["round"]) for m in mates]
    theirs = [t for t in theirs if t is not None]
    return bool(theirs) and all(t["params_hash"] == rec["params_hash"] for t in theirs)


def checkpoint_problems(workdir: Path, names: Sequence[str]) -> List[str]:
    """Every checkpoint file of ``names`` that does not load, and every refusal a peer logged."""
    problems = []
    for name in names:
        for path in checkpoint_paths(workdir / name / "ckpt"):
            if path.is_file():
                try:
                    read_checkpoint(path)
                except (CheckpointError, ValueError, OSError) as e:
                    problems.append(f"{path}: {e}")
    for log in sorted(workdir.glob("*.log")):
        problems += [f"{log.name}: {line}" for line in log.read_text(errors="replace").splitlines()
                     if "refusing checkpoint" in line]
    return problems
