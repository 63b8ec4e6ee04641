"""One arm of the partial-updates benchmark (bench/partial.py) and what one inner step costs it.

- the arm: its run spec (``make_spec``), the part replica r owns (``part_of``), the model with
  torch's default init (``fresh_model``) and the freezing peer/host/runtime.py does (``freeze``);
- FLOPs of one forward + backward (``step_flops``, FlopCounterMode with CPU SDPA counted by
  torch's own formulas), the bytes autograd saves for backward (``saved_activation_bytes``) and
  the MLP weight-gradient share of a full peer's step (``flop_shares``);
- the peak-memory probe (``probe``), meant to run alone in a fresh process (bench/partial.py
  ``--probe``): warm up, take the baseline RSS, train a few inner steps, report the peak above it.
"""

from __future__ import annotations

import gc
import resource
from typing import Any, Dict, Optional

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from bench.common import proc_status_kib, reset_peak_rss as common_reset_peak_rss
from peer.training.inner import InnerTrainer
from peer.training.model import Model
from protocol.model.partial import FULL, owned_shapes
from protocol.spec import ModelSpec, RunSpec

aten = torch.ops.aten


# --- the arm -----------------------------------------------------------------------------------------
def make_spec(model: Dict[str, Any], slices: int, batch_size: int = 16, inner_steps: int = 10, lr: float = 3e-3,
              warmup: int = 10, total_steps: int = 100, val_batches: int = 8) -> RunSpec:
    return RunSpec(run_id="bench-partial", seed=0, model=ModelSpec(**model)).replace(
        data={"batch_size": batch_size, "val_batches": val_batches},
        inner={"lr": lr, "warmup_steps": warmup, "total_steps": max(total_steps, warmup + 1)},
        outer={"strategy": "sparseloco", "inner_steps": inner_steps},
        partial={"slices": slices},
    )


def part_of(slices: int, replica: int = 0) -> int:
    return FULL if slices == 1 else replica % slices


def freeze(model: torch.nn.Module, owned) -> None:
    """What peer/host/runtime.py does before building InnerTrainer."""
    for name, p in model.named_parameters():
        p.requires_grad_(name in owned)


# --- FLOPs -------------------------------------------------------------------------------------------
def _sdpa_fwd(q, k, v, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(q, k, v)


def _sdpa_bwd(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, q, k, v)


# CPU SDPA is not in torch's flop registry; count it with torch's formulas for the GPU kernels
CUSTOM_FLOPS = {
    op: f
    for name, f in (("_scaled_dot_product_flash_attention_for_cpu", _sdpa_fwd),
                    ("_scaled_dot_product_flash_attention_for_cpu_backward", _sdpa_bwd))
    if (op := getattr(aten, name, None)) is not None
}


def step_flops(model: torch.nn.Module, x: torch.Tensor) -> int:
    """FLOPs of one forward + backward (what one inner step computes, the optimizer aside)."""
    model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False, custom_mapping=CUSTOM_FLOPS) as fc:
        _, loss = model(x, x)
        loss.backward()
    model.zero_grad(set_to_none=True)
    return fc.get_total_flops()


def saved_activation_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd saves for backward in one forward (parameters excluded, storages counted once)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: Dict[int, int] = {}  # data pointer -> bytes, of every storage a saved tensor views

    def pack(t):
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(x, x)
    del loss
    return sum(n for ptr, n in storages.items() if ptr not in params)


def flop_shares(model_cfg: Dict[str, Any], batch: int) -> Dict[str, float]:
    """Of a full peer's step: the MLP weight-gradient share (full minus every MLP matrix frozen)."""
    ms = ModelSpec(**model_cfg)
    model = fresh_model(ms)
    x = torch.randint(0, ms.vocab_size, (batch, ms.seq_len), generator=torch.Generator().manual_seed(1))
    total = step_flops(model, x)
    freeze(model, {n for n, _ in model.named_parameters() if ".mlp." not in n})
    no_mlp_wgrad = step_flops(model, x)
    return dict(total=total, mlp_wgrad=total - no_mlp_wgrad, mlp_wgrad_share=(total - no_mlp_wgrad) / total)

# --- memory probe (runs in a fresh process per arm) ----------------------------------------------------
def _status_kib(field: str) -> Optional[int]:
    try:
        return proc_status_kib("self", field)
    except OSError:
        return None


def reset_peak_rss() -> int:
    """Start a fresh high-water mark at the current RSS (Linux: clear_refs 5); returns the baseline bytes.

    getrusage(RUSAGE_SELF).ru_maxrss cannot be used alone in a child: across exec the kernel carries
    the previous image's peak into it (the parent's when subprocess vforks), so a child's ru_maxrss
    starts at the parent's peak. VmHWM is the child's own mm's high-water mark and can be reset."""
    try:
        common_reset_peak_rss()
        return _status_kib("VmRSS") * 1024
    except (OSError, TypeError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_rss() -> int:
    hwm = _status_kib("VmHWM")
    return hwm * 1024 if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def fresh_model(ms: ModelSpec, slices: int = 1) -> Model:
    """The model's modules with torch's default init (values do not matter for memory or FLOPs;
    build_model's exact-normal init takes seconds and its scratch would show in the peak)."""
    with torch.random.fork_rng(devices=[]):
        return Model(ms, slices, 1)


def warm_up(device) -> None:
    """One inner step of a tiny model: every module and kernel the probe uses gets loaded."""
    tiny = ModelSpec(d_model=32, n_layers=1, n_heads=2, ffn_hidden=64, seq_len=16)
    spec = make_spec(tiny.model_dump(), 2)
    model = fresh_model(tiny, 2).to(device)
    freeze(model, owned_shapes(spec, 0))
    trainer = InnerTrainer(model, spec.inner, device)
    x = torch.randint(0, tiny.vocab_size, (2, tiny.seq_len))
    for _ in range(2):
        trainer.step(x, x)
    del trainer, model
    gc.collect()


def probe(job: Dict[str, Any]) -> Dict[str, Any]:
    torch.set_num_threads(job["threads"])
    device = torch.device(job["device"])
    cuda = device.type == "cuda"
    warm_up(device)  # load the code and kernels (AdamW alone imports ~70 MB of modules) before the baseline
    if cuda:
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats()
    base = reset_peak_rss()
    slices = job["slices"]
    spec = make_spec(job["model"], slices)
    model = fresh_model(spec.model, slices).to(device)
    owned = owned_shapes(spec, part_of(slices))
    freeze(model, owned)
    # recompute: inner.checkpoint_activations (each block recomputed in the backward)
    trainer = InnerTrainer(model, spec.replace(inner={"checkpoint_activations": bool(job.get("recompute"))}).inner, device)
    gen = torch.Generator().manual_seed(2)
    for _ in range(job["steps"]):
        x = torch.randint(0, spec.model.vocab_size, (job["batch"], spec.model.seq_len + 1), generator=gen)
        trainer.step(x[:, :-1], x[:, 1:])
    if cuda:
        torch.cuda.synchronize()
    peak = peak_rss() - base
    params = list(model.parameters())
    opt = sum(t.numel() * t.element_size() for st in trainer.optimizer.state.values() for t in st.values()
              if isinstance(t, torch.Tensor))
    return dict(
        rss_peak=peak,
        cuda_peak=torch.cuda.max_memory_allocated() if cuda else None,
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        # one gradient a trainable parameter, of its dtype, held from the backward to AdamW's step
        # (the trainer frees them after each step, so they are counted, not read)
        grad_bytes=sum(p.numel() * p.element_size() for p in params if p.requires_grad),
        opt_bytes=opt,
        trainable=sum(p.numel() for p in params if p.requires_grad),
    )
