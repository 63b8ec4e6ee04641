"""Slow home links: voloco against hivemind.Optimizer, four peers on separate hosts, one 2x slower.

    python bench/wan.py [--quick] [--json OUT] [--rates 10mbit,100mbit] [--arms ...] [--rounds N]
                        [--target LOSS] [--cpus 0.4] [--slowdown 2] [--workdir DIR] [--merge EARLIER.json]

Needs root (network namespaces and cgroups). Hosts (tests/support/netns_hosts.py): ``coord`` (the voloco
coordinator, or hivemind's bootstrap node) and peers ``p0``..``p3``, every link capped with tbf
both ways at the arm's rate. Each peer's processes run under the same CPU quota (``--cpus``,
tests/support/cpu_limit.py's ``CpuLimit``, a cgroup) once started up, so that the peers compute alike
and leave room for the coordinator and the p2p daemons. p3 is ``--slowdown`` times slower: after
each inner step it waits that many times the step's duration, less one (bench/wan_host.py), as a
slower device would keep it busy. Neither torch threads (a peer already runs on one; four peers
share two cores) nor a smaller quota can do it on a shared machine: a quota is only a ceiling,
and under others' load 0.4 against 0.2 CPU measured 1.33x. A speed probe measures the four at
once first and prints the ratio.

Arms, at every rate, with the same model (the run spec's), data, seeds and token budget:
- ``hivemind.Optimizer``: bench/wan_hivemind.py, configured as in ``hivemind_settings`` below;
- ``DiLoCo`` and ``DiLoCo+overlap``: ``outer.strategy = "diloco"``, fp16 on the wire (the same
  precision as the hivemind arm's averaging), ``outer.overlap`` false / true;
- ``SparseLoCo`` and ``SparseLoCo+overlap``: the default SparseLoCo codec, overlap false / true.

Every arm runs until its workers report the budget's tokens: ``--rounds`` rounds of every peer's
H inner steps (4 x H x batch x seq_len tokens a round). The target validation loss is the final
loss of the slowest-converging voloco arm at that rate (or ``--target``); each arm's time to it
is read off its curve. Columns: wall time to the target, final validation loss, bytes each peer's
interface sent while the arm trained (mean of the four, Ethernet frames) and the bytes the peers
say they sent (their status: true wire bytes where the status has a key for them, else payload
bytes; hivemind counts none), compute utilization (time in inner steps / wall time from the
worker's first step to the arm's end) of the fast peers (mean) and of the slow one. Ratios are
against hivemind.Optimizer at the same rate: how many times sooner at the target, how many times
fewer interface bytes.

Accounted bytes: a voloco peer's ``wire`` counts, summed over its sockets (swarm/wire/sock_diag.py): sent
as the other end acknowledged them, not tcp_info's ``bytes_sent``, which also counts every attempt
the host's own full ``tbf`` queue dropped (TCP sends those bytes again as new data): 112.5 MiB
against 68.4 MiB on the interface for DiLoCo at 10 Mbit/s (tests/system/test_wire_bytes_hosts.py checks
the acknowledged count against the interface). Both ways are printed; received bytes stay under the
interface's count (headers on top).

hivemind.Optimizer's learning rate: the voloco peer's AdamW lr (tuned for its batch of 16) scaled
by sqrt(target_batch_size / 16), the square-root rule of the LAMB paper that hivemind's guide links
("tune learning rate for your target_batch_size"), unscaled otherwise (``HIVEMIND_LR_SCALE``).
Checked in one process (plain AdamW on the same model, data and schedule, the full run's 10 Mbit/s
setting: 576 samples a step, 14 steps, lr 0.012): validation loss 5.19, 3.69, 3.35, 3.20, then down
every step to 3.14, no divergence (twice that lr ends at 2.99 at 640 samples a step in one process,
but diverged on the hosts in one of two runs; hivemind's 256 samples a step at 100 Mbit/s, lr 0.008:
2.76, 1.5x that 3.10). A 10 Mbit/s hivemind arm with twice the rule's lr and fp16 state downloads
ended at a validation loss of 607, from the fp16 downloads (bench/wan_hivemind.py says why): state
downloads stay uncompressed. The voloco inner lr unscaled
(0.002) would leave 14 Adam steps of that size for the whole budget, a baseline that barely moves.

``--quick``: a 0.1M-parameter model, H = 10, 3 rounds, 10 Mbit/s only (a few minutes; the test).
``--merge EARLIER.json``: run only ``--arms`` again; the other arms of each rate come from an
earlier run's JSON (same model and budget), and everything is scored together.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

if __name__ == "__main__":  # run as a script, bench/tokenizers.py would hide the tokenizers package
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import exit_on_sigterm, choose_names, human, machine, now, table  # noqa: E402
from bench.wan_swarm import PEERS, SLOW, Arm, ArmRunner, calibrate, time_to  # noqa: E402
from protocol.spec import RunSpec  # noqa: E402
from swarm.jsonout import loads_strict, write as write_json  # noqa: E402

ARMS = ("hivemind.Optimizer", "DiLoCo", "DiLoCo+overlap", "SparseLoCo", "SparseLoCo+overlap")
HIVEMIND = ARMS[0]
QUICK_MODEL = dict(d_model=64, n_layers=2, n_heads=2, ffn_hidden=128, seq_len=64)
# times sqrt(target_batch_size / batch): the plain square-root rule, no factor tuned on the result (docstring)
HIVEMIND_LR_SCALE = 1.0


def hivemind_lr(spec: RunSpec, target_batch_size: int) -> float:
    return round(spec.inner.lr * math.sqrt(target_batch_size / spec.data.batch_size) * HIVEMIND_LR_SCALE, 6)


def base_spec(quick: bool) -> RunSpec:
    spec = RunSpec(run_id="wan", seed=0)
    if quick:
        spec = spec.replace(model=QUICK_MODEL, data=dict(batch_size=8, val_batches=2), outer=dict(inner_steps=10),
                            swarm=dict(matchmaking_time=2.0, heartbeat_period=0.5))  # tests/support/swarm_harness.py's
    return spec


def arm_spec(base: RunSpec, name: str) -> RunSpec:
    if name == HIVEMIND:
        return base
    strategy = "diloco" if name.startswith("DiLoCo") else "sparseloco"
    outer = dict(strategy=strategy, overlap=name.endswith("+overlap"))
    if strategy == "diloco":
        outer["dense_dtype"] = "fp16"  # the hivemind arm averages in fp16 too
    return base.replace(run_id=f"wan-{strategy}{'-overlap' if outer['overlap'] else ''}", outer=outer)


def hivemind_settings(spec: RunSpec, rate_bits: float, samples_per_s: float, budget: int, rounds: int,
                      target_batch_size: Optional[int] = None) -> Dict[str, Any]:
    """hivemind.Optimizer's settings for this swarm, as its documentation (the Optimizer's
    "Configuration guide" docstring) recommends:

    - ``matchmaking_time`` 3 s: "3-5s for small local runs" (four peers; the links here add no
      latency), the same window as voloco's (``swarm.matchmaking_time``; ``--quick``: 2 s for both);
    - ``averaging_timeout`` "around 2x the actual time it takes to run all-reduce": twice what an
      fp16 butterfly all-reduce of the model takes at the link rate, and at least 30 s (Lightning's
      HivemindStrategy default), since these CPU-capped workers compress and reduce slowly;
    - ``target_batch_size``: "train with very large batch sizes to reduce the % of time spent on
      communication", against the fewer global steps a larger batch leaves in the token budget (in
      the sweep, 640 samples a step ended 0.2 nats worse than 256): what the swarm computes (the
      speed probe's tokens/s) while one global step communicates (matchmaking, the gradient
      all-reduce and the parameters' state averaging, at the link rate), so that communication
      takes at most about half the time, rounded up to a whole batch of every peer; at most the
      budget over ``rounds``, so that it takes at least as many global steps as a voloco peer
      takes rounds;
    - the learning rate for that batch (``HIVEMIND_LR_SCALE``); fp16 compression, the offloaded
      optimizer, synchronous updates: bench/wan_hivemind.py.
    """
    n, B = len(PEERS), spec.data.batch_size
    allreduce_s = 2 * (n - 1) / n * 2 * spec.model.num_params() / (rate_bits / 8)
    matchmaking = spec.swarm.matchmaking_time  # 3 s: the spec's default (--quick: 2 s, the voloco arms' too)
    if target_batch_size is None:
        comm_s = matchmaking + 2 * allreduce_s
        most = max(1, budget // (spec.model.seq_len * rounds * n * B))
        target_batch_size = min(math.ceil(samples_per_s * comm_s / (n * B)), most) * n * B
    return dict(
        target_batch_size=target_batch_size,
        lr=hivemind_lr(spec, target_batch_size),
        epochs=math.ceil(budget / (target_batch_size * spec.model.seq_len)),
        matchmaking_time=matchmaking,
        averaging_timeout=round(max(30.0, 2 * allreduce_s), 1),
    )


def score(results: List[Dict[str, Any]], target: Optional[float]) -> float:
    """Fill in time to target and the ratios against hivemind.Optimizer; returns the target."""
    finals = [r["final_val_loss"] for r in results if r["kind"] == "voloco" and r["final_val_loss"] is not None]
    if target is None:
        target = max(finals) if finals else float("nan")  # the slowest voloco arm reaches it at its end
    base = next((r for r in results if r["kind"] == "hivemind"), None)
    for r in results:
        fast = [p["util"] for h, p in r["peers"].items() if h != SLOW and p["util"] is not None]
        r["util_fast"] = statistics.mean(fast) if fast else None
        r["util_slow"] = r["peers"][SLOW]["util"]
        r["wire_sent_per_peer"] = statistics.mean(p["wire_sent"] for p in r["peers"].values())
        r["wire_received_per_peer"] = statistics.mean(p["wire_received"] for p in r["peers"].values())
        for way in ("sent", "received"):
            accounted = [p.get(f"accounted_{way}") for p in r["peers"].values() if p.get(f"accounted_{way}") is not None]
            r[f"accounted_{way}_per_peer"] = statistics.mean(accounted) if accounted else None
        r["target_val_loss"] = target
        r["time_to_target_s"] = time_to(r["curve"], target)
        r["sooner_than_hivemind"] = r["fewer_bytes_than_hivemind"] = r["hivemind_reached_target"] = None
        if base is not None:
            tb, ta = base["time_to_target_s"], r["time_to_target_s"]
            r["hivemind_reached_target"] = tb is not None  # if not: sooner without bound, on its budget
            if None not in (ta, tb):
                r["sooner_than_hivemind"] = tb / max(ta, 1e-3)
            r["fewer_bytes_than_hivemind"] = base["wire_sent_per_peer"] / max(1, r["wire_sent_per_peer"])
    return target


def fmt(x, spec="{:.3f}", none="-") -> str:
    return none if x is None else spec.format(x)


def print_rate(rate: str, results: List[Dict[str, Any]], target: float, given: bool = False, log=print) -> None:
    rows = []
    for r in results:
        sooner = r["sooner_than_hivemind"]
        never = r["hivemind_reached_target"] is False and r["time_to_target_s"] is not None
        sooner_s = "hm never" if never else fmt(sooner, "{:.2f}x")
        rows.append([r["arm"] + ("" if r["finished"] else " (FAILED)"), fmt(r["time_to_target_s"], "{:.0f} s", "not reached"),
                     fmt(r["final_val_loss"]), f"{r['tokens']:,}", f"{r['wall_s']:.0f} s", human(r["wire_sent_per_peer"]),
                     "n/a" if r["accounted_sent_per_peer"] is None else human(r["accounted_sent_per_peer"]),
                     fmt(r["util_fast"], "{:.1%}"), fmt(r["util_slow"], "{:.1%}"), sooner_s,
                     fmt(r["fewer_bytes_than_hivemind"], "{:.1f}x")])  # fmt: skip
    why = "given" if given else "the slowest voloco arm's final loss" if not math.isnan(target) else "no voloco arm ran"
    log(f"\n{rate}: target validation loss {target:.4f} ({why})")
    log(table(["arm", "to target", "final val", "tokens", "wall", "iface sent/peer", "accounted sent/peer",
               "util fast", "util slow", "sooner vs hm", "fewer bytes vs hm"], rows))  # fmt: skip
    keys = sorted({p["accounted_key"] for r in results for p in r["peers"].values() if p["accounted_key"]})
    log(f"accounted bytes: the peers' status key(s) {keys or 'none'}; hivemind.Optimizer counts none")
    log("received per peer, interface / accounted: " + ", ".join(
        f"{r['arm']} {human(r['wire_received_per_peer'])} / {'n/a' if r['accounted_received_per_peer'] is None else human(r['accounted_received_per_peer'])}"
        for r in results))  # fmt: skip
    base = next((r for r in results if r["kind"] == "hivemind"), None)
    for r in results if base is not None else []:
        wins = []
        if r is base:
            continue
        if (r["sooner_than_hivemind"] or 1) < 1 or (r["time_to_target_s"] is None and base["time_to_target_s"] is not None):
            wins.append("time to target")
        if None not in (base["final_val_loss"], r["final_val_loss"]) and base["final_val_loss"] < r["final_val_loss"]:
            wins.append(f"final loss ({base['final_val_loss']:.3f} < {r['final_val_loss']:.3f})")
        if (r["fewer_bytes_than_hivemind"] or 1) < 1:
            wins.append("bytes")
        if wins:
            log(f"hivemind.Optimizer wins against {r['arm']} on: {', '.join(wins)}")
    goal = next((r for r in results if r["arm"] == "SparseLoCo+overlap"), None)
    if goal is not None and base is not None:  # the goals, measured (not asserted)
        sooner = "never reached by hivemind" if goal["hivemind_reached_target"] is False else fmt(goal["sooner_than_hivemind"], "{:.2f}x")
        log(f"goals, SparseLoCo+overlap: fast-peer utilization {fmt(goal['util_fast'], '{:.1%}')} (>= 97%), "
            f"target {sooner} sooner (>= 3x), {fmt(goal['fewer_bytes_than_hivemind'], '{:.1f}x')} fewer bytes on the "
            f"interface (>= 100x) than hivemind.Optimizer")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small model, 3 rounds, 10 Mbit/s only (a few minutes)")
    ap.add_argument("--json", type=Path, metavar="OUT", help="also write every figure as strict JSON to OUT")
    ap.add_argument("--rates", help="comma-separated link rates (default 10mbit,100mbit; --quick: 10mbit)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated arms (default all: {','.join(ARMS)})")
    ap.add_argument("--rounds", type=int, help="token budget in rounds of every peer's H steps (default 4; --quick: 3)")
    ap.add_argument("--target", type=float, help="target validation loss (default: the slowest voloco arm's final loss)")
    ap.add_argument("--cpus", type=float, default=0.4, help="CPU quota of every peer host (default 0.4)")
    ap.add_argument("--slowdown", type=float, default=2.0, help="how many times slower p3's inner steps are (default 2)")
    ap.add_argument("--hivemind-target-batch", type=int, help="override hivemind's target_batch_size (samples)")
    ap.add_argument("--arm-timeout", type=float, help="seconds before an arm is stopped as failed (default: from the budget)")
    ap.add_argument("--workdir", type=Path, help="logs and status files (default: a temporary folder)")
    ap.add_argument("--merge", type=Path, metavar="EARLIER", help="take the arms not in --arms from this earlier --json")
    args = ap.parse_args(argv)
    exit_on_sigterm()
    from tests.support.cpu_limit import CpuLimit, cleanup_stale_cpu_limits, cpu_limit_unavailable
    from tests.support.netns_hosts import Hosts, cleanup_stale
    from tests.support.netns_hosts import netns_unavailable, rate_bits

    arms = choose_names(args.arms, ARMS, "--arms")
    rates = [r.strip() for r in (args.rates or ("10mbit" if args.quick else "10mbit,100mbit")).split(",") if r.strip()]
    for r in rates:
        rate_bits(r)
    if (why := netns_unavailable()) is not None:
        print(f"bench/wan.py needs network namespaces: {why}", file=sys.stderr)
        return 2
    cleanup_stale(), cleanup_stale_cpu_limits()
    base = base_spec(args.quick)
    rounds = args.rounds or (3 if args.quick else 4)
    H, B, seq = base.outer.inner_steps, base.data.batch_size, base.model.seq_len
    budget = rounds * len(PEERS) * H * B * seq
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="voloco-wan-"))
    print(f"{now()} | {machine()}\nmodel {base.model.num_params() / 1e6:.2f}M parameters, batch {B} x {seq}, H = {H}; "
          f"budget {budget:,} tokens per arm ({rounds} rounds of 4 peers); logs in {workdir}", flush=True)  # fmt: skip
    no_cap = cpu_limit_unavailable()
    out: Dict[str, Any] = dict(date=now(), machine=machine(), command=" ".join(["python bench/wan.py", *(argv or sys.argv[1:])]),
                               budget_tokens=budget, rounds=rounds, params=base.model.num_params(), rates={})
    earlier = loads_strict(args.merge.read_text()) if args.merge else None
    if earlier is not None:
        if (earlier["budget_tokens"], earlier["params"]) != (budget, out["params"]):
            raise SystemExit(f"--merge {args.merge}: another budget or model than this run's")
        out["merged"] = {k: earlier.get(k) for k in ("command", "date", "speeds", "speed_ratio")}
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        limits = {h: None if no_cap else stack.enter_context(CpuLimit(args.cpus, h)) for h in PEERS}
        speeds = calibrate(base, limits, args.slowdown, 4.0 if args.quick else 10.0, workdir / "probe")
        fast = statistics.mean(v for h, v in speeds.items() if h != SLOW)
        ratio = fast / speeds[SLOW]
        print((f"CPU quota {args.cpus} CPU a peer" if no_cap is None else f"no CPU quotas ({no_cap})")
              + f"; {SLOW}'s inner steps {args.slowdown}x slower", flush=True)
        print("speed probe (all four at once): " + ", ".join(f"{h} {v:,.0f} tok/s" for h, v in speeds.items())
              + f"; fast / slow = {ratio:.2f}x", flush=True)  # fmt: skip
        out.update(cpu_quota=None if no_cap else args.cpus, cpu_quota_unavailable=no_cap, slowdown=args.slowdown,
                   speeds=speeds, speed_ratio=ratio)  # fmt: skip
        samples_per_s = sum(speeds.values()) / seq
        for rate in rates:
            hm = hivemind_settings(base, rate_bits(rate), samples_per_s, budget, rounds, args.hivemind_target_batch)
            timeout = args.arm_timeout or 180 + 4 * budget / speeds[SLOW]
            print(f"\n== {rate} links, hivemind.Optimizer: {hm}", flush=True)
            results = []
            with Hosts(["coord", *PEERS], rate=rate) as hosts:
                runner = ArmRunner(hosts, limits, args.slowdown, workdir / rate)
                for name in arms:
                    arm = Arm(name, arm_spec(base, name), hivemind=hm if name == HIVEMIND else None)
                    t = time.monotonic()
                    results.append(runner.run(arm, budget, timeout))
                    r = results[-1]
                    print(f"  {name}: final val {fmt(r['final_val_loss'])}, {r['tokens']:,} tokens in {r['wall_s']:.0f} s "
                          f"(+{time.monotonic() - t - r['wall_s']:.0f} s start/stop)", flush=True)  # fmt: skip
            if earlier is not None:  # the arms not run again, as the earlier run measured them
                old = {r["arm"]: r for r in earlier["rates"].get(rate, {}).get("arms", [])}
                new = {r["arm"]: r for r in results}
                results = [new.get(name) or old[name] for name in ARMS if name in new or name in old]
            target = score(results, args.target)
            print_rate(rate, results, target, given=args.target is not None)
            out["rates"][rate] = dict(target_val_loss=target, hivemind=hm, arms=results)
            out["wall_s"] = time.monotonic() - t0
            if args.json:  # after every rate: a run cut short keeps what it measured
                write_json(args.json, out, indent=1)
    print(f"\n{out['wall_s']:.0f} s in all", flush=True)
    return 0 if all(r["finished"] for v in out["rates"].values() for r in v["arms"]) else 1


if __name__ == "__main__":
    sys.exit(main())
