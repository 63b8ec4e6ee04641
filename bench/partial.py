"""Partial parameter updates (arXiv 2509.22418; docs/codecs.md, "Partial parameter slices"): full
peers against partial peers that train one of S slices of the MLP hidden neurons (S = 2 and S = 4),
SparseLoCo.

Per arm and model shape, one peer's cost:

- peak training memory: each arm's probe runs in a fresh subprocess (warm up on a tiny model so the
  code and kernels are loaded, take the baseline, then build the model, freeze the tensors its part
  does not own as peer/host/runtime.py does, build InnerTrainer, run a few inner steps on random tokens)
  and reports its peak RSS minus the baseline RSS. The peak is the process's own high-water mark
  (VmHWM, reset at the baseline through /proc/self/clear_refs): getrusage(RUSAGE_SELF).ru_maxrss
  cannot be used in a child, it starts at the parent's peak (the kernel carries it across exec).
  CPU torch's allocator keeps no peak counter, so RSS it is, measured twice: with glibc's default
  malloc (freed tensors stay in its heap; what a peer process really shows) and with a fixed mmap
  threshold (every tensor is its own mapping, returned when freed: the RSS follows the live bytes,
  the closest CPU analogue of an allocator peak). On CUDA the probe also reports
  ``torch.cuda.max_memory_allocated``. The exact bytes of parameters + gradients + AdamW state are
  reported too, with the bytes autograd saves for backward (saved_tensors_hooks, deduplicated by
  storage) and the outer state a peer also holds (θ, a full fp32 copy, and SparseLoCo's
  error-feedback buffer over the owned tensors; not in the probe). The probes and the FLOP counts
  use the model's modules with torch's default init (values change neither);
- FLOPs of one inner step, forward + backward, from torch.utils.flop_counter.FlopCounterMode (CPU
  SDPA ops registered with torch's own SDPA formulas, full square, causality not discounted; the
  AdamW step, the norms, softmax and element-wise work are not counted). A frozen slice still runs
  its forward and the input-gradient matmuls; only its weight-gradient matmuls are skipped, so the
  saving is bounded by (1 − 1/S) × the share of MLP weight-gradient FLOPs, printed per shape;
- bytes sent per peer: the real encoded SparseLoCo payload of the peer's part, with the all-gather
  model of bench/compression.py (each member serves its payload to the G−1 others, G = R = 4).

Then validation loss at equal tokens from the in-process simulation of R = 4 replicas
(peer/round/simulate.py: the live peer's roles and round engine): replica r is a slice owner of slice
r % S (a full replica when S = 1) with its own model copy, the non-owned tensors frozen, its own
InnerTrainer and TrainStream shard ``replica{r}`` (the same shards in every arm); every replica
decodes every payload in the canonical order (really in round 0, checked identical; later rounds
share replica 0's decode), aggregates (each tensor averaged over the payloads that carry it),
applies to its own θ and settles; θ is asserted bit-identical across replicas every round, and
the frozen tensors are asserted untouched by the inner steps.
Every arm starts from the same function: the unsliced model built from the seed, its MLP
matrices cut into slices (the forward is checked equal). The S = 4 arm is run again with 1.5×
the rounds (its own cosine horizon) to see how much of the loss gap to the full arm closes.

    python bench/partial.py --quick          # ~70 s of CPU: small simulation model, smoke numbers
    python bench/partial.py --json out.json  # ~9 min of CPU: ~5 min on 2 idle cores (--jobs 2)
    python bench/partial.py --costs-only --checkpoint-activations  # the cost table, blocks recomputed

Probes and simulation arms run --jobs (2) at a time, each with --threads (1) torch threads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import human, machine, now, run_jobs, table  # noqa: E402
from bench.partial_probes import (  # noqa: E402  (the arm's model and its cost per inner step)
    flop_shares,
    freeze,
    fresh_model,
    make_spec,
    part_of,
    probe,
    saved_activation_bytes,
    step_flops,
)
from peer.training.data import Corpus, load_corpus, val_batches  # noqa: E402
from peer.training.model import build_model  # noqa: E402
from peer.round.simulate import simulate  # noqa: E402
from peer.outer.strategies import make_strategy  # noqa: E402
from protocol.model.partial import FULL, owned_shapes, slice_of  # noqa: E402
from protocol.spec import ModelSpec, RunSpec  # noqa: E402
from swarm.jsonout import dumps as strict_json  # noqa: E402  (NaN -> null: strict JSON)

R = 4
SLICES = (1, 2, 4)  # 1: the full arm
SHAPES = {
    # the benchmark's shape: MLP (SwiGLU, ffn 4d) holds 75 % of each block's parameters, as in real LLMs
    "bench d256 L4 f1024": dict(d_model=256, n_layers=4, n_heads=4, ffn_hidden=1024, seq_len=128),
    # the Llama ratio: ffn = 8/3 d rounded up to a multiple of 16 (688)
    "llama d256 L4 f688": dict(d_model=256, n_layers=4, n_heads=4, ffn_hidden=688, seq_len=128),
    # the demo model: RunSpec() defaults (embedding-heavy: 2 x 256 x 128 of 0.87M)
    "demo d128 L4 f352": dict(),
}
CONFIGS = {
    "full": dict(
        sim_model="bench d256 L4 f1024",
        cost_models=list(SHAPES),
        batch_size=4,  # sequences of 128 bytes per inner step
        inner_steps=10,  # H
        rounds=12,  # N = 120 inner steps per replica; the 1.5x arm runs 18 rounds
        lr=3e-3,
        warmup=10,
        val_batches=16,
        probe_steps=3,
    ),
    "quick": dict(
        sim_model="quick d64 L2 f256",
        cost_models=["bench d256 L4 f1024", "demo d128 L4 f352"],
        batch_size=4,
        inner_steps=5,
        rounds=4,
        lr=3e-3,
        warmup=5,
        val_batches=4,
        probe_steps=2,
    ),
}
QUICK_SHAPE = {"quick d64 L2 f256": dict(d_model=64, n_layers=2, n_heads=4, ffn_hidden=256, seq_len=64)}
GOALS = dict(memory=0.20, flops=0.15, loss=0.03)  # at S = 4: >= 20 % less memory, >= 15 % fewer FLOPs, loss <= +3 %


# --- helpers ---------------------------------------------------------------------------------------
def model_dict(name: str) -> Dict[str, Any]:
    return {**SHAPES, **QUICK_SHAPE}[name]


def arm_label(slices: int) -> str:
    return "full" if slices == 1 else f"partial S={slices}"


def reslice(full: Dict[str, torch.Tensor], layout) -> Dict[str, torch.Tensor]:
    """The unsliced model's tensors cut into the sliced layout (gate/up by rows, down by columns)."""
    out = {}
    for name, shape in layout.items():
        s = slice_of(name)
        if s == FULL:
            out[name] = full[name].clone()
            continue
        m = re.match(r"^(blocks\.\d+\.\w+\.\w+)\.(\d+)\.weight$", name)
        whole = full[f"{m.group(1)}.weight"]
        axis = 1 if ".mlp.down." in name or ".attn.out." in name else 0
        width = shape[axis]
        out[name] = whole.narrow(axis, s * width, width).clone()
        assert tuple(out[name].shape) == tuple(shape), (name, out[name].shape, shape)
    return out


# --- memory probe (each in a fresh process: bench/partial_probes.py) -------------------------------------
MMAP_THRESHOLD = 128 * 1024


def run_probe(model: Dict[str, Any], slices: int, batch: int, steps: int, threads: int, device: str,
              fixed_mmap: bool = False, recompute: bool = False) -> Dict[str, Any]:
    """One probe in a fresh interpreter. ``fixed_mmap``: glibc malloc with a fixed mmap threshold, so
    every tensor above 128 KiB is its own mapping, returned to the OS when freed, and the RSS peak
    follows the live bytes (glibc's default raises the threshold after the first free, up to 32 MiB,
    and keeps freed tensors in its heap)."""
    job = dict(model=model, slices=slices, batch=batch, steps=steps, threads=threads, device=device, recompute=recompute)
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if fixed_mmap:
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--probe", json.dumps(job)],
                         check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- per-peer costs -------------------------------------------------------------------------------------
def payload_size(spec: RunSpec, part: int) -> int:
    """A real encoded SparseLoCo payload of ``part`` (its size does not depend on the values)."""
    strategy = make_strategy(spec, part=part)
    gen = torch.Generator().manual_seed(0)
    return len(strategy.encode({n: torch.randn(s, generator=gen) for n, s in strategy.layout.items()}, 0)[0])


def cost_rows(shape: str, batch: int, steps: int, threads: int, device: str, jobs: int = 1,
              recompute: bool = False) -> List[Dict[str, Any]]:
    """``recompute``: every arm's blocks recomputed in the backward (inner.checkpoint_activations)."""
    cfg = model_dict(shape)
    ms = ModelSpec(**cfg)
    x = torch.randint(0, ms.vocab_size, (batch, ms.seq_len), generator=torch.Generator().manual_seed(1))
    # the probes are separate processes (each one's RSS is its own): run `jobs` at a time, CUDA ones alone
    work = [(slices, fixed) for slices in SLICES for fixed in (False, True)]
    with ThreadPoolExecutor(max_workers=1 if device.startswith("cuda") else max(1, jobs)) as pool:
        probes = dict(zip(work, pool.map(lambda w: run_probe(cfg, w[0], batch, steps, threads, device, w[1], recompute),
                                         work)))
    rows = []
    for slices in SLICES:
        spec = make_spec(cfg, slices)
        part = part_of(slices)
        owned = owned_shapes(spec, part)
        model = fresh_model(ms, slices)
        model.recompute_blocks = recompute  # FLOPs then count the recomputed forward too
        freeze(model, owned)
        flops = step_flops(model, x)
        saved = saved_activation_bytes(model, x)
        mem = dict(probes[(slices, False)], rss_peak_fixed=probes[(slices, True)]["rss_peak"])
        owned_bytes = 4 * sum(torch.Size(s).numel() for s in owned.values())
        payload = payload_size(spec, part)
        rows.append(dict(
            model=shape, slices=slices, arm=arm_label(slices), params=ms.num_params(),
            flops=flops, saved_act_bytes=saved, outer_bytes=4 * ms.num_params() + owned_bytes,
            payload_bytes=payload, sent_per_round=(R - 1) * payload, batch=batch, **mem,
            state_bytes=mem["param_bytes"] + mem["grad_bytes"] + mem["opt_bytes"],
        ))
    full = rows[0]
    for r in rows:
        r["rss_saving"] = 1 - r["rss_peak"] / full["rss_peak"]
        r["rss_fixed_saving"] = 1 - r["rss_peak_fixed"] / full["rss_peak_fixed"]
        r["state_saving"] = 1 - r["state_bytes"] / full["state_bytes"]
        r["flop_saving"] = 1 - r["flops"] / full["flops"]
        r["sent_saving"] = 1 - r["sent_per_round"] / full["sent_per_round"]
        if r["cuda_peak"] is not None:
            r["cuda_saving"] = 1 - r["cuda_peak"] / full["cuda_peak"]
    return rows


def pct(x: float) -> str:
    return f"{100 * x:+.1f}%" if x else "-"


def print_costs(rows: List[Dict[str, Any]], shares: Dict[str, Dict[str, float]]) -> None:
    cuda = any(r["cuda_peak"] is not None for r in rows)
    cols = ["model / arm", "trainable", "peak RSS", "vs full", "RSS, fixed mmap", "vs full", "p+g+AdamW", "vs full",
            "act. saved", "outer θ+EF"]
    if cuda:
        cols[2:2] = ["CUDA peak", "vs full"]
    lines = []
    for r in rows:
        line = [f"{r['model']} / {r['arm']}", f"{r['trainable'] / 1e6:.2f}M of {r['params'] / 1e6:.2f}M",
                human(r["rss_peak"]), pct(-r["rss_saving"]), human(r["rss_peak_fixed"]), pct(-r["rss_fixed_saving"]),
                human(r["state_bytes"]), pct(-r["state_saving"]), human(r["saved_act_bytes"]), human(r["outer_bytes"])]
        if cuda:
            line[2:2] = [human(r["cuda_peak"]), pct(-r.get("cuda_saving", 0))]
        lines.append(line)
    print(table(cols, lines))
    print("S = MLP slices (attention, embeddings, norms and head stay shared); each partial peer owns one slice.")
    print("peak RSS: peak resident memory of a fresh process (model + freeze + InnerTrainer + a few inner steps, random")
    print("  tokens) minus its RSS after the imports and a warm-up step; CPU torch's allocator has no peak counter.")
    print("  'peak RSS' uses glibc's defaults (freed tensors stay in its heap); 'RSS, fixed mmap' sets MALLOC_MMAP_THRESHOLD_=")
    print(f"  {MMAP_THRESHOLD} so freed tensors go back to the OS and the RSS peak follows the live bytes (closest to an allocator peak).")
    print("p+g+AdamW: exact bytes of parameters + gradients + AdamW moments. act. saved: bytes autograd saves for backward")
    print("  in one forward (parameters excluded). outer θ+EF: θ (full fp32 copy) + SparseLoCo error feedback over the owned")
    print("  tensors, which a peer also holds (not in the probe).\n")
    lines = []
    for r in rows:
        lines.append([f"{r['model']} / {r['arm']}", f"{r['flops'] / 1e9:.2f}", pct(-r["flop_saving"]),
                      human(r["payload_bytes"]), human(r["sent_per_round"]), pct(-r["sent_saving"])])
    print(table(["model / arm", "GFLOP/step", "vs full", "payload", "sent/round/peer", "vs full"], lines))
    print("GFLOP/step: one inner step's forward + backward (FlopCounterMode: matmuls and SDPA; the AdamW step is not counted).")
    print(f"payload: one real encoded SparseLoCo payload of the peer's part; sent/round/peer: (G-1) x payload, G={R}.")
    print("\nShare of a full peer's forward+backward FLOPs in MLP weight gradients (the only work a frozen slice skips; its")
    print("forward and its input-gradient matmuls still run):")
    for shape, sh in shares.items():
        bounds = ", ".join(f"S={s}: {100 * (1 - 1 / s) * sh['mlp_wgrad_share']:.1f}%" for s in SLICES[1:])
        print(f"  {shape}: {100 * sh['mlp_wgrad_share']:.1f}% -> FLOP saving = (1 - 1/S) x share: {bounds}")


# --- the simulation -----------------------------------------------------------------------------------------
def full_init(model_cfg: Dict[str, Any], seed: int = 0) -> Dict[str, torch.Tensor]:
    model = build_model(ModelSpec(**model_cfg), seed)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def simulate_partial(cfg: Dict[str, Any], slices: int, rounds: int, corpus: Corpus, val, theta_full,
                     replicas: int = R, eval_rounds=()) -> Dict[str, Any]:
    """R replicas of the peer round loop (peer/round/simulate.py: the live peer's roles and round engine),
    replica r owning slice r % S (every tensor when S = 1)."""
    H = cfg["inner_steps"]
    spec = make_spec(model_dict(cfg["sim_model"]), slices, cfg["batch_size"], H, cfg["lr"], cfg["warmup"],
                     rounds * H, cfg["val_batches"])
    parts = [part_of(slices, i) for i in range(replicas)]
    sim = simulate(spec, replicas, rounds, corpus=corpus, eval_every=0, eval_rounds=eval_rounds, verify_rounds=1,
                   init_theta=reslice(theta_full, spec.param_shapes()), parts=parts)
    curve = [(0, sim.initial_val_loss)] + [(h.round, h.val_loss) for h in sim.history if h.val_loss is not None]
    per_peer = [sum(h.payload_bytes[i] for h in sim.history) for i in range(replicas)]
    return dict(
        arm=arm_label(slices), slices=slices, rounds=rounds, inner_steps=H, tokens=sim.tokens,
        val_loss=curve[-1][1], initial_val_loss=curve[0][1], curve=curve,
        payload_bytes=sum(per_peer) / replicas / rounds,
        sent_per_peer=sum((replicas - 1) * b for b in per_peer) / replicas,
        trainable=sum(math.prod(s) for s in owned_shapes(spec, parts[0]).values()),
        wall_s=sim.wall_s,
    )


def run_sim_arm(job) -> Dict[str, Any]:
    """One simulation arm, in a worker process or in this one."""
    cfg, slices, rounds, extra, theta_full, threads = job
    torch.set_num_threads(threads)
    ms = ModelSpec(**model_dict(cfg["sim_model"]))
    corpus = load_corpus("stdlib")
    val = val_batches(corpus, ms.seq_len, cfg["batch_size"], cfg["val_batches"])
    row = simulate_partial(cfg, slices, rounds, corpus, val, theta_full, eval_rounds={cfg["rounds"]} if extra else ())
    row["extra"] = extra
    print(f"  {row['arm']}{' x1.5' if extra else ''}: val {row['val_loss']:.4f} after {rounds} rounds, "
          f"{row['wall_s']:.0f} s", flush=True)
    return row


def check_reslice(cfg: Dict[str, Any], theta_full, x) -> float:
    """The sliced models start as the same function as the unsliced one (max |logit difference|)."""
    ms = ModelSpec(**model_dict(cfg["sim_model"]))
    ref = fresh_model(ms)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(theta_full[n])
    worst = 0.0
    with torch.no_grad():
        want, _ = ref(x)
        for slices in SLICES[1:]:
            spec = make_spec(model_dict(cfg["sim_model"]), slices)
            m = fresh_model(ms, slices)
            sliced = reslice(theta_full, spec.param_shapes())
            for n, p in m.named_parameters():
                p.copy_(sliced[n])
            got, _ = m(x)
            worst = max(worst, (got - want).abs().max().item())
    assert worst < 1e-4, f"sliced model differs from the unsliced one by {worst}"
    return worst


def print_sim(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    full = rows[0]
    lines = []
    for r in rows:
        r["loss_vs_full"] = r["val_loss"] / full["val_loss"]
        r["sent_vs_full"] = r["sent_per_peer"] / full["sent_per_peer"]
        lines.append([r["arm"] + (" x1.5 tokens" if r.get("extra") else ""), str(r["rounds"]), f"{r['tokens']:,}",
                      f"{r['initial_val_loss']:.3f}", f"{r['val_loss']:.4f}", f"{100 * (r['loss_vs_full'] - 1):+.2f}%",
                      human(r["payload_bytes"]), human(r["sent_per_peer"]), f"{100 * (r['sent_vs_full'] - 1):+.1f}%",
                      f"{r['wall_s']:.0f}"])
    print(table(["arm", "rounds", "tokens (all)", "initial", "val loss", "vs full", "payload", "sent/peer", "vs full", "s"],
                lines))
    s4 = next(r for r in rows if r["slices"] == 4 and not r.get("extra"))
    s4x = next((r for r in rows if r.get("extra")), None)
    out: Dict[str, Any] = {}
    gap = s4["val_loss"] - full["val_loss"]
    out["gap_s4"] = gap
    if s4x is not None:
        gap_x = s4x["val_loss"] - full["val_loss"]
        out["gap_s4_x1.5"] = gap_x
        closed = 1 - gap_x / gap if gap > 0 else float("nan")
        out["gap_closed"] = closed
        print(f"\nloss gap S=4 - full at equal tokens: {gap:+.4f} nats ({100 * gap / full['val_loss']:+.2f}%); "
              f"S=4 with 1.5x tokens vs full at 1x: {gap_x:+.4f} nats"
              + (" (no gap to close)" if gap <= 0 else
                 f" -> {100 * closed:.0f}% of the gap closed" if closed <= 1 else
                 f" -> gap closed and overtaken: at 1.5x tokens S=4 ends {-gap_x:.4f} nats below the full arm at 1x"))
    print("val loss: nats per byte on the fixed validation batches, on θ after the last outer step. sent/peer: whole run,")
    print("all-gather model ((R-1) x own payload per round, mean over peers). Every arm: same initial function, same")
    print("data shards, same seeds; the x1.5 arm has its own cosine horizon (1.5x the inner steps); no full arm at 1.5x.")
    print("s: wall seconds of the arm (arms run --jobs at a time; shared machines inflate it).")
    return out


def goal_lines(cost: List[Dict[str, Any]], sim: List[Dict[str, Any]], bench_shape: str) -> List[str]:
    s4 = next(r for r in cost if r["model"] == bench_shape and r["slices"] == 4)
    s4sim = next(r for r in sim if r["slices"] == 4 and not r.get("extra"))
    ok = lambda b: "MET" if b else "NOT MET"  # noqa: E731
    need = GOALS["memory"]
    mem = [("CUDA peak", s4["cuda_saving"])] if "cuda_saving" in s4 else []
    mem += [("RSS with fixed mmap threshold", s4["rss_fixed_saving"]), ("RSS with glibc defaults", s4["rss_saving"])]
    return [
        f"peak memory >= {100 * need:.0f}% lower: " + "; ".join(f"{k} {100 * v:.1f}% -> {ok(v >= need)}" for k, v in mem)
        + f" (exact p+g+AdamW {100 * s4['state_saving']:.1f}%)",
        f"FLOPs/inner step >= {100 * GOALS['flops']:.0f}% fewer: {100 * s4['flop_saving']:.1f}% -> {ok(s4['flop_saving'] >= GOALS['flops'])}",
        f"val loss within {100 * GOALS['loss']:.0f}% at equal tokens (sim model): {100 * (s4sim['loss_vs_full'] - 1):+.2f}% -> "
        f"{ok(s4sim['loss_vs_full'] <= 1 + GOALS['loss'])}",
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small simulation model, few rounds (~1-2 min)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (here, in the probes, in the arms)")
    ap.add_argument("--jobs", type=int, default=2, help="probes and simulation arms run this many at a time")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="device of the memory probes")
    ap.add_argument("--mem-batch", type=int, help="sequences per step in the cost table (default: the simulation's)")
    ap.add_argument("--costs-only", action="store_true", help="print the per-peer cost table only, no simulation")
    ap.add_argument("--checkpoint-activations", action="store_true",
                    help="the cost table's inner steps recompute each block in the backward (inner.checkpoint_activations)")
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.probe:
        print(json.dumps(probe(json.loads(args.probe))))
        return 0
    torch.set_num_threads(args.threads)
    name = "quick" if args.quick else "full"
    cfg = CONFIGS[name]
    mem_batch = args.mem_batch or cfg["batch_size"]
    t0 = time.monotonic()
    print(f"bench/partial.py ({name}): {now()}, {machine()}, "
          f"{args.threads} thread(s), probes on {args.device}")
    print("shapes: " + "; ".join(f"{s}: {ModelSpec(**model_dict(s)).num_params() / 1e6:.2f}M params, d={ModelSpec(**model_dict(s)).d_model}, "
                                  f"{ModelSpec(**model_dict(s)).n_layers} layers, {ModelSpec(**model_dict(s)).n_heads} heads, "
                                  f"ffn {ModelSpec(**model_dict(s)).ffn_hidden}, seq {ModelSpec(**model_dict(s)).seq_len}"
                                  for s in dict.fromkeys(cfg["cost_models"] + [cfg["sim_model"]])))

    # 1. per-peer costs
    recompute = ", blocks recomputed in the backward" if args.checkpoint_activations else ""
    print(f"\n== one peer's cost per inner step (batch {mem_batch} sequences{recompute}), SparseLoCo, S in {SLICES[1:]} ==",
          flush=True)
    cost: List[Dict[str, Any]] = []
    shares = {}
    for shape in cfg["cost_models"]:
        cost += cost_rows(shape, mem_batch, cfg["probe_steps"], args.threads, args.device, args.jobs,
                          recompute=args.checkpoint_activations)
        shares[shape] = flop_shares(model_dict(shape), mem_batch)
    print_costs(cost, shares)
    if args.costs_only:
        if args.json:
            args.json.write_text(strict_json(dict(name=name, machine=machine(), threads=args.threads, date=now(),
                                                 recompute=args.checkpoint_activations, costs=cost, flop_shares=shares),
                                            indent=2, default=str))
        print(f"\ntotal {time.monotonic() - t0:.0f} s")
        return 0

    # 2. loss at equal tokens
    sim_ms = ModelSpec(**model_dict(cfg["sim_model"]))
    N = cfg["rounds"] * cfg["inner_steps"]
    print(f"\n== validation loss at equal tokens: {cfg['sim_model']} ({sim_ms.num_params() / 1e6:.2f}M), R={R} replicas, "
          f"H={cfg['inner_steps']}, {cfg['rounds']} rounds = {N} inner steps of {cfg['batch_size']}x{sim_ms.seq_len} per replica, "
          f"AdamW lr {cfg['lr']} (warm-up {cfg['warmup']}, cosine to the run's end), SparseLoCo defaults ==", flush=True)
    theta_full = full_init(model_dict(cfg["sim_model"]))
    x = torch.randint(0, sim_ms.vocab_size, (2, sim_ms.seq_len), generator=torch.Generator().manual_seed(3))
    diff = check_reslice(cfg, theta_full, x)
    print(f"(sliced models at init match the unsliced one: max |logit diff| {diff:.1e})", flush=True)
    arms = [(s, cfg["rounds"], False) for s in SLICES] + [(4, cfg["rounds"] * 3 // 2, True)]
    arms.sort(key=lambda a: -a[1])  # longest first: the pool finishes sooner
    work = [(cfg, slices, rounds, extra, theta_full, args.threads) for slices, rounds, extra in arms]
    sim = run_jobs(run_sim_arm, work, args.jobs)
    sim.sort(key=lambda r: (r["extra"], r["slices"]))
    print()
    gaps = print_sim(sim)

    bench_shape = "bench d256 L4 f1024"
    goals = goal_lines(cost, sim, bench_shape)
    print(f"\n== goals at S=4 ({bench_shape} costs; loss on {cfg['sim_model']}) ==")
    for line in goals:
        print("  " + line)
    print("  (one seed, one data order: no error bars; the loss and RSS rows are single measurements)")
    print(f"\ntotal {time.monotonic() - t0:.0f} s")
    if args.json:
        args.json.write_text(strict_json(dict(name=name, config=cfg, machine=machine(), threads=args.threads,
                                             date=now(),
                                             shapes={s: model_dict(s) for s in dict.fromkeys(cfg["cost_models"] + [cfg["sim_model"]])},
                                             costs=cost, flop_shares=shares, sim=sim, gaps=gaps, goals=goals),
                                        indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
