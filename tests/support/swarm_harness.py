"""Start real coordinators and peers as processes on loopback, and read what they report.

Each process runs in its own session, so a test can SIGKILL one peer's whole tree (its DHT
process, averager process and p2pd, each in its own process group: swarm/helper_processes.py)
the way a container stop would.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from swarm.helper_processes import signal_tree

LOOPBACK = "/ip4/127.0.0.1/tcp/0"

TINY_SPEC = """
run_id = "{run_id}"
seed = 1
[model]
d_model = 64
n_layers = 2
n_heads = 2
ffn_hidden = 128
seq_len = 64
[data]
batch_size = 8
val_batches = 2
[inner]
lr = 3e-3
warmup_steps = 5
[outer]
strategy = "{strategy}"
inner_steps = {inner_steps}
[swarm]
matchmaking_time = 2.0
round_wait = 20.0
gather_timeout = 10.0
heartbeat_period = 0.5
"""


def voloco(*args: str, module: str = "voloco") -> List[str]:
    """``python -m voloco ARGS``; ``module``: another entry point that takes the same arguments
    (a test's altered peer, e.g. tests/support/hasty_peer.py)."""
    return [sys.executable, "-m", module, *args]


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(voloco(*args), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


# every Proc's log of this test process: a failed check of θ quotes what the peers it names said (_said)
_LOGS: List[Path] = []
SAID = re.compile(r"start vote|state|refus|download|union|sent nothing|held|could not|group|WARNING|ERROR")


class Proc:
    def __init__(self, argv: List[str], log: Path, env: Optional[Dict[str, str]] = None):
        self.log = log
        _LOGS.append(log)
        self._f = open(log, "wb")
        self.proc = subprocess.Popen(
            argv, stdout=self._f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, env={**os.environ, **(env or {})},
        )

    def kill(self) -> None:
        signal_tree(self.proc, signal.SIGKILL)  # its helpers too, each in its own process group
        self.proc.wait()
        self._f.close()

    def stop(self, grace: float = 10.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(grace)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def wait_for(predicate, timeout: float, what: str, logs: Callable[[], Dict[str, str]]) -> None:
    """Poll ``predicate`` until it holds; after ``timeout`` s, fail with the tail of every log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    tails = "\n".join(f"--- {name}\n{text[-3000:]}" for name, text in logs().items())
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{tails}")


class Swarm:
    """A coordinator on loopback; ``add_peer`` starts peers that join it with its run key (and
    ``join_token``, for a private run)."""

    def __init__(self, workdir: Path, strategy: str = "sparseloco", inner_steps: int = 20, spec_text: Optional[str] = None,
                 join_token: Optional[str] = None, dashboard_port: int = 0):
        self.workdir = workdir
        self.spec_path = workdir / "run.toml"
        self.spec_path.write_text(spec_text or TINY_SPEC.format(run_id="test", strategy=strategy, inner_steps=inner_steps))
        self.procs: List[Proc] = []
        self.peers: Dict[str, Proc] = {}
        self.join_token = join_token
        addr_file = workdir / "coordinator.addr"
        token = ["--join-token", join_token] if join_token else []
        self.coordinator = self._start(
            voloco("coordinator", "--config", str(self.spec_path), "--host-maddrs", LOOPBACK, "--address-file", str(addr_file),
                   "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port), *token),  # 0: none
            workdir / "coordinator.log",
        )
        deadline = time.monotonic() + 60
        while not (addr_file.is_file() and addr_file.read_text().strip()):
            if time.monotonic() > deadline or self.coordinator.proc.poll() is not None:
                raise RuntimeError("coordinator did not start:\n" + self.coordinator.text())
            time.sleep(0.2)
        self.join = addr_file.read_text().split()[0]
        self.run_key = (workdir / "coordinator.addr.run-key").read_text().strip()  # written before the address file

    def join_flags(self) -> List[str]:
        """What a peer of this run passes: the coordinator's address, its run key, the join token."""
        return ["--join", self.join, "--run-key", self.run_key] + (["--join-token", self.join_token] if self.join_token else [])

    def _start(self, argv: List[str], log: Path, env: Optional[Dict[str, str]] = None) -> Proc:
        proc = Proc(argv, log, env)
        self.procs.append(proc)
        return proc

    def add_peer(self, name: str, *extra: str, env: Optional[Dict[str, str]] = None, log: Optional[str] = None,
                 checkpoint: bool = True, module: str = "voloco") -> Proc:
        """``checkpoint``: give it a --checkpoint-dir (``NAME/ckpt``); ``module``: see ``voloco``."""
        d = self.workdir / name
        d.mkdir(exist_ok=True)
        (d / "status.json").unlink(missing_ok=True)
        argv = voloco(
            "peer", *self.join_flags(), "--host-maddrs", LOOPBACK, "--threads", "1",
            "--status-file", str(d / "status.json"), *(["--checkpoint-dir", str(d / "ckpt")] if checkpoint else []),
            "--identity", str(d / "identity.key"), *extra, module=module,
        )
        self.peers[name] = self._start(argv, self.workdir / (log or f"{name}.log"), env)
        return self.peers[name]

    def status(self, name: str) -> Optional[dict]:
        try:
            return json.loads((self.workdir / name / "status.json").read_text())
        except (OSError, ValueError):
            return None

    def wait(self, predicate, timeout: float, what: str) -> None:
        wait_for(predicate, timeout, what, lambda: {n: p.text() for n, p in self.peers.items()})

    def wait_shared(self, names, pairs: int, timeout: float, what: str) -> None:
        """Wait until ``names`` spent enough rounds in one group (see ``groupmate_pairs``)."""
        self.wait(lambda: groupmate_pairs([self.status(n) for n in names]) >= pairs, timeout, what)

    def round_of(self, name: str) -> int:
        """The round a peer is in once it has trained one (-1 before: a peer writes its status file
        from start-up on, and a late joiner's first status names the round it downloaded)."""
        s = self.status(name)
        return s["round"] if s and s.get("history") else -1

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop(grace=5.0)


def hashes_by_round(statuses: List[dict]) -> Dict[int, Dict[str, str]]:
    """round -> {peer id: parameter hash after that round}, from every peer's round history."""
    out: Dict[int, Dict[str, str]] = {}
    for s in statuses:
        for rec in s["history"]:
            out.setdefault(rec["round"], {})[s["peer_id"]] = rec["params_hash"]
    return out


def _brief(rec: dict) -> dict:
    """A round record without the bulky fields, for an assertion message."""
    return {k: (sorted(p[-6:] for p in v) if k == "group" else v) for k, v in rec.items() if k not in ("loss", "val_loss")}


def _groupmate_pairs(statuses: List[dict]):
    """(peer, groupmate, their round records) for every round two of ``statuses`` spent in one group, both counting.

    Both records must name each other: a record of the groupmate's that names another group is of
    another group of the round. That happens where a peer was killed in the middle of a round's
    gather and restarted at once (the fault tests record a peer's rounds across its restarts): its
    old process had its payload counted in the first group, and its new one trained the round again
    from its checkpoint and gathered it in a group of its own (one θ per group; the round's two
    groups meet at the next round's start-hash check). A record that does not name its own peer
    took another group's set (peer/round/adopt.py's ``adopt_round_set``): it must hold that
    group's θ, and is compared with every member of it. A groupmate whose update the round's checks
    refused is compared (``refused_by_checks``); one excluded otherwise is not."""
    by_peer = {s["peer_id"]: {r["round"]: r for r in s["history"]} for s in statuses if s}
    for pid, rounds in by_peer.items():
        for rnd, rec in rounds.items():
            for other in rec["group"]:
                if other == pid or other not in by_peer or rnd not in by_peer[other]:
                    continue
                if (other in rec["excluded"] and not refused_by_checks(rec, other)) or (
                        pid in rec["group"] and pid not in by_peer[other][rnd]["group"]):
                    continue
                yield pid, other, rec, by_peer[other][rnd], rounds, by_peer[other]


def refused_senders(rec: dict) -> set:
    """The senders of a round record whose updates the round's checks of the decoded updates
    (peer/outer/robust.py) refused: every member decides that alike from the same payloads, the sender
    too, so it ends on the group's θ (a silent, invalid or equivocating sender need not)."""
    excluded = rec.get("excluded")
    from peer.outer.robust import REFUSED  # here, not at the top: the harness itself needs no torch

    return {s for s, why in excluded.items() if str(why).startswith(REFUSED)} if isinstance(excluded, dict) else set()


def refused_by_checks(rec: dict, sender: str) -> bool:
    """Whether ``sender``'s update is one of ``refused_senders(rec)``."""
    return sender in refused_senders(rec)


def groupmate_pairs(statuses: List[dict]) -> int:
    """How many (round, peer, groupmate) triples ``assert_groups_identical`` would check: a test
    waits for enough of them (rounds alone while a peer starts up do not count)."""
    return sum(1 for _ in _groupmate_pairs(statuses))


def _apart(pid: str, other: str, rec: dict, theirs: dict) -> str:
    """Two groupmates' records of a round that hold different θ, for a message."""
    return (f"round {rec['round']}: {pid[-6:]} has {rec['params_hash']}, groupmate {other[-6:]} has "
            f"{theirs['params_hash']}\n  {pid[-6:]}: {_brief(rec)}\n  {other[-6:]}: {_brief(theirs)}")


def groupmate_splits(statuses: List[dict], repair_rounds: int = 3) -> Tuple[int, List[str], List[str]]:
    """Every pair of groupmates apart after a round: (pairs checked, splits repaired, splits not).

    A split is repaired when, within ``repair_rounds`` rounds after it, the two peers ended a round
    on one θ: protocol/round/reconcile.py promises one θ per group only while members meet each other's
    deadlines, and a member cut off mid-gather (a link down, a host starved of CPU) may decide
    alone; the next round's start-hash check then brings it back to its group's θ. A split that
    lasts longer is a fault of the protocol, not of the network."""
    checked, repaired, not_repaired = 0, [], []
    for pid, other, rec, theirs, rounds, their_rounds in _groupmate_pairs(statuses):
        checked += 1
        if rec["params_hash"] == theirs["params_hash"]:
            continue
        rnd = rec["round"]
        what = _apart(pid, other, rec, theirs)
        later = [k for k in range(rnd + 1, rnd + repair_rounds + 1) if k in rounds and k in their_rounds]
        if not later:  # neither recorded a round after it together: the run ended (or one died) first
            repaired.append(what + "\n  (not seen again: no later round of both was recorded)")
        elif any(rounds[k]["params_hash"] == their_rounds[k]["params_hash"] for k in later):
            repaired.append(what)
        else:
            not_repaired.append(what)
    return checked, repaired, not_repaired


def assert_groups_identical(statuses: List[dict]) -> int:
    """Every pair of peers that were in the same group of a round holds the same parameters after it.

    Returns the number of (round, peer, groupmate) triples checked. A status's last record is not
    final: the next round's group may still take a set into the round's union and rewrite it
    (peer/round/union.py) before the peer writes its next status, one groupmate's status before
    the other's. Two such records that differ are not judged (nor counted); equal ones are
    (tests/round/test_groupmate_pairs.py).
    """
    checked = 0
    for pid, other, rec, theirs_rec, rounds, their_rounds in _groupmate_pairs(statuses):
        mine, theirs = rec["params_hash"], theirs_rec["params_hash"]
        rnd = rec["round"]
        if mine != theirs and (rnd == max(rounds) or rnd == max(their_rounds)):
            continue
        assert mine == theirs, (
            _apart(pid, other, rec, theirs_rec)
            + f"\n  round before: {_brief(rounds.get(rnd - 1, {}))} / {_brief(their_rounds.get(rnd - 1, {}))}"
            + _said((pid, other), (rnd - 2, rnd - 1, rnd))
        )
        checked += 1
    return checked


def _said(peers: Sequence[str], rounds: Sequence[int], per_peer: int = 16) -> str:
    """What the logs of ``peers`` (each log names its peer id as it joins) say of ``rounds`` about groups,
    votes, state downloads and refusals (a peer logs the round it exchanges, one less than its record's
    round): a divergence that CI shows can then be traced (tests/round/test_groupmate_pairs.py)."""
    marks = tuple(f"round {r}" for r in rounds)
    out = []
    for log in dict.fromkeys(_LOGS):
        try:
            text = log.read_text(errors="replace")
        except OSError:
            continue
        for peer in peers:
            if f"peer {peer} joined" not in text:
                continue
            lines = [ln[:300] for ln in text.splitlines()
                     if any(m + ":" in ln or m + " " in ln for m in marks) and SAID.search(ln)]
            out.append(f"\n  --- {log.name} ({peer[-6:]}), {len(lines)} lines, the last {per_peer}:\n    "
                       + "\n    ".join(lines[-per_peer:]))
    return "".join(out)


def honest_swarm_with_liars(workdir: Path, honest: Tuple[str, ...], rounds: int, modes: List[str],
                            inner_steps: int) -> Tuple[List[dict], List[str], str]:
    """Honest peers ``honest`` train a round, then tests/support/hostile_exchange.py joins with one
    member per mode of ``modes`` for ``rounds`` rounds; once it has left and the honest peers have
    ended one more round: (their statuses, their logs, the hostile process's log). Raises if an
    honest peer exited."""
    swarm = Swarm(workdir, strategy="sparseloco", inner_steps=inner_steps)
    try:
        for name in honest:
            swarm.add_peer(name)
        swarm.wait(lambda: min(swarm.round_of(n) for n in honest) >= 1, 180, "a first round of the honest peers")
        liars = Proc([sys.executable, "-m", "tests.support.hostile_exchange", swarm.join, str(rounds), *modes],
                     workdir / "liars.log")
        swarm.procs.append(liars)
        try:
            liars.proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            pass
        r = min(swarm.round_of(n) for n in honest)
        swarm.wait(lambda: min(swarm.round_of(n) for n in honest) >= r + 1, 120, "a round after the hostile members left")
        statuses = [swarm.status(n) for n in honest]
        logs = [swarm.peers[n].text() for n in honest]
        assert all(swarm.peers[n].proc.poll() is None for n in honest), "an honest peer exited"
        return statuses, logs, liars.text()
    finally:
        swarm.close()
