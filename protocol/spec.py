"""The run spec: one validated, versioned object that describes a training run.

The coordinator publishes it into the DHT; every peer reads it from there and needs no other
configuration. Two peers with the same spec digest build the same model from the same seed,
read the same corpus split, and run the same strategy with the same hyper-parameters.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import tomllib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import msgpack

from protocol.errors import SpecError

SPEC_VERSION = 1
STRATEGIES = ("diloco", "sparseloco", "dct")
DENSE_DTYPES = ("fp32", "fp16")
SPARSE_AGGREGATES = ("chosen", "mean")
DEFAULT_OUTER_LR = {"diloco": 0.7, "sparseloco": 1.0, "dct": 1.0}
_RUN_ID = re.compile(r"^[a-z0-9][a-z0-9_-]{0,47}$")


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-style decoder (RMSNorm, RoPE, SwiGLU) over bytes."""

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    ffn_hidden: int = 352
    seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def check(self) -> None:
        _positive(self, "vocab_size", "d_model", "n_layers", "n_heads", "ffn_hidden", "seq_len")
        if self.d_model % self.n_heads:
            raise SpecError(f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})")
        if (self.d_model // self.n_heads) % 2:
            raise SpecError("model.d_model / model.n_heads must be even (RoPE rotates pairs of dimensions)")
        _positive_float(self, "rope_theta", "norm_eps", "init_std")

    def check_slices(self, mlp_slices: int = 1, attn_slices: int = 1) -> None:
        if mlp_slices < 1 or self.ffn_hidden % mlp_slices:
            raise SpecError(f"model.ffn_hidden ({self.ffn_hidden}) must be divisible by the {mlp_slices} MLP slices")
        if attn_slices < 1 or self.n_heads % attn_slices:
            raise SpecError(f"model.n_heads ({self.n_heads}) must be divisible by the {attn_slices} attention slices")

    def param_shapes(self, mlp_slices: int = 1, attn_slices: int = 1) -> Dict[str, Tuple[int, ...]]:
        """Every trainable tensor of the model, by the name peer/model.py gives it, in a fixed order.

        With slices > 1, the MLP hidden neurons (attention heads) are separate tensors per slice:
        ``blocks.{i}.mlp.gate.{s}.weight`` and so on.
        """
        self.check_slices(mlp_slices, attn_slices)
        d, f = self.d_model, self.ffn_hidden
        shapes: Dict[str, Tuple[int, ...]] = {"embed.weight": (self.vocab_size, d)}
        for i in range(self.n_layers):
            p = f"blocks.{i}."
            shapes[p + "attn_norm.weight"] = (d,)
            for name, shape in _sliced("attn.qkv", (3 * d, d), 0, attn_slices):
                shapes[p + name] = shape
            for name, shape in _sliced("attn.out", (d, d), 1, attn_slices):
                shapes[p + name] = shape
            shapes[p + "mlp_norm.weight"] = (d,)
            for proj, shape, axis in (("gate", (f, d), 0), ("up", (f, d), 0), ("down", (d, f), 1)):
                for name, sub in _sliced(f"mlp.{proj}", shape, axis, mlp_slices):
                    shapes[p + name] = sub
        shapes["norm.weight"] = (d,)
        shapes["head.weight"] = (self.vocab_size, d)
        return shapes

    def num_params(self) -> int:
        return sum(math.prod(s) for s in self.param_shapes().values())


def _sliced(name: str, shape: Tuple[int, int], axis: int, slices: int):
    if slices == 1:
        yield f"{name}.weight", shape
        return
    sub = tuple(n // slices if i == axis else n for i, n in enumerate(shape))
    for s in range(slices):
        yield f"{name}.{s}.weight", sub


@dataclass(frozen=True)
class DataSpec:
    """Where the text comes from and how it is cut into batches."""

    corpus: str = "stdlib"  # "stdlib": the Python standard library's sources; peers may pass --data
    val_fraction: float = 0.1  # fraction of files held out for validation (chosen by a hash of the path)
    batch_size: int = 16  # sequences per inner step
    val_batches: int = 8  # batches in one validation pass (fixed, the same on every peer)

    def check(self) -> None:
        if not self.corpus:
            raise SpecError("data.corpus must name a corpus ('stdlib') or a path")
        if not 0.0 < self.val_fraction < 1.0:
            raise SpecError(f"data.val_fraction must lie in (0, 1), got {self.val_fraction}")
        _positive(self, "batch_size", "val_batches")


@dataclass(frozen=True)
class InnerSpec:
    """AdamW on every peer, warm-up then cosine decay, state kept across rounds."""

    lr: float = 2e-3
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.1
    warmup_steps: int = 30
    total_steps: int = 3000  # the cosine horizon, counted in a peer's own inner steps
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0

    def check(self) -> None:
        _positive_float(self, "lr", "grad_clip")
        for name in ("beta1", "beta2", "min_lr_ratio"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0 + (name == "min_lr_ratio"):
                raise SpecError(f"inner.{name} must lie in [0, 1), got {v}")
        if self.weight_decay < 0:
            raise SpecError("inner.weight_decay must be >= 0")
        if self.warmup_steps < 0 or self.total_steps <= self.warmup_steps:
            raise SpecError("inner.total_steps must be greater than inner.warmup_steps >= 0")

    def lr_at(self, step: int) -> float:
        """Learning rate for a peer's inner step number ``step`` (0-based)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        floor = self.lr * self.min_lr_ratio
        return floor + (self.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class SparseLoCoSpec:
    chunk: int = 64  # chunk side: 64x64 blocks for matrices, 64-element chunks for vectors
    topk: int = 64  # kept entries per full chunk of chunk*chunk (64 of 4096 = 1.56 %)
    bits: int = 2  # quantization bits of the kept values
    ef_beta: float = 0.95  # error-feedback decay
    # "chosen": each coordinate averaged over the payloads that kept it; "mean": over all payloads
    aggregate: str = "chosen"

    def check(self) -> None:
        _positive(self, "chunk", "topk", "bits")
        if self.aggregate not in SPARSE_AGGREGATES:
            raise SpecError(f"sparseloco.aggregate must be one of {SPARSE_AGGREGATES}, got {self.aggregate!r}")
        if self.chunk > 64:
            raise SpecError("sparseloco.chunk must be <= 64 (indices are packed in 12 bits)")
        if self.topk > self.chunk * self.chunk:
            raise SpecError("sparseloco.topk must be <= chunk*chunk")
        if self.bits > 8:
            raise SpecError("sparseloco.bits must be <= 8")
        if not 0.0 <= self.ef_beta <= 1.0:
            raise SpecError("sparseloco.ef_beta must lie in [0, 1]")


@dataclass(frozen=True)
class DCTSpec:
    chunk: int = 64  # DCT block side
    topk: int = 32  # coefficients kept per full chunk
    beta: float = 0.999  # decay of the local outer momentum
    value_dtype: str = "fp16"

    def check(self) -> None:
        _positive(self, "chunk", "topk")
        if self.chunk > 256:
            raise SpecError("dct.chunk must be <= 256 (indices are uint16)")
        if self.topk > self.chunk * self.chunk:
            raise SpecError("dct.topk must be <= chunk*chunk")
        if not 0.0 <= self.beta <= 1.0:
            raise SpecError("dct.beta must lie in [0, 1]")
        if self.value_dtype not in DENSE_DTYPES:
            raise SpecError(f"dct.value_dtype must be one of {DENSE_DTYPES}")


@dataclass(frozen=True)
class OuterSpec:
    strategy: str = "sparseloco"
    inner_steps: int = 30  # H: local steps between two exchanges
    lr: Optional[float] = None  # None: the strategy's default (diloco 0.7, sparseloco and dct 1.0)
    momentum: float = 0.9  # diloco's outer Nesterov momentum
    nesterov: bool = True
    dense_dtype: str = "fp32"  # diloco's wire dtype
    sparseloco: SparseLoCoSpec = field(default_factory=SparseLoCoSpec)
    dct: DCTSpec = field(default_factory=DCTSpec)

    def check(self) -> None:
        if self.strategy not in STRATEGIES:
            raise SpecError(f"outer.strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        _positive(self, "inner_steps")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise SpecError("outer.lr must be a positive number")
        if not 0.0 <= self.momentum < 1.0:
            raise SpecError("outer.momentum must lie in [0, 1)")
        if self.dense_dtype not in DENSE_DTYPES:
            raise SpecError(f"outer.dense_dtype must be one of {DENSE_DTYPES}")
        self.sparseloco.check()
        self.dct.check()

    @property
    def effective_lr(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_OUTER_LR[self.strategy]


@dataclass(frozen=True)
class PartialSpec:
    """Partial parameter updates (arXiv 2509.22418): each peer trains one fixed slice.

    The MLP hidden neurons of every block are split into ``slices`` slices (and the attention heads
    too, with ``attention``); a peer trains its slice plus the shared tensors (embeddings, norms,
    attention unless sliced, head) and freezes the rest. ``slices = 1``: every peer trains it all.
    """

    slices: int = 1
    attention: bool = False

    def check(self) -> None:
        _positive(self, "slices")

    @property
    def attn_slices(self) -> int:
        return self.slices if self.attention else 1


@dataclass(frozen=True)
class ChainSpec:
    """Pipeline chains of low-resource peers (arXiv 2601.02360): one stage per peer, a chain is one
    replica; activations cross stage boundaries projected on a rank-``rank`` subspace."""

    rank: int = 0  # k; 0: d_model // 10 (>= 8x fewer bytes per token than 16-bit activations); d_model: uncompressed
    micro_batches: int = 4  # GPipe micro-batches per inner step (a batch is split as evenly as it can be)
    wire_dtype: str = "fp16"  # fp16 or bf16 values between stages
    compress_all: bool = False  # every replica trains the subspace-constrained model (the "uniform" arm)
    link_timeout: float = 30.0  # seconds without a frame from a neighbour before the chain is declared broken

    def check(self) -> None:
        if self.rank < 0:
            raise SpecError("chain.rank must be >= 0 (0 picks d_model // 10)")
        _positive(self, "micro_batches")
        if self.wire_dtype not in ("fp16", "bf16"):
            raise SpecError("chain.wire_dtype must be fp16 or bf16")
        _positive_float(self, "link_timeout")

    def effective_rank(self, d_model: int) -> int:
        return self.rank if self.rank else max(1, d_model // 10)


@dataclass(frozen=True)
class SwarmSpec:
    """How peers meet: group sizes and the time limits of one round."""

    min_group_size: int = 2
    max_group_size: int = 16
    matchmaking_time: float = 3.0  # seconds a leader waits for followers
    gather_timeout: float = 30.0  # seconds for the all-gather once a group is formed
    round_wait: float = 60.0  # the most a ready peer waits for slower peers of its round
    heartbeat_period: float = 2.0  # seconds between progress records in the DHT

    def check(self) -> None:
        _positive(self, "min_group_size", "max_group_size")
        if self.max_group_size < self.min_group_size:
            raise SpecError("swarm.max_group_size must be >= swarm.min_group_size")
        _positive_float(self, "matchmaking_time", "gather_timeout", "round_wait", "heartbeat_period")


@dataclass(frozen=True)
class RunSpec:
    run_id: str = "voloco-demo"
    seed: int = 0
    max_rounds: int = 0  # 0: train until stopped
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    inner: InnerSpec = field(default_factory=InnerSpec)
    outer: OuterSpec = field(default_factory=OuterSpec)
    swarm: SwarmSpec = field(default_factory=SwarmSpec)
    partial: PartialSpec = field(default_factory=PartialSpec)
    chain: ChainSpec = field(default_factory=ChainSpec)
    version: int = SPEC_VERSION

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        if self.version != SPEC_VERSION:
            raise SpecError(f"spec version {self.version} is not supported (this voloco speaks {SPEC_VERSION})")
        if not isinstance(self.run_id, str) or not _RUN_ID.match(self.run_id):
            raise SpecError(
                f"run_id {self.run_id!r} must be 1-48 characters of a-z, 0-9, '_' or '-', starting with a letter or digit"
            )
        if self.seed < 0 or self.max_rounds < 0:
            raise SpecError("seed and max_rounds must be >= 0")
        for part in (self.model, self.data, self.inner, self.outer, self.swarm, self.partial, self.chain):
            part.check()
        if self.chain.rank > self.model.d_model:
            raise SpecError(f"chain.rank ({self.chain.rank}) must be <= model.d_model ({self.model.d_model})")

        self.model.check_slices(self.partial.slices, self.partial.attn_slices)

    def param_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """The model's tensors as this run stores them (sliced when partial updates are on)."""
        return self.model.param_shapes(self.partial.slices, self.partial.attn_slices)

    # --- serialization -------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RunSpec":
        """Build and validate a spec; unknown keys and wrong types raise SpecError naming the field."""
        return _build(cls, data, "")

    @classmethod
    def from_toml(cls, text: str) -> "RunSpec":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise SpecError(f"run spec is not valid TOML: {e}") from None
        return cls.from_dict(data)

    def to_toml(self) -> str:
        """The spec as TOML that ``from_toml`` reads back to an equal spec (unset options omitted)."""
        lines: List[str] = []
        _toml_table(self.to_dict(), [], lines)
        return "\n".join(lines).strip() + "\n"

    def to_bytes(self) -> bytes:
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    @classmethod
    def from_bytes(cls, raw: bytes, max_size: int = 1 << 16) -> "RunSpec":
        if not isinstance(raw, (bytes, bytearray)) or len(raw) > max_size:
            raise SpecError("run spec record is not bytes or is too large")
        try:
            data = msgpack.unpackb(raw, raw=False, strict_map_key=True)
        except Exception as e:  # msgpack raises several unrelated types
            raise SpecError(f"run spec record is not valid msgpack: {e}") from None
        if not isinstance(data, dict):
            raise SpecError("run spec record must be a map")
        return cls.from_dict(data)

    def digest(self) -> str:
        """A short stable fingerprint: peers with different digests never group together."""
        return hashlib.sha256(self.to_bytes()).hexdigest()[:16]

    def replace(self, **changes: Any) -> "RunSpec":
        """A copy with some fields changed; nested sections may be given as dicts of changes."""
        data = self.to_dict()
        for key, value in changes.items():
            if isinstance(value, dict) and isinstance(data.get(key), dict):
                data[key] = _merge(data[key], value)
            else:
                data[key] = value
        return RunSpec.from_dict(data)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise SpecError(f"a spec value of {value} has no TOML form")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are valid TOML escapes
    raise SpecError(f"a spec value of type {type(value).__name__} has no TOML form")


def _toml_table(table: Mapping[str, Any], path: List[str], lines: List[str]) -> None:
    subtables = {k: v for k, v in table.items() if isinstance(v, Mapping)}
    if path:
        lines.append(f"\n[{'.'.join(path)}]")
    for key, value in table.items():
        if value is not None and key not in subtables:
            lines.append(f"{key} = {_toml_value(value)}")
    for key, value in subtables.items():
        _toml_table(value, path + [key], lines)


def _merge(base: Dict[str, Any], changes: Mapping[str, Any]) -> Dict[str, Any]:
    out = dict(base)
    for key, value in changes.items():
        out[key] = _merge(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), dict) else value
    return out


def _build(cls, data: Any, path: str):
    if not isinstance(data, Mapping):
        raise SpecError(f"{path or 'run spec'} must be a table/map, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(data) - set(fields)
    if unknown:
        raise SpecError(f"unknown field(s) in {path or 'run spec'}: {', '.join(sorted(map(str, unknown)))}")
    kwargs = {}
    for name, value in data.items():
        f = fields[name]
        where = f"{path}{name}"
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            kwargs[name] = _build(type(default), value, where + ".")
        else:
            kwargs[name] = _coerce(value, default, f.type, where)
    try:
        obj = cls(**kwargs)
        if cls is not RunSpec:
            obj.check()
        return obj
    except SpecError:
        raise
    except (TypeError, ValueError) as e:
        raise SpecError(f"invalid {path or 'run spec'}: {e}") from None


def _coerce(value: Any, default: Any, annotation: str, where: str) -> Any:
    if value is None and "Optional" in str(annotation):
        return None
    if isinstance(default, bool) or annotation == "bool":
        if not isinstance(value, bool):
            raise SpecError(f"{where} must be true or false, got {value!r}")
        return value
    if isinstance(default, int) and annotation == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"{where} must be an integer, got {value!r}")
        return value
    if isinstance(default, float) or "float" in str(annotation):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise SpecError(f"{where} must be a finite number, got {value!r}")
        return float(value)
    if isinstance(default, str):
        if not isinstance(value, str):
            raise SpecError(f"{where} must be a string, got {value!r}")
        return value
    raise SpecError(f"{where}: unsupported value {value!r}")


def _positive(obj: Any, *names: str) -> None:
    section = type(obj).__name__.replace("Spec", "").lower()
    for name in names:
        v = getattr(obj, name)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise SpecError(f"{section}.{name} must be a positive integer, got {v!r}")


def _positive_float(obj: Any, *names: str) -> None:
    section = type(obj).__name__.replace("Spec", "").lower()
    for name in names:
        v = getattr(obj, name)
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise SpecError(f"{section}.{name} must be a positive number, got {v!r}")
