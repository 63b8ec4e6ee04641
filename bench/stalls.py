"""What holds a peer's inner loop between rounds: compute utilization of one real peer, alone,
without and with end-of-round checkpoints.

    python bench/stalls.py [--shape small] [--device cpu|cuda] [--compile] [--rounds N]
                           [--threads N] [--json OUT]

One coordinator and one peer as processes on loopback (tests/support/swarm_harness.py), the peer alone
(every round is a round of one, so nothing waits on other peers), overlap on (the default). Two
arms on the same shape, one after the other: ``--checkpoint-dir`` off (the baseline) and on.
Rows: the peer's compute utilization (time in inner steps / wall time; the median over the rounds
after the first ``--skip``), the median round time, and the checkpoints on disk at the end.
What a round costs beyond its inner steps shows as 1 - utilization: the encode, the exchange's
bookkeeping, the evaluation and the checkpoint, whichever of them holds the next round's steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import exit_on_sigterm, machine, now, table  # noqa: E402
from swarm.jsonout import dumps as strict_json  # noqa: E402
from tests.support.swarm_harness import Swarm  # noqa: E402

SHAPES = {  # model fields, batch size
    "tiny": ("d_model = 64\nn_layers = 2\nn_heads = 2\nffn_hidden = 128\nseq_len = 64", 8),
    "small": ("d_model = 384\nn_layers = 6\nn_heads = 6\nffn_hidden = 1024\nseq_len = 64", 4),
    "125m": ('preset = "125m"', 8),
    "350m": ('preset = "350m"', 8),
}
SPEC = """
run_id = "stalls"
seed = 1
[model]
{model}
[data]
batch_size = {batch}
val_batches = 2
[outer]
strategy = "{strategy}"
inner_steps = {H}
"""


def run_arm(args, checkpoint: bool, workdir: Path, log=print) -> dict:
    model, batch = SHAPES[args.shape]
    swarm = Swarm(workdir, spec_text=SPEC.format(model=model, batch=batch, strategy=args.strategy, H=args.H))
    extra = ["--device", args.device, "--threads", str(args.threads), "--max-rounds", str(args.rounds + 50)]
    extra += ["--compile"] if args.compile else []
    t0 = time.monotonic()
    try:
        swarm.add_peer("p", *extra, checkpoint=checkpoint)
        swarm.wait(lambda: (swarm.status("p") or {}).get("rounds", 0) >= args.rounds + args.skip, args.timeout,
                   f"{args.rounds + args.skip} rounds")
        status = swarm.status("p")
    finally:
        swarm.close()
    hist = status["history"][args.skip:]
    ckpt = sorted(p.name for p in (workdir / "p" / "ckpt").glob("*.safetensors")) if checkpoint else []
    row = dict(checkpoints=checkpoint, rounds=len(hist), util=statistics.median(r["util"] for r in hist),
               util_min=min(r["util"] for r in hist), round_s=statistics.median(r["seconds"] for r in hist),
               steps=statistics.median(r["steps"] for r in hist), files=ckpt, wall_s=time.monotonic() - t0)
    log(f"  checkpoints {'on ' if checkpoint else 'off'}: util {100 * row['util']:.1f} % (min {100 * row['util_min']:.1f}), "
        f"round {row['round_s']:.2f} s, {row['rounds']} rounds", flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES), help="model shape (default small: 10.7M parameters)")
    ap.add_argument("--device", default="cpu", help="the peer's --device (default cpu)")
    ap.add_argument("--compile", action="store_true", help="the peer's --compile")
    ap.add_argument("--strategy", default="sparseloco", choices=("sparseloco", "diloco", "dct"), help="outer strategy (default sparseloco)")
    ap.add_argument("--H", type=int, default=30, help="inner steps per round (default 30)")
    ap.add_argument("--rounds", type=int, default=8, help="rounds measured per arm (default 8)")
    ap.add_argument("--skip", type=int, default=3, help="first rounds left out: start-up, compile (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="the peer's torch threads (default 2)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds an arm may take (default 900)")
    ap.add_argument("--json", type=Path, metavar="OUT", help="also write the rows as JSON to OUT")
    args = ap.parse_args(argv)
    if min(args.H, args.rounds, args.threads) < 1 or args.skip < 0 or args.timeout <= 0:
        ap.error("--H, --rounds and --threads must be >= 1, --skip >= 0, --timeout > 0")
    exit_on_sigterm()
    print(f"bench/stalls.py: {now()}, {machine()}; shape {args.shape}, H={args.H}, {args.device}"
          + (" --compile" if args.compile else ""), flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="voloco-stalls-") as tmp:
        for checkpoint in (False, True):
            workdir = Path(tmp) / ("ckpt" if checkpoint else "none")
            workdir.mkdir()
            rows.append(run_arm(args, checkpoint, workdir))
    base = rows[0]["util"]
    cols = ["checkpoints", "rounds", "util (median)", "util (min)", "round s (median)", "util / baseline"]
    lines = [["on" if r["checkpoints"] else "off (baseline)", str(r["rounds"]), f"{100 * r['util']:.1f} %",
              f"{100 * r['util_min']:.1f} %", f"{r['round_s']:.2f}", f"{r['util'] / base:.3f}"] for r in rows]
    print("\n" + table(cols, lines))
    if args.json:
        args.json.write_text(strict_json(dict(date=now(), machine=machine(), args=vars(args) | {"json": str(args.json)},
                                              rows=rows), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
