"""GPU figures: bf16 inner-step throughput and MFU, full against partial peer memory, GPU encode cost.

    python bench/gpu.py [--json OUT] [--device cuda] [--shapes 125m,350m] [--peak-tflops T]
    python bench/gpu.py --device cpu --shapes tiny      # a smoke test, seconds

Without a CUDA GPU (and without ``--device cpu``) it says so and exits 0: nothing is estimated.

For each shape (``125m`` and ``350m``: protocol/spec/presets.py at seq 1024, batch ``--batch``; ``tiny``:
d_model 64, 2 layers, seq 64, batch 4), everything in one run, against its baseline in the same run:

* throughput: the peer's own ``InnerTrainer`` (fp32 master weights and AdamW) on ``TrainStream``
  batches of the stdlib corpus, at each of ``--precisions`` (default bf16,fp32: ``inner.precision``,
  bf16 autocast around forward + loss); ``--warmup`` untimed then ``--steps`` timed steps, the
  median reported, the clock read after ``torch.cuda.synchronize()``. tokens/s = batch x seq /
  median step. MFU = FLOPs/token x tokens/s / the device's peak dense bf16 FLOP/s, with FLOPs/token
  = 6 N + 12 n_layers seq d_model (the weights' forward and backward, and attention's QK^T and AV,
  PaLM's formula, arXiv 2204.02311, appendix B). The peak comes from ``PEAK_TFLOPS`` by device name
  or ``--peak-tflops``; unknown (and on the CPU) the MFU is left empty. Baseline: fp32 tokens/s.
* memory: ``torch.cuda.max_memory_allocated`` over a full peer's life (model to the device, AdamW
  state, ``--mem-steps`` steps) against a partial peer of S = 4 slices (peer/training/roles.py SliceOwner:
  the whole model, only slice 0 and the shared tensors trainable, so no gradients or AdamW state for
  the rest), MLP slices only and MLP + attention slices. Also, device-independent: the bytes of
  parameters + gradients + AdamW state. Baseline: the full peer (ratio partial / full).
* codec: one round's payload of the whole model's pseudo-gradient (θ before the timed steps minus
  after): ``strategy.encode`` with Δ on the training device (top-k, quantization, DCT there; only
  the packed fields come back), and ``strategy.decode`` of the bytes on the CPU (as every member
  does), best of ``--codec-repeats``; also the encode with Δ on the CPU (the old path). Baseline:
  H = ``--H`` inner steps at the first precision (the ratio (encode + decode) / H steps).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import best_of, choose_names, table  # noqa: E402
from bench.cuda_step import device_name, machine, sync  # noqa: E402
from peer.training.data import TrainStream, load_corpus  # noqa: E402
from peer.training.inner import InnerTrainer  # noqa: E402
from peer.training.model import build_model  # noqa: E402
from peer.outer.strategies import make_strategy, pseudo_gradient  # noqa: E402
from protocol.spec.presets import PRESETS  # noqa: E402
from protocol.spec import RunSpec  # noqa: E402
from swarm.jsonout import dumps as strict_json  # noqa: E402  (NaN -> null: strict JSON)

SHAPES = {
    "tiny": ({"d_model": 64, "n_layers": 2, "n_heads": 4, "ffn_hidden": 176, "seq_len": 64}, 4),
    "125m": (PRESETS["125m"], None),  # batch: --batch
    "350m": (PRESETS["350m"], None),
}
CODECS = {"sparseloco": {"strategy": "sparseloco"}, "dct": {"strategy": "dct"},
          "dense-fp16": {"strategy": "diloco", "dense_dtype": "fp16"}}
# dense bf16 tensor-core peaks (no sparsity), TFLOP/s, by a substring of the CUDA device name; first match wins
PEAK_TFLOPS = [
    ("GH200", 989.0), ("H200", 989.0),
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0),  # plain "H100 80GB HBM3" is the SXM part
    ("A100", 312.0), ("L40S", 362.0), ("A10G", 70.0), ("L4", 121.0),
]
SLICES = 4


def peak_tflops(name: str):
    return next((peak for key, peak in PEAK_TFLOPS if key.lower() in name.lower()), None)


def shape_spec(shape: str, batch: int, slices: int = 1, attention: bool = False) -> RunSpec:
    model, shape_batch = SHAPES[shape]
    return RunSpec(run_id="bench-gpu").replace(model=dict(model), data={"batch_size": shape_batch or batch},
                                                partial={"slices": slices, "attention": attention})


def flops_per_token(spec: RunSpec) -> float:
    ms = spec.model
    return 6.0 * ms.num_params() + 12.0 * ms.n_layers * ms.seq_len * ms.d_model


def _fresh(device):
    if device.type == "cuda":
        sync(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    return 0


def _state_bytes(trainer: InnerTrainer) -> int:
    """Parameters + gradients + AdamW state, in bytes (whatever the device). A gradient is counted
    for each trainable parameter: the trainer frees them after each step (peer/training/inner.py), but they
    are alive from each backward to its step."""
    n = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    n += sum(p.numel() * p.element_size() for p in trainer.params if p.requires_grad)
    n += sum(t.numel() * t.element_size() for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    return n


_BUILT = {}  # (model spec, slices, attention) -> the model built on the CPU (the init is slow at 350m)


def _model(spec: RunSpec):
    key = (spec.model, spec.partial.slices, spec.partial.attn_slices)
    if key not in _BUILT:
        _BUILT.clear()
        _BUILT[key] = build_model(spec.model, spec.seed, spec.partial.slices, spec.partial.attn_slices)
    return copy.deepcopy(_BUILT[key])


def train(spec: RunSpec, corpus, device, precision: str, warmup: int, steps: int, part: int = -1, keep_delta=False,
          compile=False):
    """Build a peer's model on the device and time its inner steps: a dict of figures (and Δ).
    ``compile``: the forward pass through torch.compile; ``warmup_s`` holds the compile time."""
    base = _fresh(device)
    model = _model(spec).to(device)
    owned = make_strategy(spec, part=part).layout
    for name, p in model.named_parameters():  # as Role does: the rest has no gradients, no AdamW state
        p.requires_grad_(name in owned)
    trainer = InnerTrainer(model, spec.replace(inner={"precision": precision}).inner, device, compile=compile)
    stream = TrainStream(corpus, spec.model.seq_len, spec.data.batch_size, spec.seed, shard="gpu-bench")
    t = time.perf_counter()
    for _ in range(warmup):
        trainer.step(*stream.next_batch())
    sync(device)
    warmup_s = time.perf_counter() - t
    theta = {n: p.detach().to("cpu", torch.float32).clone() for n, p in model.named_parameters()} if keep_delta else None
    times, losses = [], []
    for _ in range(steps):
        x, y = stream.next_batch()
        sync(device)
        t = time.perf_counter()
        losses.append(trainer.step(x, y))
        sync(device)
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
    out = dict(precision=trainer.precision + ("+compile" if compile else ""), step_s=statistics.median(times),
               warmup_s=warmup_s, peak_mem_bytes=peak,
               state_bytes=_state_bytes(trainer), trainable=sum(p.numel() for p in trainer.params),
               first_loss=losses[0], last_loss=losses[-1])
    delta = pseudo_gradient(theta, dict(model.named_parameters())) if keep_delta else None
    del trainer, model
    _fresh(device)
    return out, delta


def time_codec(spec: RunSpec, codec: str, delta, repeats: int, device):
    strategy = make_strategy(spec.replace(outer=CODECS[codec]))

    def encode():
        sync(device)
        out = strategy.encode(delta, 0)
        sync(device)
        return out

    (payload, pending), enc_s = best_of(encode, repeats)
    decoded, dec_s = best_of(lambda: strategy.decode(payload, 0), repeats)
    exact = all(torch.equal(decoded[n], pending.sent[n]) for n in decoded)  # what it keeps as sent is what members decode
    return payload, enc_s, dec_s, exact


def run(args, device, peak, log=print):
    corpus = load_corpus("stdlib")
    steps_rows, mem_rows, codec_rows = [], [], []
    for shape in args.shapes:
        spec = shape_spec(shape, args.batch)
        ms, tokens = spec.model, spec.data.batch_size * spec.model.seq_len
        fpt = flops_per_token(spec)
        log(f"{shape}: {ms.num_params():,} parameters, batch {spec.data.batch_size} x seq {ms.seq_len} = {tokens} tokens/step, "
            f"{fpt / 1e9:.3f} GFLOPs/token; {args.warmup} warm-up + {args.steps} timed steps on {device}", flush=True)
        full, delta = None, None
        arms = [(p, False) for p in args.precisions] + ([(args.precisions[0], True)] if args.compile else [])
        shape_rows = []
        for i, (precision, compiled) in enumerate(arms):
            fig, d = train(spec, corpus, device, precision, args.warmup, args.steps, keep_delta=i == 0 and "codecs" in args.parts,
                           compile=compiled)
            if i == 0:
                full, delta = fig, d
            tps = tokens / fig["step_s"]
            mfu = fpt * tps / (peak * 1e12) if peak else None
            shape_rows.append(dict(shape=shape, params=ms.num_params(), tokens_per_step=tokens, flops_per_token=fpt,
                                   tokens_per_s=tps, mfu=mfu, **fig))
            log(f"  {fig['precision']}: step {1e3 * fig['step_s']:.2f} ms -> {tps:,.0f} tokens/s"
                + (f", MFU {100 * mfu:.1f} %" if mfu is not None else "") + f"; loss {fig['first_loss']:.3f} -> {fig['last_loss']:.3f}"
                + f"; {args.warmup} warm-up steps {fig['warmup_s']:.1f} s",
                flush=True)
        base_tps = shape_rows[len(args.precisions) - 1]["tokens_per_s"]  # the last precision, eager
        for r in shape_rows:
            r["speedup_vs_last"] = r["tokens_per_s"] / base_tps
        steps_rows.extend(shape_rows)
        if "memory" in args.parts:
            mem_rows.extend(memory_rows(args, shape, corpus, device, full))
        if "codecs" in args.parts:
            codec_rows.extend(codec_rows_of(args, spec, shape, device, full, delta, log))
        del delta
        _fresh(device)
    return steps_rows, mem_rows, codec_rows


def memory_rows(args, shape, corpus, device, full, log=print):
    """Peak memory of a full peer (``full``: its figures) against partial peers of S = SLICES."""
    rows = [dict(shape=shape, peer="full", slices=1, attention=False, trainable=full["trainable"],
                 peak_mem_bytes=full["peak_mem_bytes"], state_bytes=full["state_bytes"], step_s=full["step_s"])]
    for attention in (False, True):
        pspec = shape_spec(shape, args.batch, SLICES, attention)
        fig, _ = train(pspec, corpus, device, args.precisions[0], 1, args.mem_steps, part=0)
        rows.append(dict(shape=shape, peer=f"partial S={SLICES}" + (" +attn" if attention else ""), slices=SLICES,
                         attention=attention, trainable=fig["trainable"], peak_mem_bytes=fig["peak_mem_bytes"],
                         state_bytes=fig["state_bytes"], step_s=fig["step_s"]))
    for r in rows:
        r["peak_ratio"] = (r["peak_mem_bytes"] / full["peak_mem_bytes"]) if full["peak_mem_bytes"] else None
        r["state_ratio"] = r["state_bytes"] / full["state_bytes"]
        log(f"  {r['peer']:<16} trainable {r['trainable']:,}  state {r['state_bytes'] / 2**20:,.1f} MiB"
            + (f"  peak {r['peak_mem_bytes'] / 2**30:.2f} GiB ({100 * r['peak_ratio']:.0f} % of full)" if r["peak_ratio"] else ""),
            flush=True)
    return rows


def codec_rows_of(args, spec, shape, device, full, delta, log=print):
    """One round's payload of ``delta`` per codec: encode on the device and on the CPU, decode on the CPU."""
    rows = []
    h_s = args.H * full["step_s"]
    cpu_delta = {n: t.cpu() for n, t in delta.items()} if device.type != "cpu" else None
    for codec in args.codecs:
        payload, enc_s, dec_s, exact = time_codec(spec, codec, delta, args.codec_repeats, device)
        cpu_enc_s = time_codec(spec, codec, cpu_delta, args.codec_repeats, torch.device("cpu"))[1] if cpu_delta else enc_s
        row = dict(shape=shape, codec=codec, payload_bytes=len(payload), encode_device=str(device), encode_s=enc_s,
                   cpu_encode_s=cpu_enc_s, decode_s=dec_s, H=args.H, h_steps_s=h_s, fraction=(enc_s + dec_s) / h_s,
                   cpu_fraction=(cpu_enc_s + dec_s) / h_s, sent_equals_decoded=exact)
        rows.append(row)
        log(f"  {codec:<10} {len(payload):>11,} B  encode {enc_s:.3f} s on {device} (CPU {cpu_enc_s:.3f} s)  decode {dec_s:.3f} s"
            f"  = {100 * row['fraction']:.2f} % of H={args.H} steps ({h_s:.2f} s)", flush=True)
    return rows


def print_tables(steps_rows, mem_rows, codec_rows, H, out=None) -> None:
    out = out or sys.stdout
    cols = ["shape", "params", "precision", "step ms", "tokens/s", "MFU", "vs last precision", "warm-up s", "loss first -> last"]
    lines = [[r["shape"], f"{r['params'] / 1e6:.1f}M", r["precision"], f"{1e3 * r['step_s']:.2f}", f"{r['tokens_per_s']:,.0f}",
              f"{100 * r['mfu']:.1f} %" if r["mfu"] is not None else "-", f"{r['speedup_vs_last']:.2f}x",
              f"{r['warmup_s']:.1f}", f"{r['first_loss']:.3f} -> {r['last_loss']:.3f}"] for r in steps_rows]
    print(table(cols, lines, left=3), file=out)
    if mem_rows:
        print_memory(mem_rows, out)
    if codec_rows:
        print_codecs(codec_rows, H, out)


def print_memory(mem_rows, out) -> None:
    cols = ["shape", "peer", "trainable", "params+grads+AdamW", "peak GPU memory", "peak / full", "state / full", "step ms"]
    lines = [[r["shape"], r["peer"], f"{r['trainable'] / 1e6:.2f}M", f"{r['state_bytes'] / 2**20:,.1f} MiB",
              f"{r['peak_mem_bytes'] / 2**30:.2f} GiB" if r["peak_mem_bytes"] is not None else "-",
              f"{100 * r['peak_ratio']:.0f} %" if r["peak_ratio"] is not None else "-", f"{100 * r['state_ratio']:.0f} %",
              f"{1e3 * r['step_s']:.2f}"] for r in mem_rows]
    print("\n" + table(cols, lines, left=2), file=out)


def print_codecs(codec_rows, H, out) -> None:
    cols = ["shape", "codec", "payload B", "encode s", "encode s (CPU)", "decode s (CPU)", f"H={H} steps s", "(enc+dec)/H",
            "with CPU encode", "sent == decoded"]
    lines = [[r["shape"], r["codec"], f"{r['payload_bytes']:,}", f"{r['encode_s']:.3f}", f"{r['cpu_encode_s']:.3f}",
              f"{r['decode_s']:.3f}", f"{r['h_steps_s']:.2f}", f"{100 * r['fraction']:.2f} %", f"{100 * r['cpu_fraction']:.2f} %",
              "yes" if r["sent_equals_decoded"] else "NO"] for r in codec_rows]
    print("\n" + table(cols, lines, left=2), file=out)
    print(f"\nH={H} steps s: {H} x the median step at the first precision (extrapolated). Encode on the training device, "
          "decode on the CPU (one payload; a member decodes one per group member).", file=out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default cuda; without a GPU: a message, exit 0)")
    ap.add_argument("--shapes", default=None, help=f"comma-separated, of {', '.join(SHAPES)} (default 125m,350m; tiny on the CPU)")
    ap.add_argument("--precisions", default="bf16,fp32", help="inner.precision values to time, the first is the main one (default bf16,fp32)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step for 125m and 350m (default 8)")
    ap.add_argument("--steps", type=int, default=None, help="timed inner steps, the median is reported (default 10; 3 on the CPU)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; 1 on the CPU)")
    ap.add_argument("--mem-steps", type=int, default=3, help="steps of each partial peer (default 3)")
    ap.add_argument("--H", type=int, default=30, help="inner steps per round the codec cost is compared with (default 30)")
    ap.add_argument("--codecs", default="sparseloco", help=f"comma-separated, of {', '.join(CODECS)} (default sparseloco)")
    ap.add_argument("--codec-repeats", type=int, default=2, help="encode and decode each timed this often, best kept (default 2)")
    ap.add_argument("--compile", action="store_true",
                    help="also time the first precision with the forward pass through torch.compile (a peer's --compile)")
    ap.add_argument("--parts", default="steps,memory,codecs",
                    help="comma-separated, of steps, memory, codecs: which tables to measure (default all three)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's peak dense bf16 TFLOP/s (default: by device name)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default 0: torch's default)")
    ap.add_argument("--json", type=Path, metavar="OUT", help="also write the rows and the machine line to this JSON file")
    args = ap.parse_args(argv)
    device = torch.device(args.device or "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA GPU on this machine (torch.cuda.is_available() is False): nothing measured, "
              "no figure estimated. Run it on a GPU, or `--device cpu --shapes tiny` for a smoke test.")
        return 0
    cpu = device.type == "cpu"
    args.shapes = choose_names(args.shapes or ("tiny" if cpu else "125m,350m"), SHAPES, "--shapes")
    args.codecs = choose_names(args.codecs, CODECS, "--codecs")
    args.parts = choose_names(args.parts, ("steps", "memory", "codecs"), "--parts")
    args.precisions = choose_names(args.precisions, ("bf16", "fp32", "auto"), "--precisions")
    args.steps = args.steps if args.steps is not None else (3 if cpu else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if cpu else 3)
    if min(args.steps, args.H, args.codec_repeats, args.mem_steps, args.batch) < 1 or args.warmup < 0:
        ap.error("--steps, --mem-steps, --batch, --H and --codec-repeats must be >= 1, --warmup >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    name = device_name(device)
    peak = args.peak_tflops or (peak_tflops(torch.cuda.get_device_properties(device).name) if not cpu else None)
    t0 = time.monotonic()
    when = datetime.datetime.now().isoformat(timespec="seconds")
    print(f"bench/gpu.py: {when}, {machine(device)}; peak bf16 {f'{peak:g} TFLOP/s' if peak else 'unknown (no MFU)'}", flush=True)
    steps_rows, mem_rows, codec_rows = run(args, device, peak)
    print()
    print_tables(steps_rows, mem_rows, codec_rows, args.H)
    print(f"\ntotal {time.monotonic() - t0:.0f} s")
    if args.json:
        args.json.write_text(strict_json(dict(date=when, machine=machine(device), device=name, peak_tflops=peak, H=args.H,
                                             steps=steps_rows, memory=mem_rows, codecs=codec_rows), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
