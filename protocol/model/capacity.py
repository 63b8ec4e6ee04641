"""How much memory training a model, or a pipeline stage of it, takes: a conservative estimate.

Everything is fp32 (4 bytes a value), as peer/training/model.py trains; mixed precision only lowers the
real figure. For a stage that owns ``P`` parameters and ``L`` blocks and keeps the activations of
``n = micro_batch * seq_len`` tokens alive at once::

    bytes = 16 P                      weights, grads, AdamW exp_avg and exp_avg_sq
          +  8 P                      outer state: θ at the round's start + the strategy's buffer
                                      (SparseLoCo error feedback, DCT or DiLoCo momentum)
          +  4 P                      AdamW's step: the foreach implementation (CUDA's default)
                                      holds sqrt(exp_avg_sq) of every tensor of a group at once
          +  4 n (L A_block + [head] A_head + [embed] 2)     activations kept for backward
                                      (L d + 2 A_block with inner.checkpoint_activations: each
                                      block keeps its input, one block's are recomputed at a time)

The step's transient and the activations are never alive together (peer/training/inner.py frees the
gradients after each step, and backward frees the activations before the step), so their sum is
conservative by the smaller of the two; it is kept a sum so that a stage's bytes grow by exactly
``layer_bytes`` a block (protocol/chain/formation.py relies on that). For a state-bound shape
(few tokens a step) the step is the peak: on torch 2.13 CPU, d 512, 2 blocks, 2 x 64 tokens, the
live peak was 24 P + 15.4 MB at AdamW's step (9.2 MB of it the step's temporaries, 6.2 MB MKL's
cached GEMM packing buffer), 0.6 MB under an estimate without this term.

with, in fp32 values per token (d = d_model, f = ffn_hidden, H = n_heads, T = seq_len,
V = vocab_size)::

    A_block = 16 d + 4 f + H T + 2 H
        two RMSNorms save input, normalised input and output (6 d); qkv output (3 d) and the two
        rotary products of q and k (4 d); attention output and its re-laid-out copy (2 d); SwiGLU
        gate, up and their product (3 f: peer/training/model.py's swiglu recomputes silu(gate) in
        the backward) and an f margin (autograd's product kept silu(gate) too); a 1 d margin; H T: the softmax
        probabilities the math SDPA backend keeps (flash and memory-efficient backends keep
        only the 2 H log-sum-exps instead). Measured on torch 2.13 CPU with saved-tensor hooks:
        12 d + 3 f + H + hd (the rotary tables), so the margin is >= 4 d + f + H T; it also covers
        the short-lived gradient buffers of backward, which reuses the memory it frees as it goes.
    A_head = 3 d + 4 V
        the final norm (3 d), the fp32 logits and log-softmax cross-entropy keeps (2 V), the
        logit gradient its backward allocates (V), and a V margin: the head's peak (measured
        3 d + 3 V with a vocabulary of 50 000), not only what it saves.
    embed: 2 (the token ids and targets, int64); its output is the first block's input.

With ``inner.checkpoint_activations`` a block's activations live only while it runs again in the
backward, so the term is L d + 2 A_block: one block's, and as much again for its backward's
buffers and the holes the allocator keeps beside them. Without that second A_block the demo shape
(batch 16 x 128) measured a live peak of 56.9 MB under an estimate of 72.7 MB, but a resident peak of
106.7 MB, above the 90.9 MB that estimate leaves room for (glibc keeps freed chunks resident;
bench/memory_peak.py, shape demo-recompute).

Checked against the peak resident memory of a real forward+backward+AdamW step on CPU (the
weights, grads and moments allocated beforehand): d 128..512, 1..4 blocks, V 256 and 50 000 —
the measured activation peak was 61-80 % of the estimate's activation term.
Not counted: the framework itself (CUDA context, allocator fragmentation, the Python process),
and the exchange's transient buffers (a round's pseudo-gradient and decoded payloads), which
live after the activations are freed. ``capacity_bytes`` a peer announces is memory it can give
to the tensors above, after its own overhead.

A stage holding the first block also holds the embedding; one holding the last block also holds
the final norm and the head. A stage with a neighbour (any stage of a chain of two or more) also
holds the activation codec's state (protocol/chain/activations.py): the snapshot ``T`` of the
embedding (V d) and the basis ``U`` (d k, counted as d d), fp32: ``link_state_bytes``. ``micro_batch`` is the number of sequences whose activations a stage
holds at once; by default the run's ``data.batch_size`` (a full-batch step, or a GPipe schedule
with every micro-batch of the step in flight), which is the conservative choice.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from protocol.spec import RunSpec

FP32 = 4
STATE_BYTES_PER_PARAM = 16  # weights + grads + 2 AdamW moments, fp32
OUTER_BYTES_PER_PARAM = 8  # θ at the round's start + one strategy buffer, fp32
STEP_BYTES_PER_PARAM = 4  # AdamW's transient sqrt(exp_avg_sq), fp32 (see the module doc)


def block_shapes(spec: RunSpec, block: int) -> Dict[str, Tuple[int, ...]]:
    """The tensors of one block, in the run's parameter order (sliced under partial updates)."""
    if not 0 <= block < spec.model.n_layers:
        return {}
    return {n: t.shape for n, t in spec.layout().items() if t.block == block}


@functools.lru_cache(maxsize=64)
def _param_counts(spec: RunSpec) -> Tuple[int, int, int]:
    """Parameters of the embedding, of one block, and of the final norm and head."""
    layout = spec.layout().values()
    embed = sum(t.numel for t in layout if t.block < 0)
    block = sum(t.numel for t in layout if t.block == 0)
    head = sum(t.numel for t in layout if t.block >= spec.model.n_layers)
    return embed, block, head


def block_params(spec: RunSpec) -> int:
    return _param_counts(spec)[1]


def embed_params(spec: RunSpec) -> int:
    return _param_counts(spec)[0]


def head_params(spec: RunSpec) -> int:
    """The final norm and the output head."""
    return _param_counts(spec)[2]


def block_activation_values(spec: RunSpec) -> int:
    """A_block: fp32 values per token one block keeps for its backward (see the module doc)."""
    m = spec.model
    return 16 * m.d_model + 4 * m.ffn_hidden + m.n_heads * m.seq_len + 2 * m.n_heads


def head_activation_values(spec: RunSpec) -> int:
    """A_head: fp32 values per token of the final norm, the logits and the loss."""
    return 3 * spec.model.d_model + 4 * spec.model.vocab_size


def _tokens(spec: RunSpec, micro_batch: Optional[int]) -> int:
    mb = spec.data.batch_size if micro_batch is None else micro_batch
    if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
        raise ValueError(f"micro_batch must be a positive integer, got {micro_batch!r}")
    return mb * spec.model.seq_len


@dataclass(frozen=True)
class MemoryEstimate:
    """The terms of the formula in the module doc, in bytes."""

    params: int  # count, not bytes
    state: int
    outer: int
    activations: int
    step: int = 0  # the optimizer step's transient

    @property
    def total(self) -> int:
        return self.state + self.outer + self.step + self.activations


def estimate(
    spec: RunSpec, layers: int, *, embed: bool, head: bool, micro_batch: Optional[int] = None, recompute: bool = False
) -> MemoryEstimate:
    """Memory to train ``layers`` blocks, plus the embedding and/or the norm and head. ``recompute``:
    the blocks' activations are recomputed in the backward (``inner.checkpoint_activations``), so
    every block keeps only its input (d a token) and one block at a time holds A_block; counted
    twice: its backward's buffers and the allocator's holes beside it (see the module doc)."""
    if isinstance(layers, bool) or not isinstance(layers, int) or not 0 <= layers <= spec.model.n_layers:
        raise ValueError(f"layers must be an integer in [0, {spec.model.n_layers}], got {layers!r}")
    n = _tokens(spec, micro_batch)
    params = layers * block_params(spec) + embed * embed_params(spec) + head * head_params(spec)
    a_block, a_head = block_activation_values(spec), head_activation_values(spec)
    blocks = layers * spec.model.d_model + (2 * a_block if layers else 0) if recompute else layers * a_block
    saved = blocks + head * a_head + embed * 2  # 2: token ids and targets, int64
    return MemoryEstimate(
        params=params,
        state=STATE_BYTES_PER_PARAM * params,
        outer=OUTER_BYTES_PER_PARAM * params,
        activations=FP32 * n * saved,
        step=STEP_BYTES_PER_PARAM * params,
    )


def replica_bytes(
    spec: RunSpec,
    layers: Optional[int] = None,
    micro_batch: Optional[int] = None,
    *,
    embed: Optional[bool] = None,
    head: Optional[bool] = None,
) -> int:
    """Bytes to train ``layers`` blocks with AdamW.

    ``layers=None``: the full model, embedding and head included. With ``layers`` given, only the
    blocks unless ``embed`` / ``head`` say otherwise (a first / last pipeline stage). Blocks are
    recomputed in the backward where the run says so (``inner.checkpoint_activations``), a chain
    stage's too.
    """
    full = layers is None
    return estimate(
        spec,
        spec.model.n_layers if full else layers,
        embed=full if embed is None else embed,
        head=full if head is None else head,
        micro_batch=micro_batch,
        recompute=spec.inner.checkpoint_activations,
    ).total


def link_state_bytes(spec: RunSpec) -> int:
    """The activation codec's state a stage with a neighbour holds: T (V, d) and U (d, k <= d)."""
    d = spec.model.d_model
    return FP32 * (spec.model.vocab_size * d + d * d)


def stage_bytes(spec: RunSpec, start_block: int, end_block: int, micro_batch: Optional[int] = None) -> int:
    """Bytes for the pipeline stage owning blocks [start_block, end_block) (see chains.stage_shapes),
    the codec's state included unless the stage is the whole model."""
    n_layers = spec.model.n_layers
    if not 0 <= start_block < end_block <= n_layers:
        raise ValueError(f"block range [{start_block}, {end_block}) is not a non-empty part of [0, {n_layers})")
    whole = start_block == 0 and end_block == n_layers
    return replica_bytes(
        spec, end_block - start_block, micro_batch, embed=start_block == 0, head=end_block == n_layers
    ) + (0 if whole else link_state_bytes(spec))


def first_block_bytes(spec: RunSpec, *, embed: bool, head: bool, micro_batch: Optional[int] = None) -> int:
    """Bytes of a one-block stage in the given place of a chain (first: embed, last: head); every
    further block adds ``layer_bytes``. ``embed and head``: a one-stage chain, no codec state."""
    return replica_bytes(spec, 1, micro_batch, embed=embed, head=head) + (0 if embed and head else link_state_bytes(spec))


def layer_bytes(spec: RunSpec, micro_batch: Optional[int] = None) -> int:
    """What each extra block adds to a stage: its parameter state and its saved activations (its
    input alone when blocks are recomputed: ``inner.checkpoint_activations``)."""
    per_param = STATE_BYTES_PER_PARAM + OUTER_BYTES_PER_PARAM + STEP_BYTES_PER_PARAM
    kept = spec.model.d_model if spec.inner.checkpoint_activations else block_activation_values(spec)
    return per_param * block_params(spec) + FP32 * _tokens(spec, micro_batch) * kept


def max_blocks(
    spec: RunSpec, capacity_bytes: int, *, embed: bool, head: bool, micro_batch: Optional[int] = None
) -> int:
    """The most blocks a chain stage of ``capacity_bytes`` can train (0 when not even one fits)."""
    n_layers = spec.model.n_layers
    one = first_block_bytes(spec, embed=embed, head=head, micro_batch=micro_batch)
    if capacity_bytes < one:
        return 0
    # stage bytes grow by exactly layer_bytes per block
    return min(n_layers, 1 + (capacity_bytes - one) // layer_bytes(spec, micro_batch))


def fits_full_replica(spec: RunSpec, memory_bytes: int, micro_batch: Optional[int] = None) -> bool:
    """Whether ``memory_bytes`` hold the whole model's training: no chain needed."""
    return replica_bytes(spec, micro_batch=micro_batch) <= memory_bytes


__all__ = [
    "MemoryEstimate",
    "estimate",
    "replica_bytes",
    "stage_bytes",
    "link_state_bytes",
    "first_block_bytes",
    "layer_bytes",
    "max_blocks",
    "fits_full_replica",
    "block_shapes",
    "block_activation_values",
    "head_activation_values",
]
