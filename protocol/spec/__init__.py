"""The run spec: one validated, versioned object that describes a training run.

The coordinator publishes it into the DHT; every peer reads it from there and needs no other
configuration. Two peers with the same spec digest build the same model from the same seed,
read the same corpus split, and run the same strategy with the same hyper-parameters.

The sections live in protocol/spec/sections.py, the field types and the error translation in
protocol/spec/fields.py; everything a caller needs is importable from here. Any bad spec, from a
dict, TOML or msgpack, raises SpecError with one line naming the field (``model.n_layers must be
an integer in [1, 1024], got 2147483648``).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import tomllib
from typing import Any, ClassVar, Dict, List, Mapping, Tuple

import msgpack
from pydantic import Field, field_validator, model_validator

from protocol import PROTOCOL_VERSION
from protocol.spec import sections as spec_sections
from protocol.errors import SpecError
from protocol.model.layout import TensorInfo, tensor_layout
from protocol.spec.fields import Int, SpecModel, Str
from protocol.wire.bounded_unpack import bounded_unpack
from protocol.spec.sections import (  # noqa: F401 - the sections and constants are re-exported from here
    BYTE_VOCAB,
    CHAIN_WIRE_DTYPES,
    DEFAULT_OUTER_LR,
    DENSE_DTYPES,
    MAX_PARAMS,
    SPARSE_AGGREGATES,
    STRATEGIES,
    ChainSpec,
    DataSpec,
    DCTSpec,
    InnerSpec,
    ModelSpec,
    OuterSpec,
    PartialSpec,
    SparseLoCoSpec,
    SwarmSpec,
)

SPEC_VERSION = 1
MAX_TENSORS = 1 << 16  # tensors of the (sliced) model: every exchange walks them all
RUN_ID = re.compile(r"[a-z0-9][a-z0-9_-]{0,47}")


class RunSpec(SpecModel):
    _path: ClassVar[str] = ""

    run_id: Str(min_length=1, max_length=48) = "voloco-demo"
    seed: Int(ge=0, lt=1 << 63) = 0
    max_rounds: Int(ge=0, lt=1 << 40) = 0  # 0: train until stopped
    model: ModelSpec = Field(default_factory=ModelSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    inner: InnerSpec = Field(default_factory=InnerSpec)
    outer: OuterSpec = Field(default_factory=OuterSpec)
    swarm: SwarmSpec = Field(default_factory=SwarmSpec)
    partial: PartialSpec = Field(default_factory=PartialSpec)
    chain: ChainSpec = Field(default_factory=ChainSpec)
    version: Int(ge=SPEC_VERSION, le=SPEC_VERSION) = SPEC_VERSION

    @model_validator(mode="before")
    @classmethod
    def _version_first(cls, data: Any) -> Any:
        """A spec of another version is refused as such, before its fields are looked at."""
        version = data.get("version", SPEC_VERSION) if isinstance(data, dict) else SPEC_VERSION
        if type(version) is int and version != SPEC_VERSION:
            raise SpecError(f"spec version {version} is not supported (this voloco speaks {SPEC_VERSION})")
        return data

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, value: str) -> str:
        if not RUN_ID.fullmatch(value):
            raise SpecError(
                f"run_id {value!r} must be 1-48 characters of a-z, 0-9, '_' or '-', starting with a letter or digit"
            )
        return value

    @model_validator(mode="after")
    def _across_sections(self) -> "RunSpec":
        if self.data.tokenizer == "bytes" and self.model.vocab_size < BYTE_VOCAB:  # larger: rows no byte uses
            raise SpecError(f'model.vocab_size ({self.model.vocab_size}) must be at least {BYTE_VOCAB} with data.tokenizer = "bytes"')
        if self.data.tokenizer == "bpe" and self.model.vocab_size <= BYTE_VOCAB:
            raise SpecError(f'model.vocab_size ({self.model.vocab_size}) must exceed {BYTE_VOCAB} with data.tokenizer = "bpe"')
        if self.chain.rank > self.model.d_model:
            raise SpecError(f"chain.rank ({self.chain.rank}) must be <= model.d_model ({self.model.d_model})")
        self.model.check_slices(self.partial.slices, self.partial.attn_slices)
        per_block = 2 + 2 * self.partial.attn_slices + 3 * self.partial.slices
        tensors = 3 + self.model.n_layers * per_block
        if tensors > MAX_TENSORS:
            raise SpecError(
                f"model.n_layers ({self.model.n_layers}) x partial.slices ({self.partial.slices}) make {tensors} tensors,"
                f" more than the limit of {MAX_TENSORS}"
            )
        return self

    def layout(self) -> Dict[str, TensorInfo]:
        """The model's tensors as this run stores them (sliced when partial updates are on), with
        their block, kind and slice (protocol/model/layout.py)."""
        return tensor_layout(self.model, self.partial.slices, self.partial.attn_slices)

    def param_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """The model's tensors as this run stores them, {name: shape}."""
        return {name: t.shape for name, t in self.layout().items()}

    # --- serialization -------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        """Every field, sections as nested dicts, in declaration order (the digest depends on it)."""
        return self.model_dump()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RunSpec":
        """Build and validate a spec; unknown keys and wrong types raise SpecError naming the field."""
        if not isinstance(data, Mapping):
            raise SpecError(f"run spec must be a table/map, got {type(data).__name__}")
        odd = [repr(k) for k in data if not isinstance(k, str)]
        if odd:
            raise SpecError(f"unknown field(s) in the run spec: {', '.join(odd)}")
        return cls(**data)

    @classmethod
    def from_toml(cls, text: str) -> "RunSpec":
        try:
            data = tomllib.loads(text)
        except ValueError as e:  # TOMLDecodeError, or an integer too long to convert
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
        data = bounded_unpack(bytes(raw), SpecError, "run spec record", max_array_len=len(raw), max_map_len=len(raw))
        if not isinstance(data, dict):
            raise SpecError("run spec record must be a map")
        return cls.from_dict(data)

    def digest(self) -> str:
        """A short stable fingerprint: peers with different digests never group together. It names the
        protocol version too, so peers of two versions, which refuse each other's payloads, never
        group (tests/protocol/test_spec.py::test_the_digest_names_the_protocol_version)."""
        return hashlib.sha256(b"voloco protocol %d\x00" % PROTOCOL_VERSION + self.to_bytes()).hexdigest()[:16]


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


__all__ = ["SPEC_VERSION", "MAX_TENSORS", "RUN_ID", "RunSpec", *spec_sections.__all__]
