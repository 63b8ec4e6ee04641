"""The inner loop: local AdamW steps between two exchanges, and the validation pass.

Only parameters with ``requires_grad=True`` when the trainer is built enter the optimizer, so a
frozen slice (partial mode, or the layers outside a pipeline stage) holds no Adam moments and is
never touched, weight decay included. Decay applies to matrices only, not to the norm weights.

Precision (``inner.precision``): ``"bf16"`` runs the forward pass and the loss under
``torch.autocast(device_type, dtype=torch.bfloat16)``; the backward pass follows autocast's casts,
so gradients reach the parameters in fp32. The parameters (the master weights), their gradients and
the AdamW moments stay fp32 throughout, and so does every parameter a round's pseudo-gradient is
taken from: precision changes which values a peer trains to, never the round's arithmetic.
``"auto"``: bf16 on a CUDA device that runs it natively (compute capability 8.0 or later; ROCm: as it reports), fp32
elsewhere; ``"fp32"``: no autocast. ``"bf16"`` on the CPU works too (slowly; it is for tests).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from peer.training.model import Model
from protocol.spec import InnerSpec

logger = logging.getLogger("voloco.peer")

OUT_OF_MEMORY = torch.cuda.OutOfMemoryError  # torch.OutOfMemoryError from torch 2.5; never compile's fault

__all__ = ["InnerTrainer", "evaluate", "autocast_dtype"]

Device = Union[str, torch.device]


def autocast_dtype(precision: str, device: Device) -> Optional[torch.dtype]:
    """The autocast dtype of the inner steps for ``inner.precision`` on ``device``, None for fp32."""
    device = torch.device(device)
    if precision == "fp32":
        return None
    if precision == "bf16":
        return torch.bfloat16
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" and _cuda_bf16(device) else None
    raise ValueError(f"unknown inner precision {precision!r}")


def _cuda_bf16(device: torch.device) -> bool:
    """Whether ``device`` runs bf16 natively: compute capability 8.0 (Ampere) or later on NVIDIA, what
    ROCm reports on AMD. ``torch.cuda.is_bf16_supported()`` alone also says yes where bf16 is only
    emulated (a T4, a V100), where autocast to it runs slower than fp32 (tests/training/test_precision.py)."""
    if not torch.cuda.is_available():
        return False
    with torch.cuda.device(device):
        if getattr(torch.version, "hip", None):
            return bool(torch.cuda.is_bf16_supported())
        return torch.cuda.get_device_capability(device)[0] >= 8


class InnerTrainer:
    """``compile=True``: the training forward pass runs through ``torch.compile`` (fused kernels,
    far fewer launches: the 125m and 350m shapes are launch-bound on a fast GPU; bench/gpu.py
    ``--compile``). The first steps take the compile time; the parameters, their names and the
    optimizer are the same modules, so checkpoints and payloads do not change. Evaluation stays eager.
    If ``torch.compile`` itself, or the first compiled step (its forward pass, or in ``step`` its
    backward pass, which is compiled at its first call) fails (no C compiler, an unsupported platform
    or Python), the trainer says why once and goes on eagerly: ``compiled`` is then False
    (tests/training/test_inner.py)."""

    def __init__(self, model: nn.Module, inner: InnerSpec, device: Device = "cpu", compile: bool = False):
        inner.check()
        self.spec = inner
        self.device = torch.device(device)
        self.model = model.to(self.device)
        if isinstance(model, Model):  # inner.checkpoint_activations: recompute each block in the backward
            model.recompute_blocks = bool(inner.checkpoint_activations)
        self.compiled, self._forward_model = compile, self.model
        self._compile_checked = not compile  # the first compiled call either works or turns compile off
        if compile:
            try:  # some platforms refuse at once (e.g. a Python that torch's dynamo does not support yet)
                self._forward_model = torch.compile(self.model)
            except Exception as e:
                self._compile_failed(e)
        self.params: List[nn.Parameter] = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters (every one has requires_grad=False)")
        decay = [p for p in self.params if p.ndim >= 2]
        no_decay = [p for p in self.params if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": inner.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"]], lr=inner.lr_at(0), betas=(inner.beta1, inner.beta2), eps=1e-8
        )
        self.step_count = 0
        self.autocast_dtype = autocast_dtype(inner.precision, self.device)

    @property
    def precision(self) -> str:
        """What the inner steps actually run in: "bf16" or "fp32" (``"auto"`` resolved)."""
        return "fp32" if self.autocast_dtype is None else "bf16"

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        """The model's (logits, loss), under bf16 autocast when the precision says so."""
        if not self._compile_checked:
            self._compile_checked = True
            try:
                return self._forward(x, y)
            except OUT_OF_MEMORY:  # not compile's fault: eager needs more memory still
                self._compile_checked = False
                raise
            except Exception as e:  # torch.compile's errors come at the first call
                self._compile_failed(e)
        return self._forward(x, y)

    def _compile_failed(self, e: Exception) -> None:
        why = (str(e).splitlines() or [""])[0][:200]
        logger.warning(f"--compile: torch.compile failed ({type(e).__name__}: {why}); training without it")
        self.compiled, self._forward_model, self._compile_checked = False, self.model, True

    def _forward(self, x: torch.Tensor, y: torch.Tensor):
        with autocast_to(self.device.type, self.autocast_dtype):
            return self._forward_model(x, y)

    @property
    def lr(self) -> float:
        """The learning rate the next step will use."""
        return self.spec.lr_at(self.step_count)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One inner step on a batch; returns its training loss in nats (before the update)."""
        self.model.train()
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        self.optimizer.zero_grad(set_to_none=True)  # a refused step's gradients must not add to this one
        first_compiled = self.compiled and not self._compile_checked
        try:
            _, loss = self.forward(x, y)
            loss.backward()
        except Exception as e:
            if isinstance(e, OUT_OF_MEMORY) or not (first_compiled and self.compiled):
                raise
            # the compiled backward is built at its first call, after the forward pass worked
            self._compile_failed(e)
            self.optimizer.zero_grad(set_to_none=True)
            _, loss = self.forward(x, y)
            loss.backward()
        self.apply_gradients()
        return loss.float().item()

    def apply_gradients(
        self,
        before_clip: Optional[Callable[[], None]] = None,
        after_step: Optional[Callable[[], None]] = None,
        clip_groups: Optional[Sequence[Sequence[torch.nn.Parameter]]] = None,
    ) -> None:
        """The update from the gradients accumulated in the parameters (one backward, or a
        pipeline stage's micro-batches): ``before_clip()`` (e.g. project the gradients; it may raise,
        and then nothing is updated), the learning rate of the schedule, the clip of the
        trainable parameters' gradient norm to ``grad_clip``, AdamW's step, ``step_count += 1``,
        then ``after_step()`` (e.g. constrain the updated weights). Every inner step goes through here.
        ``clip_groups``: clip each group's norm on its own (the stages of a chain simulated in one
        process); default one group, the trainable parameters."""
        if before_clip is not None:
            before_clip()
        lr = self.lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for group in clip_groups if clip_groups is not None else (self.params,):
            torch.nn.utils.clip_grad_norm_(group, self.spec.grad_clip)
        self.optimizer.step()
        # the gradients are spent: freed now, they do not sit beside the next forward's activations
        # (nor beside a round's exchange buffers) — 4 bytes a parameter less at the peak
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        if after_step is not None:
            after_step()

    def state_dict(self) -> Dict[str, Any]:
        return {"step": self.step_count, "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"inner trainer state has an invalid step {step!r}")
        self.optimizer.load_state_dict(state["optimizer"])
        self.step_count = step


def autocast_to(device_type: str, dtype: Optional[torch.dtype]):
    """``torch.autocast`` to ``dtype`` on ``device_type``; no autocast (fp32) for None."""
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type, dtype=dtype)


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[Tuple[torch.Tensor, torch.Tensor]], device: Device = "cpu",
             dtype: Optional[torch.dtype] = None) -> float:
    """Mean validation loss over the batches, in nats per byte (one token is one byte). ``dtype``: the
    autocast of the role's inner steps (``InnerTrainer.autocast_dtype``; None: fp32), so a GPU peer's
    validation pass costs what its steps do. The losses add up on the device in float64, the same
    operations in the same order as a sum of ``loss.item()`` values, with one sync at the end
    (tests/training/test_inner.py::test_evaluate_follows_the_trainers_precision_and_syncs_once)."""
    was_training = model.training
    model.eval()
    device = torch.device(device)
    total, count = torch.zeros((), dtype=torch.float64, device=device), 0
    try:
        for x, y in batches:
            with autocast_to(device.type, dtype):
                _, loss = model(x.to(device), y.to(device))
            total += loss.double() * y.numel()
            count += y.numel()
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("evaluate() needs at least one batch")
    return total.item() / count
