"""``voloco demo``: a coordinator and N peers as separate processes on loopback, then a summary.

Every child runs in its own process group, so stopping the demo (or Ctrl+C) takes down each
child's DHT process and p2pd daemon with it: nothing is left running. The children are
``python -m voloco coordinator`` and ``python -m voloco peer``: what a person would run, with
the demo's flags only (no ``VOLOCO_*`` variable reaches them, so no settings file either).

While the peers start, the demo prints each one's phase (from its status file: joining the DHT,
loading data, waiting for a chain, ...), then one line of rounds and validation loss every few
seconds; it prints the coordinator's dashboard address when the coordinator announces one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from protocol.model.capacity import replica_bytes, stage_bytes
from swarm.console import UsageError, human_bytes
from swarm.jsonout import write as write_json
from swarm.helper_processes import signal_tree
from swarm.settings import ENV_PREFIX

LOOPBACK = "/ip4/127.0.0.1/tcp/0"

HELP = "a coordinator and N peers as processes on this machine, then a summary"


def add_arguments(d: argparse.ArgumentParser) -> None:
    d.add_argument("--peers", type=int, default=3, help="number of peers (default: 3)")
    d.add_argument("--minutes", type=float, default=3.5,
                   help="training time before the peers are stopped, once the next round has ended on all of "
                        "them (at most a minute more; default: 3.5)")
    d.add_argument(
        "--chain-peers", type=int, default=2,
        help="extra low-memory peers (too small for a full replica) that the coordinator groups into a pipeline chain (default: 2; 0: none)",
    )
    d.add_argument("--strategy", choices=["diloco", "sparseloco", "dct"], help="outer strategy (default: the spec's, sparseloco)")
    d.add_argument("--config", type=Path, help="run spec as TOML (default: the built-in demo spec)")
    d.add_argument("--json", type=Path, help="also write the summary as JSON to this file (default: none)")
    d.add_argument("--workdir", type=Path, help="where logs, checkpoints and status files go (default: a temporary directory)")


def child_env() -> Dict[str, str]:
    """The demo's environment without ``VOLOCO_*``: its children run with the demo's flags only."""
    return {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}


class Child:
    def __init__(self, name: str, argv: List[str], log: Path):
        self.name, self.log = name, log
        self.log_file = open(log, "wb")
        self.proc = subprocess.Popen(
            argv, stdout=self.log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env=child_env(),
        )

    def signal_group(self, sig: int) -> None:
        if sig == signal.SIGKILL:
            signal_tree(self.proc, sig)  # its helpers have process groups of their own
            return
        try:
            os.killpg(self.proc.pid, sig)  # as Ctrl+C would: the peer stops its helpers
        except ProcessLookupError:
            pass

    def stop(self, grace: float) -> None:
        """SIGINT, then SIGKILL to the whole process group after ``grace`` seconds."""
        if self.proc.poll() is None:
            self.signal_group(signal.SIGINT)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        self.signal_group(signal.SIGKILL)  # its DHT process and p2pd too
        self.proc.wait()
        self.log_file.close()


def stop_all(children: List[Child], grace: float = 15.0) -> None:
    """Stop a run's processes, ``children[0]`` its coordinator: every peer at once, as Ctrl+C would (none
    trains on alone), then each in turn, the coordinator last."""
    for child in reversed(children[1:]):
        child.signal_group(signal.SIGINT)
    for child in reversed(children):
        child.stop(grace=grace)


def exited_with_error(children: List[Child]) -> List[str]:
    """The peers (``children[1:]``) that exited otherwise than cleanly or by a stop signal."""
    return [c.name for c in children[1:] if c.proc.returncode not in (0, 130, -signal.SIGINT)]


def peer_argv(
    join: str, workdir: Path, index: int, threads: Optional[int] = 1, memory_gb: Optional[float] = None, run_key: Optional[str] = None,
    compile: Optional[bool] = False,
) -> List[str]:
    """A peer's command line. ``threads``: its ``--threads``, None to leave it out (the peer takes its
    share of the host: peer/host/cpu_share.py). ``compile``: False (``--no-compile``: the demo's model is
    tiny, compiling would take longer than its whole run), True (``--compile``), None (the peer's default)."""
    d = workdir / f"peer{index}"
    d.mkdir(parents=True, exist_ok=True)
    extra = ["--max-memory-gb", f"{memory_gb:.6f}"] if memory_gb is not None else []
    extra += ["--run-key", run_key] if run_key else []
    extra += [] if compile is None else ["--compile" if compile else "--no-compile"]
    return [
        sys.executable, "-m", "voloco", "peer", "--join", join,
        "--host-maddrs", LOOPBACK,
        "--status-file", str(d / "status.json"),
        "--checkpoint-dir", str(d / "checkpoint"),
        "--identity", str(d / "identity.key"),
    ] + (["--threads", str(threads)] if threads is not None else []) + extra


def chain_peer_bytes(spec, peers: int) -> float:
    """The memory a demo chain peer declares: 60 % of a full replica's need, or more where the
    largest stage of an even split needs more (with recomputed activations a stage holds one
    block's activations, as a full replica does), always below a full replica's."""
    full = replica_bytes(spec)
    if peers < 2:
        return 0.6 * full
    layers = spec.model.n_layers
    per = -(-layers // min(peers, layers))
    need = max(stage_bytes(spec, start, min(start + per, layers)) for start in range(0, layers, per))
    return max(0.6 * full, min(1.05 * need, 0.98 * full))


def coordinator_argv(workdir: Path, config: Optional[Path], strategy: Optional[str]) -> List[str]:
    argv = [sys.executable, "-m", "voloco", "coordinator", "--host-maddrs", LOOPBACK,
            "--address-file", str(workdir / "coordinator.addr")]
    if config is not None:
        argv += ["--config", str(config)]
    if strategy:
        argv += ["--strategy", strategy]
    return argv


def start_coordinator(workdir: Path, config: Optional[Path], strategy: Optional[str]) -> Child:
    """The coordinator of a run in ``workdir``; the address and run-key files of an earlier run
    there are removed first, so that ``wait_for_address`` reads this coordinator's."""
    from coordinator.server import run_key_file

    address = workdir / "coordinator.addr"
    for stale in (address, run_key_file(address)):
        stale.unlink(missing_ok=True)
    return Child("coordinator", coordinator_argv(workdir, config, strategy), workdir / "coordinator.log")


def coordinator_up(workdir: Path, config: Optional[Path], children: List[Child],
                   strategy: Optional[str] = None) -> Tuple[str, Optional[str]]:
    """Start the run's coordinator (appended to ``children``, so the caller stops it) and wait for it:
    the address peers join and the run key they check the spec with."""
    coord = start_coordinator(workdir, config, strategy)
    children.append(coord)
    join = wait_for_address(workdir / "coordinator.addr", coord)
    return join, read_run_key(workdir / "coordinator.addr")


def wait_for_address(path: Path, child: Child, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            raise UsageError(f"the coordinator exited with code {child.proc.returncode}; see {child.log}")
        if path.is_file() and path.read_text().strip():
            return path.read_text().split()[0]
        time.sleep(0.2)
    raise UsageError(f"the coordinator did not start within {timeout:.0f} s; see {child.log}")


def read_run_key(address_file: Path) -> Optional[str]:
    """The run key's fingerprint the coordinator wrote beside its address file (before it)."""
    from coordinator.server import run_key_file

    try:
        return run_key_file(address_file).read_text().strip() or None
    except OSError:
        return None


def read_status(workdir: Path, index: int) -> Optional[Dict[str, Any]]:
    path = workdir / f"peer{index}" / "status.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_statuses(workdir: Path, peers: int) -> List[Optional[Dict[str, Any]]]:
    """``read_status`` of peers 0 .. ``peers`` - 1."""
    return [read_status(workdir, i) for i in range(peers)]


def summarize(statuses: List[Optional[Dict[str, Any]]], wall_s: float) -> Dict[str, Any]:
    live = [s for s in statuses if s]
    initial = [s["initial_val_loss"] for s in live if _finite(s.get("initial_val_loss"))]
    final = [s["val_loss"] for s in live if _finite(s.get("val_loss"))]
    return {
        "peers": [
            {k: s.get(k) for k in ("peer_id", "round", "rounds", "tokens", "val_loss", "util", "bytes_sent", "bytes_received",
                                   "params_hash", "part", "chain", "last_chain", "link_bytes_sent", "link_bytes_received")}
            for s in live
        ],
        "chains": _chains(live),
        "strategy": live[0]["strategy"] if live else None,
        "initial_val_loss": max(initial) if initial else None,
        "final_val_loss": sum(final) / len(final) if final else None,
        "tokens": sum(s["tokens"] for s in live),
        "rounds": max((s["round"] for s in live), default=0),
        "bytes_sent_per_peer": [s["bytes_sent"] for s in live],
        "bytes_received_per_peer": [s["bytes_received"] for s in live],
        "wall_s": round(wall_s, 1),
    }


def _chains(live: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Each chain the demo's low-memory peers formed: its stages and the bytes between them."""
    chains: Dict[str, Dict[str, Any]] = {}
    for s in live:
        chain = s.get("chain") or s.get("last_chain")  # a stage whose neighbour stopped first has no chain now
        if chain:
            c = chains.setdefault(chain, {"chain": chain, "stages": []})
            c["stages"].append({
                "peer_id": s["peer_id"], "blocks": s["part"], "rounds": s["rounds"],
                "link_bytes_sent": s.get("link_bytes_sent", 0), "link_tokens": s.get("link_tokens", 0),
            })
    for c in chains.values():
        c["stages"].sort(key=lambda st: st["blocks"])
        first, last = c["stages"][0], c["stages"][-1]
        # forward: what the first stage sent (activations); backward: what the last sent (gradients)
        c["forward_bytes_per_token"] = round(first["link_bytes_sent"] / first["link_tokens"], 1) if first["link_tokens"] else None
        c["backward_bytes_per_token"] = round(last["link_bytes_sent"] / last["link_tokens"], 1) if last["link_tokens"] else None
    return list(chains.values())


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def print_summary(summary: Dict[str, Any]) -> None:
    print()
    print(f"{'peer':<14}{'role':<12}{'round':>6}{'tokens':>11}{'val loss':>10}{'util':>6}{'sent':>11}{'received':>11}  params")
    for p in summary["peers"]:
        val = f"{p['val_loss']:.3f}" if _finite(p["val_loss"]) else "-"
        part = p.get("part")
        role = (f"blocks {part[0]}-{part[1] - 1}" if isinstance(part, list) else
                f"slice {part}" if isinstance(part, int) and part >= 0 else "full")
        util = f"{p['util']:.0%}" if _finite(p.get("util")) else "-"
        print(f"{p['peer_id'][-12:]:<14}{role:<12}{p['round']:>6}{p['tokens']:>11,}{val:>10}{util:>6}"
              f"{human_bytes(p['bytes_sent']):>11}{human_bytes(p['bytes_received']):>11}  {p['params_hash']}")
    init, fin = summary["initial_val_loss"], summary["final_val_loss"]
    print()
    print(f"strategy         {summary['strategy']}")
    print(f"validation loss  {init if init is None else f'{init:.3f}'} -> {fin if fin is None else f'{fin:.3f}'} nats/byte"
          + (f"  ({init - fin:.2f} lower)" if init is not None and fin is not None else ""))
    print(f"tokens trained   {summary['tokens']:,}")
    print(f"rounds           {summary['rounds']}")
    for c in summary["chains"]:
        stages = ", ".join(f"{st['peer_id'][-6:]} blocks {st['blocks'][0]}-{st['blocks'][1] - 1}" for st in c["stages"])
        print(f"chain            {c['chain']}: {stages}; bytes per token between stages: "
              f"{c['forward_bytes_per_token']} forward, {c['backward_bytes_per_token']} backward")
    print(f"wall time        {summary['wall_s']:.0f} s")


SETTLE_S = 60.0  # the longest the demo waits past its time for the next round to end on every peer
STARTED = ("training", "stopping", "stopped")  # phases past start-up (peer/host/lifecycle.py)
_URL = re.compile(r"^dashboard: (https?://\S+)", re.M)


def peer_phase(status: Optional[Dict[str, Any]], exit_code: Optional[int]) -> str:
    """What a peer is doing, from its status file: its start-up phase, or ``round N`` once it trains."""
    if exit_code is not None:
        return f"exited ({exit_code})"
    if status is None:
        return "starting"
    phase = status.get("phase") or ("training" if status.get("rounds") else "starting")
    return f"round {status.get('round', 0)}" if phase in STARTED else phase


def progress_line(elapsed: float, names: Sequence[str], statuses: Sequence[Optional[Dict[str, Any]]],
                  exit_codes: Sequence[Optional[int]]) -> str:
    """One line of the demo's progress: each peer's phase while any is starting, then rounds and loss."""
    phases = [peer_phase(s, c) for s, c in zip(statuses, exit_codes)]
    vals = [s["val_loss"] for s in statuses if s and _finite(s.get("val_loss")) and s.get("rounds")]
    loss = f" | val loss {min(vals):.3f}" if vals else ""
    head = f"[{elapsed:5.0f} s] "
    if all(p.startswith("round ") for p in phases):
        return head + "rounds " + " ".join(p.split()[1] for p in phases) + loss
    return head + " | ".join(f"{n}: {p}" for n, p in zip(names, phases)) + loss


def dashboard_address(log: Path) -> Optional[str]:
    """The dashboard's address once the coordinator has logged it (``dashboard: URL``), else None."""
    try:
        found = _URL.search(log.read_text(errors="replace"))
    except OSError:
        return None
    if found is None:
        return None
    return re.sub(r"//(0\.0\.0\.0|localhost|\[::\])(?=[:/])", "//127.0.0.1", found.group(1))


def watch_progress(workdir: Path, coord: "Child", peers: List["Child"], names: Sequence[str], t0: float,
                   deadline: float, live_every: float = 5.0) -> None:
    """Print the peers' phases as they change while they start, then a live line every few seconds."""
    last_line, last_print, dashboard = "", 0.0, None
    while time.monotonic() < deadline:
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        now = time.monotonic()
        if dashboard is None and (dashboard := dashboard_address(coord.log)) is not None:
            print(f"dashboard: {dashboard}", flush=True)
        statuses = read_statuses(workdir, len(peers))
        line = progress_line(now - t0, names, statuses, [c.proc.poll() for c in peers])
        changed = line.split("] ", 1)[1] != last_line.split("] ", 1)[-1]
        starting = not line.split("] ", 1)[1].startswith("rounds ")
        if (starting and changed) or now - last_print >= (15.0 if starting else live_every):
            print(line, flush=True)
            last_line, last_print = line, now
        if coord.proc.poll() is not None:
            print(f"the coordinator exited with code {coord.proc.returncode}; see {coord.log}", flush=True)
            return


def settled(statuses: Sequence[Optional[Dict[str, Any]]]) -> bool:
    """Whether every peer that wrote a status has concluded the same round to the same θ: a moment
    between two rounds, when stopping them all leaves them on one θ (a peer stopped inside a round's
    exchange keeps the θ of the round before; tests/system/test_demo.py)."""
    return settled_on(statuses) is not None


def settled_on(statuses: Sequence[Optional[Dict[str, Any]]]) -> Optional[Tuple[Any, Any]]:
    """(round, θ) that every peer that wrote a status has concluded, else None."""
    live = {(s.get("round"), s.get("params_hash")) for s in statuses if s}
    return next(iter(live)) if len(live) == 1 else None


def wait_until_settled(read: Callable[[], Sequence[Optional[Dict[str, Any]]]], limit_s: float,
                       clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> bool:
    """Past the demo's time: wait (at most ``limit_s``) until the next round has ended on every peer
    with one θ, and stop them right after it, while they are all in the next round's inner steps. A
    moment that already showed one θ when the time ran out may have the next round's exchange in
    flight (its inner steps overlap the exchange before): stopped then, three peers ended on round
    14's θ and two on round 13's (bench/RESULTS.md, 2026-12-06). Where no round ends in time, any
    moment that shows one θ will do. ``read``: every peer's status
    (tests/system/test_demo.py::test_the_demo_stops_its_peers_right_after_a_round_has_ended_on_all)."""
    end = clock() + limit_s
    first = settled_on(read())
    while clock() < end:
        now = settled_on(read())
        if now is not None and now != first:
            return True
        sleep(0.2)
    return settled_on(read()) is not None


def run_demo(args: argparse.Namespace) -> int:
    from coordinator.server import load_spec  # hivemind and torch: not for `voloco --help`

    if args.peers < 1:
        raise UsageError("--peers must be at least 1")
    if not args.minutes > 0:
        raise UsageError("--minutes must be positive")
    spec = load_spec(args.config, None, args.strategy)  # fail early, before any process starts
    if args.chain_peers < 0 or args.chain_peers == 1:
        raise UsageError("--chain-peers must be 0 or at least 2 (a chain has two or more stages)")
    # what a chain peer declares: too little for a full replica, enough for its share of a chain
    small = chain_peer_bytes(spec, args.chain_peers) / 1e9
    if args.workdir is not None and args.workdir.exists() and not args.workdir.is_dir():
        raise UsageError(f"--workdir {str(args.workdir)!r} is a file, not a directory")
    if args.json is not None and not args.json.parent.is_dir():  # written at the end: say so before the run
        raise UsageError(f"--json {str(args.json)!r}: directory {str(args.json.parent)!r} does not exist")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="voloco-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    chain_note = f" + {args.chain_peers} low-memory peers for a pipeline chain" if args.chain_peers else ""
    print(f"voloco demo: a coordinator and {args.peers} peers{chain_note}, {spec.outer.strategy}, "
          f"{spec.model.num_params() / 1e6:.2f}M parameters, {args.minutes:g} min; logs in {workdir}", flush=True)
    t0 = time.monotonic()
    children: List[Child] = []
    interrupted = False
    try:
        join, run_key = coordinator_up(workdir, args.config, children, args.strategy)
        for i in range(args.peers + args.chain_peers):
            memory = small if i >= args.peers else None
            argv = peer_argv(join, workdir, i, memory_gb=memory, run_key=run_key)
            children.append(Child(f"peer{i}", argv, workdir / f"peer{i}.log"))
        deadline = t0 + args.minutes * 60
        names = [f"peer{i}" + (" (chain)" if i >= args.peers else "") for i in range(args.peers + args.chain_peers)]
        watch_progress(workdir, children[0], children[1:], names, t0, deadline)
        print(f"time is up: stopping the peers once the next round has ended on all of them "
              f"(at most {SETTLE_S:.0f} s)", flush=True)
        wait_until_settled(partial(read_statuses, workdir, args.peers + args.chain_peers), SETTLE_S)
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: stopping every process", flush=True)
    finally:
        stop_all(children)
    summary = summarize(read_statuses(workdir, args.peers + args.chain_peers), time.monotonic() - t0)
    print_summary(summary)
    if args.json:
        write_json(args.json, summary, indent=2)  # strict JSON: an unknown loss is null, never NaN
    return 130 if interrupted else 0
