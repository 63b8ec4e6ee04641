"""Outer-loop strategies: how a replica's pseudo-gradient becomes a payload, and how a round's
payloads become the next global parameters.

All outer arithmetic runs on CPU float32, element-wise, in a canonical order (payloads sorted by
sender), so every member of a group ends with bit-identical parameters whatever its device.

Encoding is the exception, and it is local: a peer that trains on a GPU takes its pseudo-gradient
there (``pseudo_gradient``: θ_start copied to the device, an exact copy, and one IEEE subtraction,
so Δ has the same bits as on the CPU), folds in its error-feedback buffer and runs the codec's
top-k, quantization or DCT on the device; only the packed payload fields come back to the CPU.
How bit-identity is guaranteed anyway: decode, aggregate and the outer step read nothing but the
payload bytes, and run on CPU float32 with element-wise operations in a fixed order on every
member. The sender's hardware therefore affects only *which* values it sends (a top-k tie, the last
bit of a bin mean, a DCT coefficient), never how the members combine them; and what the sender
keeps as sent (``Pending.sent``, subtracted from its error buffer) is decoded from its own bytes.

- ``diloco``: dense pseudo-gradients, mean, outer SGD with Nesterov momentum (arXiv 2311.08105).
- ``sparseloco``: error feedback, chunked top-k, 2-bit values; each coordinate averaged over the
  replicas that kept it, and over no fewer than ``min_share`` of those that carry its tensor (or
  over all, ``aggregate = "mean"``), outer step with no momentum
  (arXiv 2508.15706).
- ``dct``: decoupled outer momentum; the top DCT coefficients of the momentum are synchronized,
  the residual stays local (arXiv 2510.03371, after DeMo arXiv 2411.19870).

Before ``aggregate``, the round engine checks every decoded contribution and scales a tensor past
1.5× the round's median norm down to that median (peer/outer/robust.py); ``apply`` takes the outer
step all or nothing: ``NonFiniteStep``, nothing changed, if it would leave a non-finite value in θ
or in the strategy's state.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections import Counter
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

from protocol.codecs import make_codec
from protocol.chain.stages import stage_shapes
from protocol.model.partial import FULL, balanced_steps, owned_shapes
from protocol.wire.payload import Part, decode_claimed_payload, encode_payload, payload_max_bytes, payload_part
from protocol.round.standing import weights
from protocol.spec import RunSpec
from peer.outer.robust import CLIP_MULTIPLE, PLAIN, PROJECTED, STEP_POWER, NonFiniteStep

Tensors = Dict[str, torch.Tensor]
Layout = Mapping[str, Tuple[int, ...]]


@dataclass
class Pending:
    """A round's encoded signal and what receivers decode from it, until the round settles."""

    signal: Tensors
    sent: Tensors


class OuterStrategy:
    """Base: encode a pseudo-gradient, aggregate decoded payloads, apply the outer step."""

    name = "base"
    clip_multiple = CLIP_MULTIPLE  # a tensor past this multiple of the median norm goes to the median (robust.py)
    step_power = STEP_POWER  # how the clip scales norms to each payload's steps (robust.medians_at_steps); 0: as if all were H

    def __init__(self, spec: RunSpec, layout: Optional[Layout] = None, part: Part = FULL):
        """``part``: FULL, the slice a partial peer owns (protocol/model/partial.py), or the (start, end)
        block range of a chain stage (protocol/chain/stages.py); ``layout``: an explicit layout for
        benchmarks of a model other than the spec's."""
        self.spec, self.part = spec, part
        self.run_digest = spec.digest()  # in every payload's header; the spec is frozen, its digest costs ~50 us
        self.full_layout = dict(layout) if layout is not None else spec.param_shapes()
        self._explicit = layout is not None
        self.layout = dict(self.layout_of(part))  # what this peer sends
        self.codec = make_codec(spec)
        self.lr = spec.outer.effective_lr
        self.min_agreement = spec.outer.min_agreement  # the direction check of peer/outer/robust.py
        self.fresh_agreement = spec.outer.fresh_agreement  # and a fresh full replica's share of its round's median
        self.max_contributions = spec.outer.max_contributions  # K of each part a round (protocol/round/choice.py)
        self.max_payload_bytes = payload_max_bytes(self.codec, self.full_layout)  # no part is larger

    def layout_of(self, part: Part) -> Optional[Layout]:
        """The tensors a payload of ``part`` must carry, or None if the run has no such part."""
        if self._explicit:
            return self.full_layout if part == self.part else None
        if isinstance(part, tuple):
            start, end = part
            if not 0 <= start < end <= self.spec.model.n_layers:
                return None
            return stage_shapes(self.spec, start, end)
        if part == FULL or 0 <= part < self.spec.partial.slices and self.spec.partial.slices > 1:
            return owned_shapes(self.spec, part)
        return None

    def kind_of(self, part: Part) -> int:
        """The model a contribution of ``part`` was trained on (peer/outer/robust.py: a full replica
        is not judged by chain stages): a chain stage's is θ projected onto its links' subspace (protocol/chain/subspace_constraint.py,
        chain-local), unless every replica trains that model (``chain.compress_all``) or the links
        are uncompressed; every other part's is θ."""
        chain = self.spec.chain
        projected = (isinstance(part, tuple) and not self._explicit and not chain.compress_all
                     and chain.effective_rank(self.spec.model.d_model) < self.spec.model.d_model)
        return PROJECTED if projected else PLAIN

    def to_host(self) -> None:
        """Move this strategy's local buffers (if any) to the CPU: its role gives its device back."""

    # -- what a replica sends ---------------------------------------------------------------------
    def signal(self, delta: Tensors) -> Tensors:
        """The tensors to compress this round: delta folded into the local buffers (not in place)."""
        return delta

    def encode(self, delta: Tensors, round_no: int, steps: Optional[int] = None) -> Tuple[bytes, "Pending"]:
        """The payload for this round, and what to keep locally once the round's outcome is known.
        ``steps``: the inner steps ``delta`` covers (None: H; fewer where the round closed early)."""
        signal = self.signal(delta)
        steps = self.spec.outer.inner_steps if steps is None else max(1, min(int(steps), self.spec.outer.inner_steps))
        data, sent = encode_payload(self.codec, signal, run_digest=self.run_digest, round=round_no, steps=steps,
                                    part=self.part)
        return data, Pending(signal, sent)

    def settle(self, pending: "Pending", delivered: bool) -> None:
        """Update local buffers: keep the unsent part if the payload was delivered, all of it if not."""

    def recount(self, sent: Tensors, sign: int, since: int) -> None:
        """A settled round's payload (``sent``: its tensors as receivers decode them) counts after all
        (``sign`` -1: take it out of the local buffers) or no longer (+1: put it back), ``since`` rounds
        after it was settled: what ``settle`` would have left, for a round concluded again
        (peer/outer/engine.py ``redo``; tests/outer/test_redo.py). No buffers: nothing to do."""

    def part_of(self, data: bytes, round_no: int) -> Part:
        """The part a groupmate's payload claims, its header checked and its tensors not decoded."""
        return payload_part(data, self.codec, self.layout_of, run_digest=self.run_digest, round=round_no,
                            max_bytes=self.max_payload_bytes)

    def decode(self, data: bytes, round_no: int) -> Tensors:
        """A groupmate's payload, validated against the layout of the part it claims to send."""
        return self.decode_part(data, round_no)[1]

    def decode_part(self, data: bytes, round_no: int) -> Tuple[Part, Tensors]:
        """``decode``, with the part the payload claims."""
        part, _, tensors = self.decode_claimed(data, round_no)
        return part, tensors

    def decode_claimed(self, data: bytes, round_no: int) -> Tuple[Part, int, Tensors]:
        """``decode_part``, with the inner steps the payload claims (1 to H, else ProtocolError)."""
        return decode_claimed_payload(data, self.codec, self.layout_of, run_digest=self.run_digest, round=round_no,
                                      max_bytes=self.max_payload_bytes, max_steps=self.spec.outer.inner_steps)

    # -- what every member computes identically -----------------------------------------------------
    def aggregate(self, decoded: Sequence[Tensors], established: Optional[Sequence[bool]] = None) -> Tensors:
        """Per tensor, the mean over the payloads that carry it, fresh senders bounded (``average``)."""
        return average(self.full_layout, decoded, established=established)

    def apply(self, theta: Tensors, update: Tensors, scales: Optional[Mapping[str, float]] = None) -> None:
        """The outer step on the global parameters, in place, all or nothing: every new value is
        computed and checked finite first (``NonFiniteStep``, θ and the strategy's state unchanged),
        then the same operations are done in place (the same bits as a single pass). ``scales``:
        tensor name -> a multiple of the outer lr (``step_scales``); absent: 1."""
        scales = scales or {}
        for name, step in self._steps(update, commit=False):
            if not bool(torch.isfinite(step).all()):
                raise NonFiniteStep(f"a non-finite outer step for {name}")
            if not bool(torch.isfinite(theta[name] - step * (self.lr * scales.get(name, 1.0))).all()):
                raise NonFiniteStep(f"a non-finite value in {name}")
        for name, step in self._steps(update, commit=True):
            theta[name].sub_(step * (self.lr * scales.get(name, 1.0)))

    def step_scales(self, contributions: Sequence[Tensors]) -> Dict[str, float]:
        """The outer lr's multiple per tensor for a round whose counted contributions are
        ``contributions``: sliced tensors carried by fewer of them than the most-carried tensor step
        further in a partial run (``partial.balance_steps``: protocol/model/partial.py
        ``balanced_steps``); none otherwise."""
        if self.spec.partial.slices <= 1 or not self.spec.partial.balance_steps or self._explicit:
            return {}
        return balanced_steps(Counter(n for c in contributions for n in c), self.spec.partial.slices)

    def _steps(self, update: Tensors, commit: bool) -> Iterable[Tuple[str, torch.Tensor]]:
        """(name, the step θ[name] moves by, before the outer lr); ``commit``: also update the
        strategy's own state (outer momentum), else leave it as it is."""
        return update.items()

    # -- state ------------------------------------------------------------------------------------
    def shared_state(self) -> Tensors:
        """State every replica holds identically (downloaded by late joiners)."""
        return {}

    def load_shared_state(self, state: Mapping[str, torch.Tensor]) -> None:
        pass

    def local_state(self) -> Tensors:
        """This replica's own buffers (checkpointed, never shared)."""
        return {}

    def load_local_state(self, state: Mapping[str, torch.Tensor]) -> None:
        pass

    def forget_local_state(self) -> None:
        """Zero this replica's own buffers: they describe a θ lineage the replica has left."""


class DiLoCo(OuterStrategy):
    name = "diloco"

    def __init__(self, spec: RunSpec, layout: Optional[Layout] = None, part: Part = FULL):
        super().__init__(spec, layout, part)
        # the outer momentum is shared state: it covers every tensor, owned by this peer or not
        self.momentum = {n: torch.zeros(s) for n, s in self.full_layout.items()}
        # a round's pseudo-gradient that did not count (not chosen, no group, refused): sent again,
        # added to the next one; empty (no memory) while every round counts
        self.carry: Tensors = {}

    def signal(self, delta: Tensors) -> Tensors:
        if not self.carry:
            return delta
        return {n: self.carry[n].to(d.device) + d for n, d in delta.items()}

    def settle(self, pending: "Pending", delivered: bool) -> None:
        self.carry = {} if delivered else dict(pending.signal)

    def recount(self, sent: Tensors, sign: int, since: int) -> None:
        """The carry has no decay: the payload moves into or out of it whole (what the codec dropped of
        the signal, if anything, is not recovered)."""
        for n, t in sent.items():
            have = self.carry.get(n)
            t = t.to(have.device) if have is not None else t
            self.carry[n] = t * sign if have is None else have + t * sign

    def local_state(self) -> Tensors:
        return {f"carry.{n}": t.cpu() for n, t in self.carry.items()}

    def load_local_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """The carry of a checkpoint; none (a checkpoint made before it existed, or with nothing carried): none."""
        if not any(k.startswith("carry.") for k in state):
            self.carry = {}
            return
        carry = {n: torch.zeros(s) for n, s in self.layout.items()}
        _load_into(carry, state, "carry.")
        self.carry = carry

    def forget_local_state(self) -> None:
        self.carry = {}

    def _steps(self, update: Tensors, commit: bool) -> Iterable[Tuple[str, torch.Tensor]]:
        mu, nesterov = self.spec.outer.momentum, self.spec.outer.nesterov
        for name, g in update.items():
            buf = self.momentum[name] * mu + g  # the same two operations as buf.mul_(mu).add_(g)
            if not bool(torch.isfinite(buf).all()):
                raise NonFiniteStep(f"a non-finite outer momentum for {name}")
            if commit:
                self.momentum[name].copy_(buf)
            yield name, (g + buf * mu if nesterov else buf)

    def shared_state(self) -> Tensors:
        return {f"momentum.{n}": t for n, t in self.momentum.items()}

    def load_shared_state(self, state: Mapping[str, torch.Tensor]) -> None:
        _load_into(self.momentum, state, "momentum.")


class _ResidualStrategy(OuterStrategy):
    """A local buffer accumulates the pseudo-gradient; what is sent is subtracted from it."""

    buffer_name = "buffer"

    def __init__(self, spec: RunSpec, layout: Optional[Layout], part: Part, decay: float):
        super().__init__(spec, layout, part)
        self.decay = decay
        self.buffer = {n: torch.zeros(s) for n, s in self.layout.items()}

    def signal(self, delta: Tensors) -> Tensors:
        """On delta's device: the buffer moves there on first use and stays (a GPU peer's residual
        lives on its GPU; it is local state, never sent as such)."""
        out = {}
        for n, d in delta.items():
            if self.buffer[n].device != d.device:
                self.buffer[n] = self.buffer[n].to(d.device)
            out[n] = self.buffer[n] * self.decay + d
        return out

    def settle(self, pending: "Pending", delivered: bool) -> None:
        for name, s in pending.signal.items():
            self.buffer[name] = s - pending.sent[name].to(s.device) if delivered else s

    def recount(self, sent: Tensors, sign: int, since: int) -> None:
        """Decayed once per round carried since, as the buffer it would have stayed in."""
        scale = sign * self.decay ** since
        for name, t in sent.items():
            if name in self.buffer:
                self.buffer[name] = self.buffer[name] + t.to(self.buffer[name].device) * scale

    def local_state(self) -> Tensors:
        """CPU tensors (copies when the buffers live on a GPU), so checkpoints load anywhere."""
        return {f"{self.buffer_name}.{n}": t.cpu() for n, t in self.buffer.items()}

    def to_host(self) -> None:
        self.buffer = {n: t.cpu() for n, t in self.buffer.items()}  # signal() moves them back on use

    def load_local_state(self, state: Mapping[str, torch.Tensor]) -> None:
        _load_into(self.buffer, state, f"{self.buffer_name}.")

    def forget_local_state(self) -> None:
        for t in self.buffer.values():
            t.zero_()


class SparseLoCo(_ResidualStrategy):
    name = "sparseloco"
    buffer_name = "error"

    def __init__(self, spec: RunSpec, layout: Optional[Layout] = None, part: Part = FULL):
        super().__init__(spec, layout, part, decay=spec.outer.sparseloco.ef_beta)

    def aggregate(self, decoded: Sequence[Tensors], established: Optional[Sequence[bool]] = None) -> Tensors:
        sparse = self.spec.outer.sparseloco
        return average(self.full_layout, decoded, over_choosers=sparse.aggregate == "chosen",
                       established=established, min_share=sparse.min_share)


def average(layout: Layout, decoded: Sequence[Tensors], over_choosers: bool = False,
            established: Optional[Sequence[bool]] = None, min_share: float = 0.0) -> Tensors:
    """Per tensor, the mean over the payloads that carry it, summed in the given (canonical)
    order, element-wise: bit-identical on every member. With partial updates or chain stages each
    coordinate is averaged over its owners only; a tensor nobody sent gets no update.

    ``over_choosers`` (SparseLoCo's variant): each coordinate averaged over the payloads that kept
    it, i.e. whose decoded value is non-zero (a kept entry quantized to exactly 0.0 adds nothing to
    the sum either); a coordinate nobody kept stays 0. ``min_share`` (``outer.sparseloco.min_share``)
    bounds its step as the payloads grow: where that share of the R payloads that carry a tensor is
    more than one, each of its coordinates is divided by no fewer than that share of them (of their
    total weight W, with ``established``), so a coordinate one of them kept moves θ by at most
    1 / (min_share R) of its value (w / (min_share W)), not all of it (tests/outer/test_aggregate.py).

    ``established`` (one flag per payload: its sender has standing): per tensor, over the payloads
    that carry it, protocol/round/standing.weights bounds what fresh senders weigh together; where it
    weighs any below 1 the mean is sum(w x) / sum(w) over the same payloads, in float32, in the given
    order. Where every weight is 1 (or ``established`` is None) it is the unweighted code, bit for bit.
    """
    if not decoded:
        raise ValueError("aggregate of no payloads")
    if established is not None and len(established) != len(decoded):
        raise ValueError(f"{len(established)} flags for {len(decoded)} payloads")
    out: Tensors = {}
    for name in layout:
        carriers = [i for i, d in enumerate(decoded) if name in d]
        if not carriers:
            continue
        parts = [decoded[i][name] for i in carriers]
        floored = min_share * len(parts) > 1.0  # a floor of at most one payload is none
        w = weights([established[i] for i in carriers]) if established is not None else None
        if w is not None and any(x != 1.0 for x in w):
            out[name] = _weighted_mean(parts, w, over_choosers, min_share if floored else 0.0)
            continue
        acc = parts[0].clone()
        for t in parts[1:]:
            acc.add_(t)
        if over_choosers:
            # a count of the payloads that kept each coordinate, in the narrowest integer type that
            # holds it; only a coordinate kept by two or more is divided (x / 1 is x, bit for bit), a
            # few percent of them for sparse payloads; small counts convert to float32 exactly
            kept = (parts[0] != 0).to(torch.uint8 if len(parts) < 256 else torch.int32)
            for t in parts[1:]:
                kept.add_(t != 0)
            if floored:
                out[name] = acc.div_(kept.to(torch.float32).clamp_(min=min_share * len(parts)))
                continue
            shared = kept > 1
            acc[shared] = acc[shared] / kept[shared].to(torch.float32)
            out[name] = acc
        else:
            out[name] = acc.div_(len(parts))
    return out


def _weighted_mean(parts: Sequence[torch.Tensor], w: Sequence[float], over_choosers: bool,
                   min_share: float = 0.0) -> torch.Tensor:
    """sum(w x) / sum(w) over ``parts`` (per coordinate over those that kept it, ``over_choosers``,
    and over no less than ``min_share`` of their total weight: at ``min_share`` 1 the weighted mean
    bit for bit; 0, the caller's "no floor", divides by the choosers' weight alone)."""
    acc = torch.zeros_like(parts[0])
    den = torch.zeros_like(parts[0]) if over_choosers else torch.zeros((), dtype=torch.float32)
    total = torch.zeros((), dtype=torch.float32)
    for t, x in zip(parts, w):
        scale = torch.tensor(x, dtype=torch.float32)
        acc.add_(t * scale)
        den.add_((t != 0).to(torch.float32) * scale if over_choosers else scale)
        total.add_(scale)
    if over_choosers:
        kept = den > 0
        acc[kept] = acc[kept] / torch.maximum(den[kept], total * min_share)  # den > 0: a floor of 0 is none
        return acc
    return acc.div_(den)


class DCTMomentum(_ResidualStrategy):
    name = "dct"
    buffer_name = "momentum"

    def __init__(self, spec: RunSpec, layout: Optional[Layout] = None, part: Part = FULL):
        super().__init__(spec, layout, part, decay=spec.outer.dct.beta)


STRATEGIES = {"diloco": DiLoCo, "sparseloco": SparseLoCo, "dct": DCTMomentum}


def make_strategy(spec: RunSpec, layout: Optional[Layout] = None, part: Part = FULL) -> OuterStrategy:
    return STRATEGIES[spec.outer.strategy](spec, layout, part)


def pseudo_gradient(
    theta_start: Tensors, theta_now: Mapping[str, torch.Tensor], names: Optional[Iterable[str]] = None
) -> Tensors:
    """Δ = θ_start − θ_now in float32 on θ_now's device (a CUDA peer encodes on its GPU), for
    ``names`` (default: every tensor of θ_start). θ_start is copied there exactly and the
    subtraction is one IEEE operation per element, so Δ has the same bits on any device."""
    out = {}
    for n in names or theta_start:
        now = theta_now[n].detach()
        device = now.device if now.device.type == "cuda" else torch.device("cpu")
        out[n] = theta_start[n].to(device, torch.float32) - now.to(device, torch.float32)
    return out


def _load_into(dst: Tensors, state: Mapping[str, torch.Tensor], prefix: str) -> None:
    """Copy ``state`` into ``dst``, all or nothing: every tensor is checked before any is copied."""
    for name, t in dst.items():
        src = state.get(prefix + name)
        if src is None or not torch.is_tensor(src) or tuple(src.shape) != tuple(t.shape):
            raise ValueError(f"state has no tensor {prefix + name} of shape {tuple(t.shape)}")
        if not torch.isfinite(src).all():
            raise ValueError(f"state tensor {prefix + name} has non-finite values")
    for name, t in dst.items():
        t.copy_(state[prefix + name])


def canonical_order(payloads: Mapping[str, bytes]) -> List[str]:
    """The order every member aggregates in: by sender id."""
    return sorted(payloads)
