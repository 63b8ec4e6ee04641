"""The memory estimate (protocol/model/capacity.py) against the real peak of a peer's inner steps, on the CPU.

    python bench/memory_peak.py [--shapes demo,d256-seq256,d512-state-bound,125m-b1] [--json OUT]

For each shape, a fresh process builds the model, AdamW, the θ snapshot and a strategy buffer (a
peer's steady state), runs two inner steps (forward, backward, update) and reports:

- live peak: the most bytes malloc had handed out at once (glibc's mallinfo2, sampled after every
  aten op, backward and AdamW included), less what was live before the model was built;
- resident peak: the peak resident size it added (VmHWM, reset first), allocator fragmentation and
  library buffers (MKL's GEMM packing buffer among them) included;
- the estimate, its terms, and the ratios a peer relies on: estimate / live >= 1 (the decision is
  safe), resident / (estimate / HEADROOM) <= 1 (what the estimate leaves out fits the headroom a peer
  keeps: it takes a full replica when the estimate is below HEADROOM of its free memory).

Each shape is also measured with the MLP's ``silu(gate) * up`` as plain autograd ops (the ``autograd``
arm: they keep ``silu(gate)`` as well) against the model's ``swiglu``, which keeps only ``gate`` and
``up`` (peer/training/model.py): the live peak of both, and the ratio.

Needs Linux (/proc/self/clear_refs) and glibc. tests/protocol/test_presets.py asserts the bounds on these shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import exit_on_sigterm, machine, now, table  # noqa: E402
from peer.training.resources import HEADROOM  # noqa: E402
from swarm.jsonout import dumps as strict_json  # noqa: E402

SHAPES = {
    "demo": {"model": {"preset": "demo"}},  # activations dominate: 16 sequences of 128 bytes
    "d256-seq256": {"model": {"d_model": 256, "n_layers": 2, "n_heads": 8, "ffn_hidden": 704, "seq_len": 256},
                    "data": {"batch_size": 8}},
    # the parameters' state dominates: 2 x 64 tokens a step, so AdamW's step is the peak
    "d512-state-bound": {"model": {"d_model": 512, "n_layers": 2, "n_heads": 8, "ffn_hidden": 1408, "seq_len": 64},
                         "data": {"batch_size": 2}},
    # the demo model with its blocks recomputed in the backward (inner.checkpoint_activations)
    "demo-recompute": {"model": {"preset": "demo"}, "inner": {"checkpoint_activations": True}},
}
# larger: not in the default set (1-2 minutes and ~3 GB each arm), nor asserted by the tests
EXTRA_SHAPES = {
    "125m-b1": {"model": {"preset": "125m"}, "data": {"batch_size": 1}},
    "125m-b1-recompute": {"model": {"preset": "125m"}, "data": {"batch_size": 1},
                          "inner": {"checkpoint_activations": True}},
}
ARMS = ("swiglu", "autograd")  # the model as it is; its MLP product as plain autograd ops (the baseline)

MEASURE = r"""
import ctypes, gc, json, sys
import torch
torch.set_num_threads(1)
from torch.utils._python_dispatch import TorchDispatchMode
from peer.training.inner import InnerTrainer
from peer.training.model import build_model
from protocol.model.capacity import estimate
from protocol.spec import RunSpec

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2

def live():  # bytes malloc has handed out and not had back: heap chunks in use + mmapped chunks
    m = libc.mallinfo2()
    return m.uordblks + m.hblkhd

class LivePeak(TorchDispatchMode):  # samples live() after every aten op, backward and AdamW included
    peak = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, live())
        return out

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

def peak_rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

def run(spec):
    model = build_model(spec.model, 0)
    # a peer's steady state holds θ at the round's start and one strategy buffer (the 8 P term)
    held = [p.detach().clone() for p in model.parameters()] + [torch.ones_like(p) for p in model.parameters()]
    trainer = InnerTrainer(model, spec.inner)
    g = torch.Generator().manual_seed(0)
    shape = (spec.data.batch_size, spec.model.seq_len)
    x = torch.randint(0, spec.model.vocab_size, shape, generator=g)
    y = torch.randint(0, spec.model.vocab_size, shape, generator=g)
    trainer.step(x, y)  # the first step allocates AdamW's moments; the second is the steady state
    trainer.step(x, y)
    return model, trainer, held

tiny = RunSpec.from_dict({"model": {"d_model": 8, "n_layers": 1, "n_heads": 2, "ffn_hidden": 8, "seq_len": 8},
                          "data": {"batch_size": 1}})
if sys.argv[2:] == ["autograd"]:  # the baseline arm: autograd's silu and product, which keep silu(gate) too
    import peer.training.model as model_module
    model_module.swiglu = lambda gate, up: torch.nn.functional.silu(gate) * up
run(tiny)  # loads kernels and thread pools, which the estimate does not count
gc.collect()
spec = RunSpec.from_dict(json.loads(sys.argv[1]))
base_rss, base_live = rss(), live()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the current resident size
with LivePeak() as probe:
    kept = run(spec)
e = estimate(spec, spec.model.n_layers, embed=True, head=True, recompute=spec.inner.checkpoint_activations)
print(json.dumps({"live": probe.peak - base_live, "rss": peak_rss() - base_rss, "estimate": e.total,
                  "state": e.state + e.outer + e.step, "activations": e.activations}))
"""


def measure(spec_dict: dict, timeout: float = 300, arm: str = "swiglu") -> dict:
    """One shape in a fresh process, one torch thread: its live and resident peaks and the estimate.
    ``arm``: one of ``ARMS``."""
    if arm not in ARMS:
        raise ValueError(f"arm {arm!r} is not one of {ARMS}")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", MEASURE, json.dumps(spec_dict), arm], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the measuring process failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def can_measure() -> bool:
    """Whether this machine can reset the peak resident size (Linux's /proc/self/clear_refs)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help=f"comma-separated shapes to measure, of: {', '.join({**SHAPES, **EXTRA_SHAPES})} "
                         f"(default: {', '.join(SHAPES)})")
    ap.add_argument("--no-baseline", action="store_true",
                    help="measure the model as it is only, not also the autograd baseline of its MLP product")
    ap.add_argument("--json", type=Path, metavar="OUT", help="also write the rows as JSON to OUT")
    args = ap.parse_args(argv)
    names = [s for s in args.shapes.split(",") if s]
    shapes = {**SHAPES, **EXTRA_SHAPES}
    unknown = [s for s in names if s not in shapes]
    if unknown or not names:
        ap.error(f"--shapes: unknown {unknown or 'none given'}; known: {', '.join(shapes)}")
    if not can_measure():
        ap.error("needs Linux's /proc/self/clear_refs to reset the peak resident size")
    exit_on_sigterm()
    print(f"bench/memory_peak.py: {now()}, {machine()}", flush=True)
    rows = []
    for name in names:
        m = measure(shapes[name], timeout=900)
        base = None if args.no_baseline else measure(shapes[name], timeout=900, arm="autograd")
        rows.append(dict(shape=name, **m, estimate_over_live=m["estimate"] / m["live"],
                         resident_over_allowed=m["rss"] / (m["estimate"] / HEADROOM),
                         baseline_live=None if base is None else base["live"],
                         baseline_rss=None if base is None else base["rss"]))
        print(f"  {name}: live peak {m['live'] / 1e6:.1f} MB"
              + ("" if base is None else f" (autograd's product: {base['live'] / 1e6:.1f} MB)")
              + f", estimate {m['estimate'] / 1e6:.1f} MB", flush=True)
    cols = ["shape", "parameters' state (28 P)", "activations", "estimate", "live peak", "estimate / live",
            "resident peak", "resident / (estimate / headroom)", "live peak, autograd product", "live / that"]
    mb = lambda n: "-" if n is None else f"{n / 1e6:.1f} MB"  # noqa: E731
    lines = [[r["shape"], mb(r["state"]), mb(r["activations"]), mb(r["estimate"]), mb(r["live"]),
              f"{r['estimate_over_live']:.2f}", mb(r["rss"]),
              f"{r['resident_over_allowed']:.2f}", mb(r["baseline_live"]),
              "-" if r["baseline_live"] is None else f"{r['live'] / r['baseline_live']:.3f}"] for r in rows]
    print("\n" + table(cols, lines))
    if args.json:
        doc = dict(date=now(), machine=machine(), headroom=HEADROOM, rows=rows)
        args.json.write_text(strict_json(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
