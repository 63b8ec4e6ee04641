"""DiLoCo vs a single process at equal total tokens, and its bytes vs per-step data parallel.

    python bench/diloco.py [--quick] [--json OUT]

Arms (same model, data, seeds, total tokens):

* ``single``: one process, plain AdamW (``peer.round.simulate.train_single``), batch B, R_max·N steps;
* ``diloco R=2``: 2 replicas of the real round loop (``peer.round.simulate.simulate``), N·R_max/2 steps each;
* ``diloco R=4``: 4 replicas, N steps each;
* ``dp R=4`` (context, ``--arms 1,2,4,dp``): one process, batch R_max·B, N steps: what per-step
  data parallel over the R_max replicas computes (DiLoCo's compute-matched baseline). The goal is
  judged against ``single``, which takes R_max× more sequential steps and is the harder baseline.

Bytes: for DiLoCo, the real encoded payload (``len(strategy.encode(...)[0])``, dense fp32 plus
the msgpack header) times the rounds, and the exchange's all-gather model: each peer sends its
payload to each of the R−1 other members every round, so ``sent/peer = rounds·(R−1)·payload``
(received is the same). For per-step data parallel the figure is analytic: a ring all-reduce of
the fp32 gradients every inner step sends ``2·(R−1)/R·4·params`` bytes per peer, over the same
number of inner steps per peer. The ratio of the two is ≈ 2H/R.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import human, machine, now, run_jobs, table, warm_start  # noqa: E402
from peer.training.data import load_corpus  # noqa: E402
from protocol.wire.exchange_bytes import allreduce_bytes_per_step  # noqa: E402
from peer.round.simulate import simulate, train_single  # noqa: E402
from protocol.spec import ModelSpec, RunSpec  # noqa: E402
from swarm.jsonout import dumps as strict_json  # noqa: E402  (NaN -> null: strict JSON)

CONFIGS = {
    # ~0.47M parameters, sequences of 64 bytes: a few minutes for the three arms on 2 cores
    "full": dict(
        model=dict(d_model=128, n_layers=2, n_heads=4, ffn_hidden=352, seq_len=64),
        batch_size=16,
        # H and the outer lr from a sweep at R=4 (bench/RESULTS.md): H 125 / 75 x outer lr 0.5 / 0.7 / 1.0 / 1.5
        inner_steps=75,
        steps_per_replica_at_rmax=750,  # N: the R_max replicas' own steps; single runs R_max·N
        warm_start=1000,  # single-process steps every arm starts from (DiLoCo's protocol), not counted
        lr=2e-3, warmup=30, outer_lr=1.0, momentum=0.9,
        dense_dtype="fp16",  # pseudo-gradients on the wire in fp16, as OpenDiLoCo does
    ),
    # ~0.13M parameters: under a minute, for CI smoke tests
    "quick": dict(
        model=dict(d_model=64, n_layers=2, n_heads=4, ffn_hidden=176, seq_len=64),
        batch_size=8, inner_steps=125, steps_per_replica_at_rmax=250, warm_start=300,
        lr=3e-3, warmup=20, outer_lr=0.7, momentum=0.9,
    ),
}
REPLICAS = (2, 4)
LOSS_GOAL = 0.05  # DiLoCo within 5 % of the single process's val loss
BYTES_GOAL = 50.0  # at >= 50x fewer bytes than per-step fp32 all-reduce


def make_spec(cfg, steps: int, strategy: str = "diloco") -> RunSpec:
    return RunSpec(run_id="bench-diloco", seed=0, model=ModelSpec(**cfg["model"])).replace(
        data={"batch_size": cfg["batch_size"], "val_batches": 8},
        inner={"lr": cfg["lr"], "warmup_steps": cfg["warmup"], "total_steps": max(steps, cfg["warmup"] + 1)},
        outer={
            "strategy": strategy,
            "inner_steps": cfg["inner_steps"],
            "lr": cfg["outer_lr"],
            "momentum": cfg["momentum"],
            "nesterov": True,
            "dense_dtype": cfg.get("dense_dtype", "fp32"),
        },
    )


def run_arm(job):
    """One arm (R = 1: the single process), in a worker process or in this one."""
    cfg, R, init, threads = job
    torch.set_num_threads(threads)
    corpus = load_corpus("stdlib")
    total_steps = max(REPLICAS) * cfg["steps_per_replica_at_rmax"]
    H = cfg["inner_steps"]
    t = time.monotonic()
    if R == "dp":
        R, steps = max(REPLICAS), cfg["steps_per_replica_at_rmax"]
        spec = make_spec(cfg, steps)
        dp = train_single(spec, steps, corpus=corpus, batch_size=R * cfg["batch_size"], init_theta=init)
        print(f"  dp R={R}: {steps} steps of batch {R * cfg['batch_size']}, val {dp.final_val_loss:.4f} "
              f"({time.monotonic() - t:.0f} s)", flush=True)
        per_peer = steps * allreduce_bytes_per_step(spec.model.num_params(), R)
        return dict(arm=f"dp R={R} (1 proc, {R}x batch)", replicas=0, H=1, rounds=None, steps_per_replica=steps, tokens=dp.tokens,
                    val_loss=dp.final_val_loss, initial_val_loss=dp.initial_val_loss, payload_bytes=None,
                    sent_per_peer=per_peer, dp_per_peer=per_peer, wall_s=dp.wall_s)
    if R == 1:
        single = train_single(make_spec(cfg, total_steps), total_steps, corpus=corpus, init_theta=init)
        print(f"  single: {total_steps} steps, val {single.final_val_loss:.4f} ({time.monotonic() - t:.0f} s)", flush=True)
        return dict(arm="single", replicas=1, H=None, rounds=None, steps_per_replica=total_steps, tokens=single.tokens,
                    val_loss=single.final_val_loss, initial_val_loss=single.initial_val_loss, payload_bytes=None,
                    sent_per_peer=0, dp_per_peer=0, wall_s=single.wall_s)
    steps = total_steps // R
    if steps % H:
        raise ValueError(f"steps per replica {steps} is not a multiple of H={H}")
    spec = make_spec(cfg, steps)
    res = simulate(spec, R, steps // H, corpus=corpus, eval_every=0, verify_rounds=1, init_theta=init)
    print(f"  diloco R={R}: {res.rounds} rounds x H={H}, val {res.final_val_loss:.4f} ({time.monotonic() - t:.0f} s)", flush=True)
    return dict(arm=f"diloco R={R}", replicas=R, H=H, rounds=res.rounds, steps_per_replica=steps, tokens=res.tokens,
                val_loss=res.final_val_loss, initial_val_loss=res.initial_val_loss, payload_bytes=res.payload_bytes,
                sent_per_peer=res.bytes_sent_per_peer, received_per_peer=res.bytes_received_per_peer,
                dp_per_peer=res.dp_bytes_per_peer, dp_per_step=allreduce_bytes_per_step(spec.model.num_params(), R),
                wall_s=res.wall_s)


def run(cfg, jobs: int = 1, threads: int = 2, log=print, replicas=(1,) + REPLICAS + ("dp",)):
    total_steps = max(REPLICAS) * cfg["steps_per_replica_at_rmax"]
    spec = make_spec(cfg, total_steps)
    params = spec.model.num_params()
    log(f"model {params:,} parameters, batch {cfg['batch_size']}x{spec.model.seq_len}, H={cfg['inner_steps']}, "
        f"{total_steps * cfg['batch_size'] * spec.model.seq_len:,} tokens per arm", flush=True)
    warm = cfg.get("warm_start", 0)
    init, warm_val = None, None
    if warm:
        init, warm_val = warm_start(make_spec(cfg, warm), warm, log)
    rows = run_jobs(run_arm, [(cfg, R, init, threads) for R in replicas], jobs)
    base = rows[0]["val_loss"] if rows[0]["replicas"] == 1 else float("nan")
    for r in rows:
        r["loss_ratio"] = r["val_loss"] / base
        r["bytes_ratio"] = r["dp_per_peer"] / r["sent_per_peer"] if r["sent_per_peer"] else None
        if r["replicas"] > 1:  # the DiLoCo arms (the dp arm has replicas=0)
            r["meets_loss_goal"] = bool(r["loss_ratio"] <= 1 + LOSS_GOAL)
            r["meets_bytes_goal"] = r["bytes_ratio"] >= BYTES_GOAL
    return dict(params=params, config=cfg, rows=rows, warm_start_val_loss=warm_val)


def print_table(result, out=sys.stdout):
    cols = ["arm", "rounds", "steps/peer", "tokens", "val loss", "vs single", "payload", "sent/peer", "DP all-reduce/peer", "DP/sent", "goal"]
    lines = []
    for r in result["rows"]:
        goal = ""
        if r["replicas"] > 1:
            goal = ("loss ok" if r["meets_loss_goal"] else "loss MISS") + ", " + ("bytes ok" if r["meets_bytes_goal"] else "bytes MISS")
        lines.append([
            r["arm"],
            "-" if r["rounds"] is None else str(r["rounds"]),
            str(r["steps_per_replica"]),
            f"{r['tokens']:,}",
            f"{r['val_loss']:.4f}",
            f"{r['loss_ratio']:.3f}",
            "-" if r["payload_bytes"] is None else human(r["payload_bytes"]),
            "-" if not r["sent_per_peer"] else human(r["sent_per_peer"]),
            "-" if not r["dp_per_peer"] else human(r["dp_per_peer"]),
            "-" if r["bytes_ratio"] is None else f"{r['bytes_ratio']:.1f}x",
            goal,
        ])
    print(table(cols, lines), file=out)
    print(
        "\nsent/peer: real encoded payload bytes x rounds x (R-1): the all-gather serves each peer's payload to the\n"
        "R-1 other members (received/peer is the same). DP all-reduce/peer: analytic, 2(R-1)/R x 4 B x params per\n"
        "inner step (fp32 ring all-reduce every step) over the same steps per peer; DP/sent ~ 2H/R.",
        file=out,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a tiny model, under a minute (CI smoke test)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per process")
    ap.add_argument("--jobs", type=int, default=1, help="arms run in parallel processes")
    ap.add_argument("--H", type=int, help="override the inner steps per round")
    ap.add_argument("--steps", type=int, help="override N, the steps of each of the 4 replicas")
    ap.add_argument("--outer-lr", type=float, help="override the outer (Nesterov) learning rate")
    ap.add_argument("--lr", type=float, help="override the inner learning rate")
    ap.add_argument("--warm-start", type=int, help="override: single-process steps every arm starts from")
    ap.add_argument("--momentum", type=float, help="override the outer momentum")
    ap.add_argument("--dense-dtype", choices=("fp32", "fp16"), help="the DiLoCo payload's wire dtype (default fp32)")
    ap.add_argument("--arms", default="1,2,4,dp",
                    help="arms to run: replica counts (1 = the single process) and 'dp' (one process, 4x batch); default 1,2,4,dp")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = dict(CONFIGS["quick" if args.quick else "full"])
    for key, value in (("inner_steps", args.H), ("steps_per_replica_at_rmax", args.steps), ("outer_lr", args.outer_lr), ("lr", args.lr),
                       ("warm_start", args.warm_start), ("momentum", args.momentum),
                       ("dense_dtype", args.dense_dtype)):
        if value is not None:
            cfg[key] = value
    t0 = time.monotonic()
    print(f"bench/diloco.py{' --quick' if args.quick else ''}: {now()}, {machine()}, "
          f"{args.jobs} job(s) x {args.threads} thread(s)", flush=True)
    names = [a.strip() for a in args.arms.split(",")]
    known = [str(r) for r in (1,) + REPLICAS] + ["dp"]
    if any(a not in known for a in names):
        ap.error(f"--arms: each must be one of {', '.join(known)}; got {args.arms!r}")
    arms = tuple(a if a == "dp" else int(a) for a in names)
    result = run(cfg, args.jobs, args.threads, replicas=arms)
    print()
    print_table(result)
    print(f"\ntotal {time.monotonic() - t0:.0f} s")
    if args.json:
        result.update(date=now(), machine=machine(), quick=args.quick)
        args.json.write_text(strict_json(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
