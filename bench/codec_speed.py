"""Encode + decode time of one round's payload vs the time of H inner steps, per codec.

    python bench/codec_speed.py [--json OUT] [--sizes 10M,100M] [--codecs sparseloco,dct] [--H 30]

For each model size: build the model, time a few inner steps (AdamW, batch 16x128 from the
spec) after one warm-up step and extrapolate to H steps (the time of H steps is taken as H times
the median measured step); then, for every codec, time ``strategy.encode`` of a pseudo-gradient
of the whole model (every tensor; the strategy's buffers folded in, msgpack included) and one
``strategy.decode`` of the resulting bytes (validation included). The overhead figure is
``(encode + decode) / (H x step)``. In a real round a member decodes one payload per member of
its group: multiply the decode column by the group size for that.

The pseudo-gradient is that of real training (θ after the measured steps minus θ before), so
top-k selection and quantization see realistic values.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import best_of, time_inner_steps  # noqa: E402
from peer.training.data import load_corpus  # noqa: E402
from peer.outer.strategies import make_strategy, pseudo_gradient  # noqa: E402
from protocol.spec import ModelSpec, RunSpec  # noqa: E402
from swarm.jsonout import dumps as strict_json  # noqa: E402  (NaN -> null: strict JSON)

SIZES = {
    # d_model, layers, heads, ffn: 10.8M and 99.3M parameters
    "10M": ModelSpec(d_model=384, n_layers=6, n_heads=6, ffn_hidden=1024, seq_len=128),
    "100M": ModelSpec(d_model=768, n_layers=12, n_heads=12, ffn_hidden=2560, seq_len=128),
    "1M": ModelSpec(),  # the demo model, 0.87M (not in the default run)
}
CODECS = {
    "dense fp32": {"strategy": "diloco", "dense_dtype": "fp32"},
    "dense fp16": {"strategy": "diloco", "dense_dtype": "fp16"},
    "sparseloco": {"strategy": "sparseloco"},
    "dct": {"strategy": "dct"},
}
GOAL = 0.02


def machine() -> str:
    return f"{platform.machine()} {os.cpu_count()} CPU cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


def time_steps(spec: RunSpec, corpus, steps: int):
    model, theta, times, _ = time_inner_steps(spec, corpus, steps, shard="speed")
    return times, pseudo_gradient(theta, dict(model.named_parameters()))


def run(sizes, H: int, steps: int, log=print, codecs=tuple(CODECS), repeats=None):
    corpus = load_corpus("stdlib")
    rows = []
    for size in sizes:
        ms = SIZES[size]
        base = RunSpec(run_id="bench-codec-speed", model=ms)
        params = ms.num_params()
        log(f"{size}: {params:,} parameters (d_model {ms.d_model}, {ms.n_layers} layers, ffn {ms.ffn_hidden}); timing {steps} inner steps")
        times, delta = time_steps(base, corpus, steps)
        step_s = statistics.median(times)
        h_s = H * step_s
        log(f"  inner step {step_s:.3f} s (median of {steps}: {', '.join(f'{t:.2f}' for t in times)}) -> H={H}: {h_s:.1f} s")
        layout = ms.param_shapes()
        best = repeats or (3 if params < 20e6 else 1)
        for codec in codecs:
            strategy = make_strategy(base.replace(outer=CODECS[codec]), layout)
            (payload, _), enc_s = best_of(lambda: strategy.encode(delta, 0), best)
            _, dec_s = best_of(lambda: strategy.decode(payload, 0), best)
            frac = (enc_s + dec_s) / h_s
            rows.append(dict(size=size, params=params, codec=codec, payload_bytes=len(payload), encode_s=enc_s,
                             decode_s=dec_s, step_s=step_s, H=H, h_steps_s=h_s, fraction=frac, meets_goal=frac < GOAL))
            log(f"  {codec:<11} payload {len(payload):>12,} B  encode {enc_s:7.3f} s  decode {dec_s:7.3f} s  "
                f"{100 * frac:6.2f} % of H steps")
        delta = None  # freed before the next size
    return rows


def print_table(rows, H: int, out=sys.stdout):
    cols = ["model", "codec", "payload", "encode s", "decode s", f"H={H} steps s", "(enc+dec)/H steps", "goal <2 %"]
    lines = [[f"{r['size']} ({r['params'] / 1e6:.1f}M)", r["codec"], f"{r['payload_bytes']:,}", f"{r['encode_s']:.3f}",
              f"{r['decode_s']:.3f}", f"{r['h_steps_s']:.1f}", f"{100 * r['fraction']:.2f} %",
              "ok" if r["meets_goal"] else "MISS"] for r in rows]
    widths = [max(len(c), *(len(l[i]) for l in lines)) for i, c in enumerate(cols)]
    fmt = lambda row: "  ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths)))  # noqa: E731
    print(fmt(cols), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for l in lines:
        print(fmt(l), file=out)
    print(f"\nH={H} steps s: {H} x the median measured inner step (batch 16x128, AdamW), extrapolated, not run.\n"
          "encode: strategy.encode of the whole model's pseudo-gradient; decode: one strategy.decode of those bytes.\n"
          "A member decodes one payload per group member per round: multiply the decode column by the group size.", file=out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--sizes", default="10M,100M", help=f"comma-separated, of {sorted(SIZES)}")
    ap.add_argument("--codecs", default=",".join(CODECS), help=f"comma-separated, of {list(CODECS)}")
    ap.add_argument("--repeats", type=int, help="best of this many encodes and decodes (default: 3 below 20M parameters, else 1)")
    ap.add_argument("--H", type=int, default=30)
    ap.add_argument("--steps", type=int, default=3, help="inner steps to time (after one warm-up step)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    t0 = time.monotonic()
    print(f"bench/codec_speed.py: {datetime.datetime.now().isoformat(timespec='seconds')}, {machine()}")
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    unknown = sorted(set(codecs) - set(CODECS))
    if unknown:
        ap.error(f"--codecs: unknown {unknown}, choose from {list(CODECS)}")
    rows = run(sizes, args.H, args.steps, codecs=codecs, repeats=args.repeats)
    print()
    print_table(rows, args.H)
    print(f"\ntotal {time.monotonic() - t0:.0f} s")
    if args.json:
        args.json.write_text(strict_json(dict(date=datetime.datetime.now().isoformat(timespec="seconds"), machine=machine(),
                                             H=args.H, rows=rows), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
