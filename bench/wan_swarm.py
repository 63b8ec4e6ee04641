"""One arm of bench/wan.py on the test hosts: start it, watch it to its token budget, stop it, measure.

The hosts (tests/support/netns_hosts.py) are ``coord`` (the voloco coordinator, or hivemind's bootstrap
node) and four peers ``p0``..``p3``; ``p3``'s inner steps are ``slowdown`` times slower
(bench/wan_host.py). Every worker process is started inside its host's namespace, from the
repository root with ``python -m``; once it has started up (a voloco peer waits for its
groupmates, a hivemind worker is ready) its process tree moves into its host's CPU quota
(``CpuLimit``, equal for every peer): start-up is not what the benchmark measures.

A voloco arm is ``voloco coordinator --config run.toml`` and four ``voloco peer``s (each wrapped by
bench/wan_host.py, which logs its compute time) with ``--wait-peers 4``, as a person would start
them; a hivemind arm is bench/wan_hivemind.py's bootstrap and four workers, released together.

The watch polls every worker's status file and compute log twice a second:
- the arm starts at the first inner step of its earliest worker (start-up is not timed), and the
  interface counters are read once every worker has stepped;
- each new round (a voloco peer's round record, a hivemind worker's global step) is a point
  (seconds since the start, validation loss) of the arm's curve; a voloco round's time is when its
  status file was rewritten, a hivemind step's is what the worker wrote;
- the arm ends once the tokens the workers trained into finished rounds add up to the budget (a
  voloco peer's round records count the inner steps in each round's payload; with overlap, steps
  taken while an exchange is still in flight count only with their round): the counters are read
  again, then every process is stopped (SIGINT, then SIGKILL).
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from bench.wan_host import BusyLog, read_json
from bench.wire_bytes import ip_payload, snmp
from protocol.spec import RunSpec
from swarm.helper_processes import signal_tree
from swarm.jsonout import loads_strict

ROOT = Path(__file__).resolve().parents[1]
COORD = "coord"
PEERS = ("p0", "p1", "p2", "p3")
SLOW = "p3"


@dataclass
class Arm:
    name: str
    spec: RunSpec  # voloco: the run spec; hivemind: its model, data, seed and inner optimizer
    hivemind: Optional[Dict[str, Any]] = None  # the worker's flags (bench/wan_hivemind.py); None: a voloco arm


@dataclass
class Point:
    t: float  # seconds since the arm's start
    peer: str
    round: int
    val_loss: Optional[float]


@dataclass
class Watch:
    """What the poll has seen of one arm."""

    launched: float
    start: Optional[float] = None
    end: Optional[float] = None
    counters_start: Dict[str, Dict[str, int]] = field(default_factory=dict)  # host -> its eth0's link_stats
    counters_end: Dict[str, Dict[str, int]] = field(default_factory=dict)
    seen: Dict[str, int] = field(default_factory=dict)
    capped: set = field(default_factory=set)  # hosts whose worker is in its CPU quota
    accounted_start: Dict[str, Tuple[Optional[int], Optional[int]]] = field(default_factory=dict)  # sent, received
    raw: List[Tuple[float, str, int, Optional[float]]] = field(default_factory=list)  # absolute times
    statuses: Dict[str, dict] = field(default_factory=dict)
    # host -> its eth0's link_stats read as its newest status was read (after the status was written),
    # and as the poll before it began (before: that poll still read the older status). The status's
    # accounted totals lie between the two, however late a loaded machine let the poll run
    status_counters: Dict[str, Dict[str, int]] = field(default_factory=dict)
    status_counters_before: Dict[str, Dict[str, int]] = field(default_factory=dict)
    polled: Dict[str, Dict[str, int]] = field(default_factory=dict)  # every host's link_stats as the last poll began
    busy: Dict[str, dict] = field(default_factory=dict)
    failure: Optional[str] = None


def child_env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VOLOCO_")}  # flags only, like the demo's children
    env["PYTHONPATH"] = str(ROOT)
    return env


def accounted(status: dict, way: str = "sent") -> Tuple[Optional[int], Optional[str]]:
    """The bytes a worker says it sent (``way``: or received), and the status key they came from: a
    key naming the wire (true wire-byte accounting, nested one level or not) wins over the
    payload-only ``bytes_sent`` / ``bytes_received``."""
    flat: Dict[str, Any] = {}
    for key, value in (status or {}).items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    numeric = {k: v for k, v in flat.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    names = (way, f"bytes_{way}", f"{way}_bytes")
    wire = sorted(k for k in numeric if "wire" in k.lower() and k.lower().split(".")[-1] in names)
    key = wire[0] if wire else (f"bytes_{way}" if f"bytes_{way}" in numeric else None)
    return (int(numeric[key]), key) if key else (None, None)


def trained_tokens(status: dict, tokens_per_step: int) -> int:
    """Tokens in a worker's finished rounds: its round records' steps where they say, else its count."""
    history = (status or {}).get("history", [])
    if not history:
        return 0
    if all(isinstance(r.get("steps"), int) for r in history):
        return sum(r["steps"] for r in history) * tokens_per_step
    return (status or {}).get("tokens", 0)


def own_util(status: dict) -> Optional[float]:
    """The peer's own utilization figure, if its status has one: the mean of its rounds', else its last."""
    per_round = [r.get("util") for r in (status or {}).get("history", []) if isinstance(r.get("util"), (int, float))]
    if per_round:
        return statistics.mean(per_round)
    util = (status or {}).get("util")
    return float(util) if isinstance(util, (int, float)) else None


class ArmRunner:
    """Runs arms one after another on one set of hosts (``limits``: host -> CpuLimit or None)."""

    def __init__(self, hosts, limits: Dict[str, Any], slowdown: float, workdir: Path, log: Callable[..., None] = print):
        self.hosts, self.limits, self.slowdown, self.workdir, self.log = hosts, limits, slowdown, workdir, log
        self.procs: List[Tuple[str, subprocess.Popen]] = []

    def _slowdown(self, host: str) -> str:
        return str(self.slowdown if host == SLOW else 1.0)

    def _spawn(self, host: str, argv: List[str], logfile: Path) -> subprocess.Popen:
        with open(logfile, "wb") as out:
            p = self.hosts.popen(host, [sys.executable, *argv], cwd=ROOT, env=child_env(), stdout=out,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs.append((host, p))
        return p

    def _cap(self, w: Watch, host: str) -> None:
        """The worker on ``host`` has started up: its process tree into the host's CPU quota."""
        limit = self.limits.get(host)
        if host not in w.capped and limit is not None:
            limit.add_tree(next(p.pid for h, p in self.procs if h == host))
        w.capped.add(host)

    def _link(self, host: str) -> Dict[str, int]:
        """``host``'s eth0 counters and its TCP's retransmitted segments: a segment dropped by a shaped
        link crosses the sender's interface twice but is written by the peer once."""
        return {**self.hosts.link_stats(host), "retrans_segs": snmp(self.hosts, host)["TcpRetransSegs"]}

    def _counters(self) -> Dict[str, Dict[str, int]]:
        return {h: self._link(h) for h in PEERS}

    def _wait_file(self, path: Path, what: str, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while not (path.is_file() and path.read_text().strip()):
            if time.monotonic() > deadline or any(p.poll() is not None for _, p in self.procs):
                raise RuntimeError(f"{what} did not start; see {path.parent}")
            time.sleep(0.2)

    # ---- launching ----------------------------------------------------------------------------
    def _launch_voloco(self, arm: Arm, d: Path) -> None:
        config, addr = d / "run.toml", d / "coordinator.addr"
        config.write_text(arm.spec.to_toml())
        self._spawn(COORD, ["-m", "voloco", "coordinator", "--config", str(config), "--address-file", str(addr),
                            "--host-maddrs", "/ip4/0.0.0.0/tcp/0", "--dashboard-port", "0"], d / "coord.log")
        self._wait_file(addr, "the coordinator")
        mine = [a for a in addr.read_text().split() if f"/ip4/{self.hosts.addr(COORD)}/" in a]
        run_key = (d / "coordinator.addr.run-key").read_text().strip()
        for h in PEERS:
            pd = d / h
            pd.mkdir()
            self._spawn(h, ["-m", "bench.wan_host", "peer", str(pd / "busy.json"), self._slowdown(h), "--", "--join", mine[0],
                            "--run-key", run_key, "--threads", "1", "--wait-peers", str(len(PEERS)),
                            "--status-file", str(pd / "status.json"), "--identity", str(pd / "identity.key"),
                            "--checkpoint-dir", str(pd / "ckpt")], pd / "peer.log")  # fmt: skip

    def _launch_hivemind(self, arm: Arm, d: Path) -> None:
        config, addr = d / "run.toml", d / "bootstrap.addr"
        config.write_text(arm.spec.to_toml())
        self._spawn(COORD, ["-m", "bench.wan_hivemind", "bootstrap", "--host", self.hosts.addr(COORD),
                            "--address-file", str(addr)], d / "bootstrap.log")
        self._wait_file(addr, "hivemind's bootstrap node")
        join = loads_strict(addr.read_text())[0]
        flags = [x for k, v in arm.hivemind.items() for x in (f"--{k.replace('_', '-')}", str(v))]
        for h in PEERS:
            pd = d / h
            pd.mkdir()
            self._spawn(h, ["-m", "bench.wan_hivemind", "worker", "--join", join, "--host", self.hosts.addr(h),
                            "--spec", str(config), "--status-file", str(pd / "status.json"), "--busy-file",
                            str(pd / "busy.json"), "--go-file", str(d / "go"), "--slowdown", self._slowdown(h),
                            *flags], pd / "peer.log")  # fmt: skip

    # ---- watching -----------------------------------------------------------------------------
    def _poll(self, w: Watch, d: Path, hivemind: bool) -> None:
        polled, w.polled = w.polled, self.hosts.link_stats_all()
        for h in PEERS:
            path = d / h / "status.json"
            st = read_json(path)
            if st is None:
                continue
            if st != w.statuses.get(h):
                w.status_counters[h] = self._link(h)
                w.status_counters_before[h] = polled[h]
            w.statuses[h] = st
            w.busy[h] = BusyLog.read(d / h / "busy.json")
            if st.get("phase") in ("waiting for peers", "training") or st.get("state") == "ready":
                self._cap(w, h)
            history = st.get("history", [])
            for rec in history[w.seen.get(h, 0):]:
                t = rec["time"] if hivemind else path.stat().st_mtime
                w.raw.append((t, h, rec.get("epoch", rec.get("round", 0)), rec.get("val_loss")))
            w.seen[h] = len(history)

    def run(self, arm: Arm, budget: int, timeout: float) -> Dict[str, Any]:
        """Run ``arm`` until its workers report ``budget`` tokens (or ``timeout`` s); its measurements."""
        hivemind = arm.hivemind is not None
        per_step = arm.spec.data.batch_size * arm.spec.model.seq_len
        d = self.workdir / re.sub(r"[^a-z0-9]+", "-", arm.name.lower()).strip("-")
        d.mkdir(parents=True)
        self.procs = []
        counters_launch = self._counters()
        w = Watch(launched=time.time(), polled=self.hosts.link_stats_all())
        try:
            (self._launch_hivemind if hivemind else self._launch_voloco)(arm, d)
            while w.end is None and w.failure is None:
                self._poll(w, d, hivemind)
                if hivemind and not (d / "go").exists() and len(w.capped) == len(PEERS):
                    (d / "go").touch()  # every worker is ready: release them together
                firsts = [w.busy.get(h, {}).get("first") for h in PEERS]
                if w.start is None and all(firsts):
                    w.start, w.counters_start = min(firsts), self._counters()
                    w.accounted_start = {h: (accounted(st)[0], accounted(st, "received")[0]) for h, st in w.statuses.items()}
                tokens = sum(trained_tokens(st, per_step) for st in w.statuses.values())
                if w.start is not None and tokens >= budget:
                    w.end, w.counters_end = time.time(), self._counters()
                elif any(p.poll() is not None for _, p in self.procs):
                    w.failure = "exited early: " + ", ".join(f"{h} ({p.returncode})" for h, p in self.procs if p.poll() is not None)
                elif time.time() - w.launched > timeout:
                    w.failure = f"timed out after {timeout:.0f} s at {tokens:,} of {budget:,} tokens"
                else:
                    time.sleep(0.5 if w.start else 0.2)
        except RuntimeError as e:
            w.failure = str(e)
        finally:
            self._stop()
        if w.failure:
            self.log(f"    {arm.name}: FAILED: {w.failure} (logs in {d})", flush=True)
            w.end = w.end or time.time()
            w.counters_end = w.counters_end or self._counters()
            w.counters_start = w.counters_start or counters_launch
        return summarize(arm, w, counters_launch, d, per_step)

    def _stop(self) -> None:
        for _, p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGINT)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 3  # the figures are in: no need for a clean stop
        for _, p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            signal_tree(p, signal.SIGKILL)  # its DHT process and p2pd too
            p.wait()
        for limit in self.limits.values():  # nothing of this arm keeps running into the next
            if limit is not None:
                limit._empty()  # SIGKILL to what is left in the quota: only this arm's workers ran there


def frame_payload(before: Dict[str, int], after: Dict[str, int], way: str) -> int:
    """What of an interface's bytes between two readings is not frame headers (bench/wire_bytes.py's
    ``ip_payload`` of the difference; a GSO packet counts once, with one set of headers, as the kernel
    sent it; a UDP datagram's 42 bytes of headers are taken as 66, a few KB over a run)."""
    return max(0, ip_payload({k: after[k] - before[k] for k in after}, way))


def summarize(arm: Arm, w: Watch, counters_launch: Dict[str, Dict[str, int]], d: Path, per_step: int) -> Dict[str, Any]:
    start = w.start if w.start is not None else w.launched
    points = sorted((Point(t - start, h, r, v) for t, h, r, v in w.raw if t <= w.end + 1.0), key=lambda p: p.t)
    last: Dict[str, Point] = {}
    for p in points:
        last[p.peer] = p
    top = max((p.round for p in last.values()), default=None)
    finals = [p.val_loss for p in last.values() if p.round == top and p.val_loss is not None]
    peers = {}
    for h in PEERS:
        st, busy = w.statuses.get(h, {}), w.busy.get(h, {})
        first = busy.get("first")
        sent, key = accounted(st)  # since the worker started: less what it had sent at the arm's start
        received = accounted(st, "received")[0]
        sent_start, received_start = w.accounted_start.get(h, (None, None))
        c0, c1, launch = w.counters_start[h], w.counters_end[h], counters_launch[h]
        peers[h] = dict(
            speed="slow" if h == SLOW else "fast", peer_id=st.get("peer_id"), tokens=trained_tokens(st, per_step),
            tokens_stepped=st.get("tokens", 0),
            rounds=len(st.get("history", [])), busy_s=busy.get("busy_s"),
            util=busy["busy_s"] / (w.end - first) if first and w.end > first else None, own_util=own_util(st),
            wire_sent=c1["tx_bytes"] - c0["tx_bytes"], wire_received=c1["rx_bytes"] - c0["rx_bytes"],
            wire_sent_with_startup=c1["tx_bytes"] - launch["tx_bytes"],
            wire_received_with_startup=c1["rx_bytes"] - launch["rx_bytes"],
            wire_payload_sent_at_status=frame_payload(launch, w.status_counters.get(h, c1), "tx"),
            wire_payload_received_at_status=frame_payload(launch, w.status_counters.get(h, c1), "rx"),
            wire_payload_sent_before_status=frame_payload(launch, w.status_counters_before.get(h, c1), "tx"),
            wire_payload_received_before_status=frame_payload(launch, w.status_counters_before.get(h, c1), "rx"),
            wire_retrans_segs_at_status=w.status_counters.get(h, c1)["retrans_segs"] - launch["retrans_segs"],
            accounted_sent=None if sent is None else sent - (sent_start or 0), accounted_sent_with_startup=sent,
            accounted_received=None if received is None else received - (received_start or 0),
            accounted_received_with_startup=received, accounted_key=key,
        )  # fmt: skip
    initial = [st.get("initial_val_loss") for st in w.statuses.values() if st.get("initial_val_loss") is not None]
    return dict(
        arm=arm.name, kind="hivemind" if arm.hivemind is not None else "voloco", finished=w.failure is None,
        failure=w.failure, wall_s=w.end - start, tokens=sum(p["tokens"] for p in peers.values()),
        initial_val_loss=statistics.median(initial) if initial else None,
        final_val_loss=statistics.median(finals) if finals else None, final_round=top,
        curve=[dict(t=p.t, peer=p.peer, round=p.round, val_loss=p.val_loss) for p in points],
        peers=peers, spec=arm.spec.to_dict(), hivemind=arm.hivemind, logs=str(d),
    )  # fmt: skip


def time_to(curve: List[dict], target: float) -> Optional[float]:
    """Seconds from the arm's start to its first validation loss at or below ``target`` (None: never)."""
    return next((p["t"] for p in curve if p["val_loss"] is not None and p["val_loss"] <= target), None)


def calibrate(spec: RunSpec, limits: Dict[str, Any], slowdown: float, seconds: float, workdir: Path) -> Dict[str, float]:
    """Tokens/s of the run's inner steps on every peer host's CPU quota (and p3 slowed down), all four at once."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "probe.toml"
    config.write_text(spec.to_toml())
    procs = {}
    for h in PEERS:
        limit = limits.get(h)
        procs[h] = subprocess.Popen([sys.executable, "-m", "bench.wan_host", "probe", str(config),
                                     str(slowdown if h == SLOW else 1.0), str(seconds),
                                     str(workdir / f"probe-{h}.json")], cwd=ROOT, env=child_env(),
                                    preexec_fn=limit.join if limit is not None else None)  # fmt: skip
    out = {}
    for h, p in procs.items():
        if p.wait(timeout=seconds * 10 + 120):
            raise RuntimeError(f"the speed probe on {h} failed ({p.returncode})")
        out[h] = read_json(workdir / f"probe-{h}.json")["tokens_per_s"]
    return out
