"""Swarms of 8, 16 and 32 peers on one machine: do they stay one model, and does a peer grow?

For each swarm size, a coordinator and that many peer processes on loopback (bench/swarm_check.py's
``run_swarm``: one torch thread each, every peer started with ``--wait-peers`` = the quorum, by
default the whole swarm) train a tiny SparseLoCo run (d_model 32, 2 layers, H = 10 inner steps,
the run spec's swarm defaults, ``swarm.max_group_size`` 16) for ``--rounds`` rounds. Per round,
from the peers' status files (their ``history``):

- groups: the distinct member sets of the round's groups, and their sizes; alone: peers whose group
  was themselves only (they trained the round on their own);
- distinct θ: distinct ``params_hash`` across the swarm at the round's end (1: one model);
- payload: exchange bytes sent per peer as the peers count them; wire: every TCP byte a peer's
  process tree sent and received in the round (the status' ``wire``, read after each round: the
  payload plus the control plane, the DHT and matchmaking);
- payload recv/peer: the payload bytes a peer received in the round's exchange (the gather, and the
  sets or, with ``--max-contributions`` K, the lists and drawn payloads of the round's other
  groups); a table then sets each swarm's mean against the smallest one's;
- exchange CPU/peer: CPU seconds a peer spent on the round's exchange (its record's ``exchange_cpu``:
  the thread that ran it, encode to outer step; plus ``helpers_cpu``: its DHT, gather and p2p daemon
  processes since the previous round ended, swarm/cpu_meter.py), mean over the peers past their
  first record ("-" where the helpers' counters cannot be read); of it, the exchange's own: the
  thread's and what the helpers spent from the end of the round's inner steps (``helpers_exchange_cpu``),
  without their seconds while the peer trained, which follow the round's length (on this shared
  machine, the swarm's size) rather than its exchange; exchange s: the wall seconds from the end of the
  inner steps to the round's record (``exchange_s``), and the helpers' CPU seconds per such second;
- the peer process's CPU by thread (its status' ``cpu_by_thread``): its training (``main``), its
  exchange threads, its wire meter, its heartbeat, in seconds a peer a round, start-up included;
- barrier wait/peer: seconds a peer's round barrier waited for the round's other peers (its record's
  ``waited``: from its payload's encoding to the barrier's end), mean over the peers; then, in the
  growth table, the exchange's next two phases (past each peer's first record, as exchange s):
  gather s (``gather_s``: matchmaking and its group's all-gather) and merge s (``merge_s``: the
  repair of the last round's union, then waiting for, fetching and agreeing on the round's other
  groups' sets or lists; the draw, the drawn payloads' fetch and the outer step come after it);
- round s: the median peer's round time (its record's ``seconds``); swarm s: from the moment every
  peer had ended the previous round (round 1: had begun training) to the moment every peer had
  ended this one.

Then a small swarm (``--long-peers``) trains ``--long-rounds`` rounds (and one more, so that the
sampled peer is still running when its last sample is taken); one peer's process tree (the peer,
its DHT process, p2pd) is sampled from /proc after 1, 10 and 50 rounds: resident memory (VmRSS;
and Pss, which counts the pages forked processes share once), open file descriptors (/proc/PID/fd),
threads. Every swarm's peer 0 is sampled after its first
round too, so memory can be compared across swarm sizes.

The machine's cores are shared by every process: at 32 peers on 2 cores each peer has about 1/16
of a core, as slow volunteers would look to the protocol. So a larger swarm here also means a slower
peer, and a peer's waits (polls, heartbeats) last more wall seconds of its CPU. ``--cores-per-peer C``
holds each swarm's peer processes (with their DHT, averager and p2pd processes; the coordinator and
this bench outside) to ``peers x C`` cores (a CPU cgroup, bench/common.py ``CpuQuota``), so every size
gives a peer the same CPU, as machines of their own would: what then still grows is the swarm's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import CpuQuota, exit_on_sigterm, human, machine, now, table, tree_usage  # noqa: E402
from bench.swarm_check import run_swarm  # noqa: E402
from protocol.spec import RunSpec  # noqa: E402
from voloco.demo import read_status  # noqa: E402

TINY_MODEL = {"d_model": 32, "n_layers": 2, "n_heads": 2, "ffn_hidden": 64, "seq_len": 32}
MARKS = (1, 10, 50)  # rounds after which the long run's peer is sampled


def scale_spec(inner_steps: int = 10, max_group_size: int = 16, max_contributions: int = 0, d_model: int = 32) -> RunSpec:
    """The tiny run of the issue's measurement: d 32 (or ``d_model``, the MLP 2 d wide), 2 layers, H inner
    steps, default swarm timing; ``max_contributions``: the run's K (0: every contribution)."""
    return RunSpec(run_id="scale", seed=1).replace(
        model={**TINY_MODEL, "d_model": d_model, "ffn_hidden": 2 * d_model}, data={"batch_size": 4, "val_batches": 2}, inner={"warmup_steps": 5},
        outer={"strategy": "sparseloco", "inner_steps": inner_steps, "max_contributions": max_contributions},
        swarm={"max_group_size": max_group_size},
    )


class Watcher:
    """What ``run_swarm``'s watch sees while the peers run: each peer's wire bytes at each count of
    rounds it has ended, when every peer had begun training and had ended each round, and peer 0's
    process tree after the rounds in ``marks``."""

    def __init__(self, marks, start_timeout: float):
        self.marks, self.start_timeout, self.t0 = sorted(marks), start_timeout, time.monotonic()
        self.wire: Dict[int, Dict[int, int]] = {}  # peer -> {rounds ended: wire bytes sent + received}
        self.ended: Dict[int, float] = {}  # rounds ended by every peer (0: every peer training) -> seconds
        self.usage: List[Dict[str, Any]] = []

    def __call__(self, statuses: List[Optional[Dict[str, Any]]], pids: List[int]) -> None:
        t = time.monotonic() - self.t0
        for i, s in enumerate(statuses):
            if s and s.get("wire"):
                k, snaps = s.get("rounds", 0), self.wire.setdefault(i, {})
                if k == 0 or k not in snaps:  # before the first round: the latest (start-up excluded)
                    snaps[k] = s["wire"]["sent"] + s["wire"]["received"]
        if all(s and (s.get("rounds", 0) or s.get("state") not in ("starting", "waiting")) for s in statuses):
            for k in range(0, min(s.get("rounds", 0) for s in statuses) + 1):
                self.ended.setdefault(k, t)
        elif 0 not in self.ended and t > self.start_timeout:
            seen = sum(bool(s and s.get("state") not in ("starting", "waiting")) for s in statuses)
            raise TimeoutError(f"after {t:.0f} s only {seen} of {len(statuses)} peers had begun training")
        k0 = (statuses[0] or {}).get("rounds", 0)
        usage = tree_usage(pids[0]) if self.marks and self.marks[0] <= k0 else None  # after a marked round
        if usage and usage["processes"]:  # (none: peer 0 has just ended)
            self.usage.append({"after_rounds": self.marks.pop(0), "rounds_ended": k0, "t_s": round(t, 1), **usage})

    def wire_in_round(self, peer: int, k: int) -> Optional[int]:
        """Peer ``peer``'s wire bytes in the ``k``-th round it ended; None where a snapshot is missing."""
        snaps = self.wire.get(peer, {})
        return snaps[k] - snaps[k - 1] if k in snaps and k - 1 in snaps else None


def _sizes(sizes: List[int]) -> str:
    """Group sizes, largest first, repeats counted: 16+8+1x6."""
    out = []
    for n in sorted(set(sizes), reverse=True):
        c = sizes.count(n)
        out.append(f"{n}x{c}" if c > 2 else "+".join([str(n)] * c))
    return "+".join(out)


def _mean(xs: List[float]) -> Optional[float]:
    return sum(xs) / len(xs) if xs else None


def round_rows(statuses: List[Optional[Dict[str, Any]]], watcher: Watcher) -> List[Dict[str, Any]]:
    """One row per round any peer ended: groups, distinct θ, peers alone, bytes per peer, times."""
    by_round: Dict[int, list] = {}
    for i, s in enumerate(statuses):
        for n, r in enumerate((s or {}).get("history", []), start=1):
            by_round.setdefault(r["round"], []).append((i, n, r))
    rows = []
    for j, rnd in enumerate(sorted(by_round), start=1):
        recs = by_round[rnd]
        groups = {tuple(r["group"]) for _, _, r in recs}
        wire = [w for w in (watcher.wire_in_round(i, n) for i, n, _ in recs) if w is not None]
        swarm_s = watcher.ended[j] - watcher.ended[j - 1] if j in watcher.ended and j - 1 in watcher.ended else None
        rows.append({
            "round": rnd, "peers": len(recs), "groups": len(groups), "group_sizes": sorted(map(len, groups), reverse=True),
            "distinct_theta": len({r["params_hash"] for _, _, r in recs}),
            "alone": sum(len(r["group"]) == 1 for _, _, r in recs),
            "payload_sent_per_peer": _mean([r["bytes_sent"] for _, _, r in recs]),
            "payload_received_per_peer": _mean([r["bytes_received"] for _, _, r in recs]),
            "wire_per_peer": _mean(wire), "wire_peers": len(wire),
            # a peer's first record carries its start-up's helper seconds, not a round's
            "exchange_cpu_per_peer": _mean([r["exchange_cpu"] + r["helpers_cpu"] for _, n, r in recs
                                            if n > 1 and r.get("helpers_cpu") is not None]),
            "exchange_only_cpu_per_peer": _mean([r["exchange_cpu"] + r["helpers_exchange_cpu"] for _, n, r in recs
                                                 if n > 1 and r.get("helpers_exchange_cpu") is not None]),
            "exchange_s_per_peer": _mean([r["exchange_s"] for _, n, r in recs if n > 1 and r.get("exchange_s")]),
            "helpers_cpu_per_exchange_s": _mean([r["helpers_exchange_cpu"] / r["exchange_s"] for _, n, r in recs
                                                 if n > 1 and r.get("helpers_exchange_cpu") is not None and r.get("exchange_s")]),
            "waited_per_peer": _mean([r["waited"] for _, _, r in recs if r.get("waited") is not None]),
            "gather_s_per_peer": _mean([r["gather_s"] for _, n, r in recs if n > 1 and r.get("gather_s") is not None]),
            "merge_s_per_peer": _mean([r["merge_s"] for _, n, r in recs if n > 1 and r.get("merge_s") is not None]),
            "round_s": statistics.median(r["seconds"] for _, _, r in recs), "swarm_s": swarm_s,
        })
    return rows


def run_size(peers: int, rounds: int, marks: List[int], args, workdir: Path) -> Dict[str, Any]:
    """One swarm of ``peers`` peers for ``rounds`` rounds: its per-round rows and peer 0's samples."""
    spec = scale_spec(args.inner_steps, args.max_group_size, args.max_contributions, args.d_model)
    quorum = min(args.quorum or peers, peers)
    watcher = Watcher(marks, args.start_timeout)
    timeout = args.timeout or 300 + 15 * peers * rounds
    print(f"{now()}: {peers} peers (quorum {quorum}, groups of at most {args.max_group_size}), {rounds} rounds; "
          f"logs in {workdir}", flush=True)
    quota = CpuQuota(peers * args.cores_per_peer, f"voloco-scale-{os.getpid()}-{peers}") if args.cores_per_peer else None
    if quota:
        print(f"  the peers' processes hold {quota.cores:g} cores in all ({args.cores_per_peer:g} a peer; the coordinator "
              f"and this bench outside)", flush=True)
    t0, failure = time.monotonic(), None
    try:
        run_swarm(spec, peers, rounds, workdir, timeout=timeout, quorum=quorum, watch=watcher,
                  starting=quota.entered if quota else contextlib.nullcontext)
    except (TimeoutError, RuntimeError) as e:  # what the peers did until then is still reported
        failure = str(e)
        print(f"  stopped: {failure}", flush=True)
    finally:
        if quota:
            quota.close()
    statuses = [read_status(workdir, i) for i in range(peers)]
    return {"peers": peers, "quorum": quorum, "max_group_size": args.max_group_size, "rounds": rounds,
            "max_contributions": args.max_contributions, "cores": quota.cores if quota else None,
            "wall_s": round(time.monotonic() - t0, 1), "failure": failure, "workdir": str(workdir),
            "rows": round_rows(statuses, watcher), "usage": watcher.usage, "threads": thread_seconds(statuses)}


def thread_seconds(statuses: List[Optional[Dict[str, Any]]]) -> Dict[str, float]:
    """The peer process's CPU seconds by thread (its status' ``cpu_by_thread``, swarm/cpu_meter.py), per
    peer per round trained: mean over the peers that report it."""
    reporting = [s for s in statuses if s and s.get("cpu_by_thread") and s.get("rounds")]
    per: Dict[str, float] = {}
    for s in reporting:
        for name, seconds in s["cpu_by_thread"].items():
            per[name] = per.get(name, 0.0) + seconds / s["rounds"]
    return {name: round(total / len(reporting), 4) for name, total in sorted(per.items(), key=lambda kv: -kv[1])}


def _b(n: Optional[float]) -> str:
    return "-" if n is None else human(n)


def _s(n: Optional[float], places: int = 1) -> str:
    return "-" if n is None else f"{n:.{places}f}"


def _c(n: Optional[float]) -> str:
    return "-" if n is None else f"{n:.2f} s"


def _ratio(value: Optional[float], base: Optional[float]) -> str:
    return f"{value / base:.2f}x" if value and base else "-"


def report(runs: List[Dict[str, Any]]) -> str:
    rounds = table(
        ["peers", "round", "peers in it", "groups", "group sizes", "distinct θ", "alone", "payload sent/peer",
         "payload recv/peer", "wire/peer", "exchange CPU/peer", "barrier wait/peer", "round s", "swarm s"],
        [[str(run["peers"]), str(r["round"]), str(r["peers"]), str(r["groups"]), _sizes(r["group_sizes"]),
          str(r["distinct_theta"]), str(r["alone"]), _b(r["payload_sent_per_peer"]), _b(r["payload_received_per_peer"]),
          _b(r["wire_per_peer"]), _c(r.get("exchange_cpu_per_peer")), _c(r.get("waited_per_peer")), _s(r["round_s"]), _s(r["swarm_s"])]
         for run in runs for r in run["rows"]], left=5)
    grown = growth(runs)
    usage = table(
        ["peers", "after rounds", "processes", "RSS peer", "RSS tree", "PSS tree", "fds tree", "threads tree"],
        [[str(run["peers"]), str(u["after_rounds"]), str(len(u["processes"])), human(1024 * u["processes"][0]["rss_kib"]),
          human(1024 * u["rss_kib"]), human(1024 * u["pss_kib"]), str(u["fds"]), str(u["threads"])]
         for run in runs for u in run["usage"]], left=0)
    names = list(dict.fromkeys(n for run in runs for n in list(run.get("threads", {}))[:6]))
    threads = table(["peers"] + [f"{n} s/round" for n in names],
                    [[str(run["peers"])] + [_s(run.get("threads", {}).get(n), 3) for n in names] for run in runs], left=0)
    failures = [f"{run['peers']} peers: {run['failure']}" for run in runs if run["failure"]]
    return "\n\n".join([rounds, grown, usage, "the peer process's CPU by thread, a peer a round (start-up included):\n" + threads]
                       + failures)


def growth(runs: List[Dict[str, Any]]) -> str:
    """Per swarm: the payload bytes a peer received in a round and the CPU seconds of its exchange
    (means over the rounds after the first, which a late start can skew), against the smallest
    swarm's: flat where K bounds what a peer fetches and decodes."""
    rows, base = [], None
    for run in sorted((r for r in runs if not r.get("long")), key=lambda r: r["peers"]):
        later = run["rows"][1:]
        mean = _mean([r["payload_received_per_peer"] for r in later if r["payload_received_per_peer"] is not None])
        cpu = _mean([r["exchange_cpu_per_peer"] for r in later if r.get("exchange_cpu_per_peer") is not None])
        own = _mean([r["exchange_only_cpu_per_peer"] for r in later if r.get("exchange_only_cpu_per_peer") is not None])
        span = _mean([r["exchange_s_per_peer"] for r in later if r.get("exchange_s_per_peer") is not None])
        rate = _mean([r["helpers_cpu_per_exchange_s"] for r in later if r.get("helpers_cpu_per_exchange_s") is not None])
        waited = _mean([r["waited_per_peer"] for r in later if r.get("waited_per_peer") is not None])
        gather, merge = (_mean([r[k] for r in later if r.get(k) is not None]) for k in ("gather_s_per_peer", "merge_s_per_peer"))
        base = base if base is not None else (mean, cpu, own)
        cores = "machine" if run.get("cores") is None else f"{run['cores']:g}"
        rows.append([str(run["peers"]), cores, str(run.get("max_contributions", 0)), str(run["max_group_size"]), _b(mean),
                     _ratio(mean, base[0]), _c(cpu), _ratio(cpu, base[1]), _c(own), _ratio(own, base[2]), _c(waited),
                     _c(gather), _c(merge), _s(span), "-" if rate is None else f"{rate:.4f}"])
    return table(["peers", "cores", "K", "groups <=", "payload recv/peer/round", "vs smallest", "exchange CPU/peer/round",
                  "vs smallest", "of it after the steps", "vs smallest", "barrier wait/peer/round", "gather s", "merge s",
                  "exchange s/round", "helpers CPU s/exchange s"], rows, left=0)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="Each swarm's logs and status files "
                                 "stay in its folder under --workdir (peerN.log: what each peer saw).")
    ap.add_argument("--peers", default=None, help="comma-separated swarm sizes, one swarm each (default 8,16,32; --quick: 4)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds each swarm trains (default 3; --quick: 2)")
    ap.add_argument("--long-peers", type=int, default=4,
                    help="peers of the long run whose peer 0 is sampled after 1, 10 and 50 rounds (default 4); "
                    "a size in --peers equal to it is not run again: the long run's rounds are its rows")
    ap.add_argument("--long-rounds", type=int, default=None,
                    help="rounds of the long run (default 50; --quick: 5; 0: no long run); it trains one more, so the "
                    "peer sampled after its last round is still running")
    ap.add_argument("--quorum", type=int, default=None,
                    help="every peer's --wait-peers: how many peers must have started before round 1 (default: the whole swarm)")
    ap.add_argument("--max-group-size", type=int, default=16, help="the run spec's swarm.max_group_size (default 16)")
    ap.add_argument("--inner-steps", type=int, default=10, help="H, inner steps a round (default 10)")
    ap.add_argument("--d-model", type=int, default=32,
                    help="the model's width (default 32: 37k parameters, a 2.4 KiB payload; 128: 394k, a 9 KiB payload, so "
                    "the payloads outweigh the sets' lists as they do at real sizes)")
    ap.add_argument("--max-contributions", type=int, default=0,
                    help="the run spec's outer.max_contributions K: at most K contributions a part enter θ, and a peer "
                    "fetches only those of the other groups (default 0: every contribution, every set fetched whole)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds a swarm may take in all before it is stopped (default 300 + 15 x peers x rounds)")
    ap.add_argument("--start-timeout", type=float, default=600.0,
                    help="seconds a swarm may take until every peer has begun training (passed the quorum) "
                    "before it is stopped and reported as not started (default 600)")
    ap.add_argument("--cores-per-peer", type=float, default=None, metavar="C",
                    help="hold each swarm's peer processes to C cores a peer in all (a CPU cgroup of peers x C cores; the "
                    "coordinator outside it; Linux, root): every "
                    "size then gives a peer the same CPU, as machines of their own would; 2 cores / 32 peers is 0.0625 "
                    "(default: no quota, every swarm shares the whole machine)")
    ap.add_argument("--workdir", type=Path, default=None, help="where each swarm's folder goes (default: a temporary folder)")
    ap.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write every swarm's rows and samples as JSON to OUT")
    ap.add_argument("--quick", action="store_true", help="a smoke run: --peers 4 --rounds 2 --long-rounds 5 unless given")
    args = ap.parse_args(argv)
    exit_on_sigterm()
    quick = dict(peers="4", rounds=2, long_rounds=5) if args.quick else dict(peers="8,16,32", rounds=3, long_rounds=50)
    for k, v in quick.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    try:
        sizes = [int(p) for p in args.peers.split(",") if p.strip()]
    except ValueError:
        ap.error(f"--peers: not a comma-separated list of numbers: {args.peers}")
    if args.cores_per_peer is not None and args.cores_per_peer <= 0:
        ap.error("--cores-per-peer must be a positive number of cores")
    if not sizes or min(sizes) < 1 or args.rounds < 1 or args.long_rounds < 0 or args.long_peers < 1:
        ap.error("--peers, --rounds and --long-peers must be at least 1, --long-rounds at least 0")
    root = args.workdir or Path(tempfile.mkdtemp(prefix="voloco-scale-"))
    print(f"{now()} | {machine()}\nswarms of {args.peers} peers x {args.rounds} rounds, then {args.long_peers} peers x "
          f"{args.long_rounds} rounds; tiny SparseLoCo run (d {args.d_model}, 2 layers, H {args.inner_steps}); logs in {root}", flush=True)
    plan = [(n, args.rounds, [1], False) for n in sizes if not (args.long_rounds and n == args.long_peers)]
    if args.long_rounds:
        marks = sorted({m for m in MARKS if m <= args.long_rounds} | {args.long_rounds})
        plan.append((args.long_peers, max(args.rounds, args.long_rounds + 1), marks, True))
    runs, seen = [], Counter()
    for n, rounds, marks, long in plan:  # a size given twice (--peers 8,32,8,32: A/B pairs) gets a folder of its own
        seen[n, rounds] += 1
        folder = f"peers{n}-rounds{rounds}" + (f"-{seen[n, rounds]}" if seen[n, rounds] > 1 else "")
        runs.append(dict(run_size(n, rounds, marks, args, root / folder), long=long))
        print(report(runs[-1:]), flush=True)
    print(f"\n{machine()}, {now()}\n{report(runs)}")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "date": now(), "spec": scale_spec(
            args.inner_steps, args.max_group_size, args.max_contributions, args.d_model).model_dump(), "runs": runs}, indent=1))
    return 0 if not any(run["failure"] for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
