"""Inner-step throughput on a device (CUDA by default) and the codecs' CPU cost relative to H steps.

    python bench/cuda_step.py [--device cuda] [--shapes demo,large] [--steps 10] [--warmup 3]
                              [--H 30] [--codecs sparseloco] [--tf32] [--json OUT]
    python bench/cuda_step.py --device cpu --shapes tiny --steps 3     # a smoke test, seconds

For each model shape: build the model (``build_model``, on the CPU, then moved), train it with the
peer's own ``InnerTrainer`` (AdamW, fp32, the spec's schedule) on ``TrainStream`` batches of the
stdlib corpus, ``--warmup`` untimed steps (allocator, kernels, Adam state), then ``--steps`` timed
steps; the figure is the median step. A timed step is ``trainer.step(x, y)`` with the batch already
made on the CPU: the host-to-device copy, forward, backward, clip, AdamW and the ``loss.item()``
sync are in it, the batch sampling is not (its median is shown apart). On CUDA the clock is read
after ``torch.cuda.synchronize()``. tokens/s = batch x seq_len / median step.

Then, for each codec of ``--codecs``, the encode and decode time of a payload of the shape's whole
pseudo-gradient (θ before the timed steps minus θ after, on the CPU in float32: the codecs run on
the CPU by design, whatever the training device), best of ``--codec-repeats``: ``strategy.encode``
(the strategy's buffer folded in, msgpack included) and one ``strategy.decode`` of those bytes
(validation included). The fraction is (encode + decode) / (H x median step): the round's
compression overhead beside its H inner steps; a member decodes one payload per group member, so
multiply the decode column by the group size for a whole round.

Shapes (``--shapes``, comma-separated): demo (``RunSpec()`` defaults: 0.87M parameters, batch
16 x seq 128), large (d_model 768, 12 layers, 12 heads, ffn 2048, seq 512, batch 8: ~85M),
tiny (d_model 64, 2 layers, seq 64, batch 4: for a CPU smoke test).
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

from bench.common import best_of, choose_names, table  # noqa: E402
from peer.training.data import TrainStream, load_corpus  # noqa: E402
from peer.training.inner import InnerTrainer  # noqa: E402
from peer.training.model import build_model  # noqa: E402
from peer.outer.strategies import make_strategy, pseudo_gradient  # noqa: E402
from protocol.spec import RunSpec  # noqa: E402
from swarm.jsonout import dumps as strict_json  # noqa: E402  (NaN -> null: strict JSON)

SHAPES = {
    "demo": ({}, {}),  # RunSpec() defaults
    "large": ({"d_model": 768, "n_layers": 12, "n_heads": 12, "ffn_hidden": 2048, "seq_len": 512}, {"batch_size": 8}),
    "tiny": ({"d_model": 64, "n_layers": 2, "n_heads": 4, "ffn_hidden": 176, "seq_len": 64}, {"batch_size": 4}),
}
CODECS = {
    "sparseloco": {"strategy": "sparseloco"},
    "dct": {"strategy": "dct"},
    "dense-fp32": {"strategy": "diloco", "dense_dtype": "fp32"},
    "dense-fp16": {"strategy": "diloco", "dense_dtype": "fp16"},
}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return f"{p.name} ({p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs)"
    return f"CPU {platform.machine()}"


def machine(device: torch.device) -> str:
    cuda = f", CUDA {torch.version.cuda}" if device.type == "cuda" else ""
    return (f"{device_name(device)}; host {platform.machine()} {os.cpu_count()} CPU cores, "
            f"{torch.get_num_threads()} torch threads; torch {torch.__version__}{cuda}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def shape_spec(shape: str) -> RunSpec:
    model, data = SHAPES[shape]
    spec = RunSpec(run_id="bench-cuda-step")
    if model:
        spec = spec.replace(model=model)
    if data:
        spec = spec.replace(data=data)
    return spec


def time_steps(spec: RunSpec, corpus, device: torch.device, warmup: int, steps: int):
    """Median-able step times, batch-sampling times, the pseudo-gradient of the timed steps, peak memory."""
    model = build_model(spec.model, spec.seed)
    trainer = InnerTrainer(model, spec.inner, device)
    stream = TrainStream(corpus, spec.model.seq_len, spec.data.batch_size, spec.seed, shard="cuda-step")
    for _ in range(warmup):
        trainer.step(*stream.next_batch())
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    theta = {n: p.detach().to("cpu", torch.float32).clone() for n, p in model.named_parameters()}
    times, batch_times, losses = [], [], []
    for _ in range(steps):
        t = time.perf_counter()
        x, y = stream.next_batch()
        batch_times.append(time.perf_counter() - t)
        sync(device)
        t = time.perf_counter()
        losses.append(trainer.step(x, y))
        sync(device)
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    delta = pseudo_gradient(theta, dict(model.named_parameters()))
    del trainer, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return times, batch_times, losses, delta, peak


def run(args, device: torch.device, log=print):
    corpus = load_corpus("stdlib")
    shapes, codecs = choose_names(args.shapes, SHAPES, "--shapes"), choose_names(args.codecs, CODECS, "--codecs")
    steps_rows, codec_rows = [], []
    for shape in shapes:
        spec = shape_spec(shape)
        ms = spec.model
        params = ms.num_params()
        tokens = spec.data.batch_size * ms.seq_len
        log(f"{shape}: {params:,} parameters (d_model {ms.d_model}, {ms.n_layers} layers, {ms.n_heads} heads, "
            f"ffn {ms.ffn_hidden}), batch {spec.data.batch_size} x seq {ms.seq_len} = {tokens} tokens/step; "
            f"{args.warmup} warm-up + {args.steps} timed steps on {device}", flush=True)
        times, batch_times, losses, delta, peak = time_steps(spec, corpus, device, args.warmup, args.steps)
        step_s = statistics.median(times)
        row = dict(shape=shape, params=params, batch_size=spec.data.batch_size, seq_len=ms.seq_len, tokens_per_step=tokens,
                   device=str(device), step_s=step_s, step_min_s=min(times), step_max_s=max(times),
                   tokens_per_s=tokens / step_s, batch_sample_s=statistics.median(batch_times),
                   peak_mem_bytes=peak, first_loss=losses[0], last_loss=losses[-1], tf32=args.tf32)
        steps_rows.append(row)
        log(f"  step {1e3 * step_s:.2f} ms median (min {1e3 * min(times):.2f}, max {1e3 * max(times):.2f}) -> "
            f"{row['tokens_per_s']:,.0f} tokens/s; batch sampling {1e3 * row['batch_sample_s']:.2f} ms; "
            f"loss {losses[0]:.3f} -> {losses[-1]:.3f}" + (f"; peak GPU memory {peak / 2**30:.2f} GiB" if peak else ""),
            flush=True)
        h_s = args.H * step_s
        layout = ms.param_shapes()
        for codec in codecs:
            strategy = make_strategy(spec.replace(outer=CODECS[codec]), layout)
            (payload, _), enc_s = best_of(lambda: strategy.encode(delta, 0), args.codec_repeats)
            _, dec_s = best_of(lambda: strategy.decode(payload, 0), args.codec_repeats)
            frac = (enc_s + dec_s) / h_s
            codec_rows.append(dict(shape=shape, params=params, codec=codec, payload_bytes=len(payload), encode_s=enc_s,
                                   decode_s=dec_s, H=args.H, h_steps_s=h_s, encode_frac=enc_s / h_s,
                                   decode_frac=dec_s / h_s, fraction=frac))
            log(f"  {codec:<10} payload {len(payload):>12,} B  encode {enc_s:7.3f} s  decode {dec_s:7.3f} s  "
                f"= {100 * frac:6.2f} % of H={args.H} steps ({h_s:.2f} s)", flush=True)
        del delta
    return steps_rows, codec_rows


def print_tables(steps_rows, codec_rows, H: int, out=sys.stdout) -> None:
    cols = ["shape", "params", "batch x seq", "device", "step ms (median)", "tokens/s", "batch sampling ms", "peak GPU GiB"]
    lines = [[r["shape"], f"{r['params'] / 1e6:.2f}M", f"{r['batch_size']} x {r['seq_len']}", r["device"] + (" tf32" if r["tf32"] else ""),
              f"{1e3 * r['step_s']:.2f}", f"{r['tokens_per_s']:,.0f}", f"{1e3 * r['batch_sample_s']:.2f}",
              f"{r['peak_mem_bytes'] / 2**30:.2f}" if r["peak_mem_bytes"] else "-"] for r in steps_rows]
    print(table(cols, lines), file=out)
    if codec_rows:
        cols = ["shape", "codec", "payload B", "encode s", "decode s", f"H={H} steps s", "encode/H", "decode/H", "(enc+dec)/H"]
        lines = [[r["shape"], r["codec"], f"{r['payload_bytes']:,}", f"{r['encode_s']:.3f}", f"{r['decode_s']:.3f}",
                  f"{r['h_steps_s']:.2f}", f"{100 * r['encode_frac']:.1f} %", f"{100 * r['decode_frac']:.1f} %",
                  f"{100 * r['fraction']:.1f} %"] for r in codec_rows]
        print("\n" + table(cols, lines, left=2), file=out)
        print(f"\nH={H} steps s: {H} x the median timed step on the training device (extrapolated, not run). "
              "encode/decode: on the CPU, one payload; a member decodes one per group member.", file=out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None,
                    help="torch device to train on: cuda, cuda:N or cpu (default: cuda when available, else cpu)")
    ap.add_argument("--shapes", default=None,
                    help=f"comma-separated model shapes, of {', '.join(SHAPES)} (default: demo,large on CUDA, tiny on the CPU)")
    ap.add_argument("--steps", type=int, default=10, help="timed inner steps per shape, the median is reported (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed inner steps before the timed ones (default 3)")
    ap.add_argument("--H", type=int, default=30, help="inner steps per round the codec cost is compared with (default 30)")
    ap.add_argument("--codecs", default="sparseloco",
                    help=f"comma-separated codecs to time on each shape's pseudo-gradient, of {', '.join(CODECS)} (default sparseloco)")
    ap.add_argument("--codec-repeats", type=int, default=2, help="encode and decode are each timed this often, best kept (default 2)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads for the codecs and CPU training (default 0: torch's default)")
    ap.add_argument("--tf32", action="store_true",
                    help="allow TF32 matrix products on CUDA (not what peers do today: they train in plain fp32)")
    ap.add_argument("--json", type=Path, metavar="OUT", help="also write the rows and the machine line to this JSON file")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.H < 1 or args.codec_repeats < 1:
        ap.error("--steps, --H and --codec-repeats must be >= 1, --warmup >= 0")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch.cuda.is_available() is False here; use --device cpu")
    if args.shapes is None:
        args.shapes = "demo,large" if device.type == "cuda" else "tiny"
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.allow_tf32 = args.tf32
    t0 = time.monotonic()
    when = datetime.datetime.now().isoformat(timespec="seconds")
    print(f"bench/cuda_step.py: {when}, {machine(device)}", flush=True)
    steps_rows, codec_rows = run(args, device)
    print()
    print_tables(steps_rows, codec_rows, args.H)
    print(f"\ntotal {time.monotonic() - t0:.0f} s")
    if args.json:
        args.json.write_text(strict_json(dict(date=when, machine=machine(device), device=device_name(device), H=args.H,
                                             steps=steps_rows, codecs=codec_rows), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
