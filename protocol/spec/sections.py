"""The sections of the run spec (protocol/spec/__init__.py): model, data, inner and outer optimisation,
compression, partial updates, chains and swarm timings.

Each is a frozen, strict pydantic model (protocol/spec/fields.py): built from keyword arguments or
from a nested dict of the run spec, validated when it is built, and a SpecError naming the field
by its dotted path (``model.n_layers``) when anything is wrong.
"""

import math
from typing import Any, ClassVar, Dict, Literal, Tuple

from pydantic import Field, model_validator

from protocol.errors import SpecError
from protocol.model.layout import check_slices, tensor_layout
from protocol.spec.presets import expand_preset
from protocol.spec.fields import Bool, Float, Int, OptionalFloat, SpecModel, Str

STRATEGIES = ("diloco", "sparseloco", "dct")
DENSE_DTYPES = ("fp32", "fp16")
SPARSE_AGGREGATES = ("chosen", "mean")
CHAIN_WIRE_DTYPES = ("fp16", "bf16")
INNER_PRECISIONS = ("auto", "fp32", "bf16")  # auto: bf16 autocast on a CUDA device that supports it, else fp32
DEFAULT_OUTER_LR = {"diloco": 0.7, "sparseloco": 1.0, "dct": 1.0}
TOKENIZERS = ("bytes", "bpe")  # bytes: utf-8 bytes, vocabulary 256; bpe: a byte-level BPE tokenizer.json
BYTE_VOCAB = 256
MAX_TOKENIZER_BYTES = 8 << 20  # the largest tokenizer.json a peer downloads

MAX_PARAMS = 2 * 10**11  # the largest model a spec may describe (800 GB of fp32 weights)
DAY = 86400.0  # seconds: the longest any timeout or wait may be
MAX_STEPS = 1 << 40  # step and round counters


class ModelSpec(SpecModel):
    """A Llama-style decoder (RMSNorm, RoPE, SwiGLU) over bytes; ``preset`` names a shape (protocol/spec/presets.py)."""

    _path: ClassVar[str] = "model"

    vocab_size: Int(ge=1, le=1 << 20) = 256
    d_model: Int(ge=1, le=1 << 16) = 128
    n_layers: Int(ge=1, le=1024) = 4
    n_heads: Int(ge=1, le=1024) = 4
    ffn_hidden: Int(ge=1, le=1 << 18) = 352
    seq_len: Int(ge=1, le=1 << 17) = 128
    rope_theta: Float(gt=0.0, le=1e12) = 10000.0
    norm_eps: Float(gt=0.0, le=1.0) = 1e-5
    init_std: Float(gt=0.0, le=10.0) = 0.02

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, data: Any) -> Any:
        """``preset = "125m"`` fills the shape fields not given (protocol/spec/presets.py); explicit
        fields win. The preset is not stored: the spec holds the fields it stands for."""
        return expand_preset(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _shape(self) -> "ModelSpec":
        if self.d_model % self.n_heads:
            raise SpecError(f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})")
        if (self.d_model // self.n_heads) % 2:
            raise SpecError("model.d_model / model.n_heads must be even (RoPE rotates pairs of dimensions)")
        n = self.num_params()
        if n > MAX_PARAMS:
            raise SpecError(
                f"model has {n:.3g} parameters, more than the limit of {MAX_PARAMS:.3g}"
                " (model.n_layers, model.d_model, model.ffn_hidden, model.vocab_size)"
            )
        return self

    def check_slices(self, mlp_slices: int = 1, attn_slices: int = 1) -> None:
        check_slices(self, mlp_slices, attn_slices)

    def param_shapes(self, mlp_slices: int = 1, attn_slices: int = 1) -> Dict[str, Tuple[int, ...]]:
        """Every trainable tensor of the model, by the name peer/training/model.py gives it, in a fixed order
        (protocol/model/layout.py). With slices > 1, the MLP hidden neurons (attention heads) are
        separate tensors per slice: ``blocks.{i}.mlp.gate.{s}.weight`` and so on."""
        return {name: t.shape for name, t in tensor_layout(self, mlp_slices, attn_slices).items()}

    def num_params(self) -> int:
        return sum(math.prod(s) for s in self.param_shapes().values())


class DataSpec(SpecModel):
    """Where the text comes from and how it is cut into batches."""

    _path: ClassVar[str] = "data"
    _omit_at_default: ClassVar[Tuple[str, ...]] = ("tokenizer", "tokenizer_sha256", "text_field")

    corpus: Str(min_length=1) = "stdlib"  # "stdlib": the Python standard library's sources; peers may pass --data
    val_fraction: Float(gt=0.0, lt=1.0) = 0.1  # fraction of files held out for validation (by a hash of the path)
    batch_size: Int(ge=1, le=1 << 16) = 16  # sequences per inner step
    val_batches: Int(ge=1, le=1 << 16) = 8  # batches in one validation pass (fixed, the same on every peer)
    # the fields below are left out of the serialized spec at their defaults: a byte-level run's
    # digest is what it was before they existed
    tokenizer: Literal[TOKENIZERS] = "bytes"
    tokenizer_sha256: Str(max_length=64) = ""  # bpe: sha256 (hex) of the tokenizer.json every peer must use
    text_field: Str(min_length=1, max_length=256) = "text"  # the text field of .jsonl records / column of .parquet

    @model_validator(mode="after")
    def _tokenizer(self) -> "DataSpec":
        sha = self.tokenizer_sha256
        if sha and not (len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
            raise SpecError("data.tokenizer_sha256 must be 64 lowercase hex digits (the sha256 of tokenizer.json), or empty")
        if self.tokenizer == "bytes" and self.tokenizer_sha256:
            raise SpecError('data.tokenizer_sha256 is set but data.tokenizer is "bytes": set data.tokenizer = "bpe" or drop it')
        return self


class InnerSpec(SpecModel):
    """AdamW on every peer, warm-up then cosine decay, state kept across rounds."""

    _path: ClassVar[str] = "inner"
    _omit_at_default: ClassVar[Tuple[str, ...]] = ("precision", "checkpoint_activations")

    lr: Float(gt=0.0, le=1e3) = 2e-3
    beta1: Float(ge=0.0, lt=1.0) = 0.9
    beta2: Float(ge=0.0, lt=1.0) = 0.95
    weight_decay: Float(ge=0.0, le=1e3) = 0.1
    warmup_steps: Int(ge=0, lt=MAX_STEPS) = 30
    total_steps: Int(ge=1, le=MAX_STEPS) = 3000  # the cosine horizon, counted in a peer's own inner steps
    min_lr_ratio: Float(ge=0.0, le=1.0) = 0.1
    grad_clip: Float(gt=0.0, le=1e6) = 1.0
    # left out of the serialized spec at its default, like data.tokenizer: digests are unchanged.
    # The forward pass and loss under bf16 autocast, or fp32; parameters and AdamW stay fp32
    # (peer/training/inner.py). Only the inner steps: θ, payloads and the outer step are the same either way.
    precision: Literal[INNER_PRECISIONS] = "auto"
    # left out at its default too. A peer (a chain stage too) keeps only each block's input for the
    # backward and recomputes the block there: a quarter more FLOPs a step, the activations of one
    # block instead of every block's; the memory estimate, and so who holds a full replica, follows it
    checkpoint_activations: Bool = False

    @model_validator(mode="after")
    def _horizon(self) -> "InnerSpec":
        if self.total_steps <= self.warmup_steps:
            raise SpecError(
                f"inner.total_steps ({self.total_steps}) must be greater than inner.warmup_steps ({self.warmup_steps})"
            )
        return self

    def lr_at(self, step: int) -> float:
        """Learning rate for a peer's inner step number ``step`` (0-based)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        floor = self.lr * self.min_lr_ratio
        return floor + (self.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


class _ChunkTopK(SpecModel):
    """A compressor keeping ``topk`` entries per chunk of ``chunk`` x ``chunk``."""

    chunk: int
    topk: int

    @model_validator(mode="after")
    def _topk_fits(self) -> "_ChunkTopK":
        if self.topk > self.chunk * self.chunk:
            raise SpecError(f"{self._path}.topk ({self.topk}) must be <= {self._path}.chunk ** 2 ({self.chunk**2})")
        return self


class SparseLoCoSpec(_ChunkTopK):
    _path: ClassVar[str] = "outer.sparseloco"
    _omit_at_default: ClassVar[Tuple[str, ...]] = ("min_share",)

    chunk: Int(ge=1, le=64) = 64  # chunk side: 64x64 blocks for matrices (indices packed in 12 bits)
    topk: Int(ge=1, le=64 * 64) = 64  # kept entries per full chunk of chunk*chunk (64 of 4096 = 1.56 %)
    bits: Int(ge=1, le=8) = 2  # quantization bits of the kept values
    ef_beta: Float(ge=0.0, le=1.0) = 0.95  # error-feedback decay
    # "chosen": each coordinate averaged over the payloads that kept it; "mean": over all payloads
    aggregate: Literal[SPARSE_AGGREGATES] = "chosen"
    # with "chosen": a coordinate is divided by no fewer than this share of the payloads that carry
    # its tensor, so the step stays bounded as contributors grow (0: by those that kept it only; at
    # 4 payloads or fewer 0.25 is the same). Left out of the serialized spec at its default
    min_share: Float(ge=0.0, le=1.0) = 0.25


class DCTSpec(_ChunkTopK):
    _path: ClassVar[str] = "outer.dct"

    chunk: Int(ge=1, le=256) = 64  # DCT block side (indices are uint16)
    topk: Int(ge=1, le=256 * 256) = 32  # coefficients kept per full chunk
    beta: Float(ge=0.0, le=1.0) = 0.999  # decay of the local outer momentum
    value_dtype: Literal[DENSE_DTYPES] = "fp16"


class OuterSpec(SpecModel):
    _path: ClassVar[str] = "outer"
    _omit_at_default: ClassVar[Tuple[str, ...]] = ("min_agreement", "fresh_agreement", "max_contributions", "max_overlap")

    strategy: Literal[STRATEGIES] = "sparseloco"
    inner_steps: Int(ge=1, le=1 << 20) = 30  # H: local steps between two exchanges
    lr: OptionalFloat(gt=0.0, le=1e3) = None  # None: the strategy's default (diloco 0.7, sparseloco and dct 1.0)
    momentum: Float(ge=0.0, lt=1.0) = 0.9  # diloco's outer Nesterov momentum
    nesterov: Bool = True
    overlap: Bool = True  # train the next round while this round's exchange is in flight (one-step-delayed outer update)
    # with overlap, at most this fraction of H steps (rounded down, at least 1) are taken while the last
    # round's exchange is in flight; past it the peer waits for the exchange: the steps further ahead train on a θ too stale
    # (bench/RESULTS.md, "Overlap"). 1: the whole next round. Left out of the serialized spec at its default
    max_overlap: Float(gt=0.0, le=1.0) = 1.0
    min_inner_fraction: Float(gt=0.0, le=1.0) = 0.25  # a slower peer closes its round early, once its groupmates are ready, after at least this fraction of H
    dense_dtype: Literal[DENSE_DTYPES] = "fp32"  # diloco's wire dtype
    # a contribution counts only if its signs agree with the others' of its round at least this many
    # standard deviations above chance (peer/outer/consensus.py); 0 turns the check off. Left out of
    # the serialized spec at its default, like data.tokenizer: digests are unchanged
    min_agreement: Float(ge=0.0, le=1e6) = 3.0
    # a full replica without standing (protocol/round/standing.py) must also agree at least this fraction
    # of the lower median agreement of its round's full replicas (standing.fresh_bar); 0: min_agreement alone
    fresh_agreement: Float(ge=0.0, le=1.0) = 0.25
    # at most this many contributions of each part of the model enter θ in a round, drawn alike by every
    # member (protocol/round/choice.py); the others stay with their senders for a later round. 0: all of them
    max_contributions: Int(ge=0, le=1 << 16) = 0
    sparseloco: SparseLoCoSpec = Field(default_factory=SparseLoCoSpec)
    dct: DCTSpec = Field(default_factory=DCTSpec)

    @property
    def effective_lr(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_OUTER_LR[self.strategy]


class PartialSpec(SpecModel):
    """Partial parameter updates (arXiv 2509.22418): each peer trains one fixed slice.

    The MLP hidden neurons of every block are split into ``slices`` slices (and the attention heads
    too, with ``attention``); a peer trains its slice plus the shared tensors (embeddings, norms,
    attention unless sliced, head) and freezes the rest. ``slices = 1``: every peer trains it all.
    """

    _path: ClassVar[str] = "partial"
    _omit_at_default: ClassVar[Tuple[str, ...]] = ("balance_steps",)

    slices: Int(ge=1, le=1024) = 1
    attention: Bool = False
    # a slice carried by fewer of a round's contributions than the most-carried tensor takes a larger
    # outer step: √(most / its) (protocol/model/partial.py ``balanced_steps``)
    balance_steps: Bool = True

    @property
    def attn_slices(self) -> int:
        return self.slices if self.attention else 1


class ChainSpec(SpecModel):
    """Pipeline chains of low-resource peers (arXiv 2601.02360): one stage per peer, a chain is one
    replica; activations cross stage boundaries projected on a rank-``rank`` subspace."""

    _path: ClassVar[str] = "chain"

    rank: Int(ge=0, le=1 << 16) = 0  # k; 0: d_model // 10 (>= 8x fewer bytes per token than 16-bit); d_model: uncompressed
    micro_batches: Int(ge=1, le=1 << 16) = 4  # GPipe micro-batches per inner step (a batch split as evenly as can be)
    wire_dtype: Literal[CHAIN_WIRE_DTYPES] = "fp16"  # fp16 or bf16 values between stages
    compress_all: Bool = False  # every replica trains the subspace-constrained model (the "uniform" arm)
    link_timeout: Float(gt=0.0, le=DAY) = 30.0  # seconds without a frame from a neighbour: the chain is broken

    def effective_rank(self, d_model: int) -> int:
        return self.rank if self.rank else max(1, d_model // 10)


class SwarmSpec(SpecModel):
    """How peers meet: group sizes and the time limits of one round."""

    _path: ClassVar[str] = "swarm"

    min_group_size: Int(ge=1, le=1 << 12) = 2
    max_group_size: Int(ge=1, le=1 << 12) = 16
    matchmaking_time: Float(gt=0.0, le=DAY) = 3.0  # seconds a leader waits for followers
    gather_timeout: Float(gt=0.0, le=DAY) = 30.0  # seconds for the all-gather once a group is formed
    round_wait: Float(gt=0.0, le=DAY) = 60.0  # the most a ready peer waits for slower peers of its round
    heartbeat_period: Float(gt=0.0, le=3600.0) = 2.0  # seconds between progress records in the DHT

    @model_validator(mode="after")
    def _groups(self) -> "SwarmSpec":
        if self.max_group_size < self.min_group_size:
            raise SpecError(
                f"swarm.max_group_size ({self.max_group_size}) must be >= swarm.min_group_size ({self.min_group_size})"
            )
        return self


__all__ = [
    "STRATEGIES",
    "DENSE_DTYPES",
    "SPARSE_AGGREGATES",
    "CHAIN_WIRE_DTYPES",
    "INNER_PRECISIONS",
    "DEFAULT_OUTER_LR",
    "TOKENIZERS",
    "BYTE_VOCAB",
    "MAX_TOKENIZER_BYTES",
    "MAX_PARAMS",
    "ModelSpec",
    "DataSpec",
    "InnerSpec",
    "SparseLoCoSpec",
    "DCTSpec",
    "OuterSpec",
    "PartialSpec",
    "ChainSpec",
    "SwarmSpec",
]
