"""The wire format between neighbouring pipeline stages over plain TCP (sans-I/O).

A frame is a 4-byte big-endian length, then a msgpack map of exactly that many bytes whose
``"t"`` names the frame type::

    hello        {"t", "v": the link protocol's version (``LINK_VERSION``), "run": spec digest, "chain": chain id,
                  "stage": sender's stage index, "round": int, "role": "upstream"|"downstream"}
    hello_ok     {"t"}
    reject       {"t", "reason": str}
    activations  {"t", "mb": micro-batch id, "step": inner step, "shape": [B, T, k],
                  "dtype": "fp16"|"bf16"|"fp32", "tokens": B*T token ids, "data": B*T*k values}
    grads        {"t", "mb", "step", "shape", "dtype", "data"}
    close        {"t", "step"}: the round ends before inner step ``step`` (the first stage closed it
                 early, peer/round/early_close.py); sent downstream in place of that step's frames
    bye          {"t"}

The connecting side sends ``hello``; the other answers ``hello_ok`` or ``reject`` and closes.
When the chain assignment names the peers of its stages, the handshake also proves who is on the
other end (challenge–response with the libp2p identity keys, protocol/wire/signed.py)::

    hello        ... "nonce": 32 random bytes of the dialer (empty: no authentication offered)
    challenge    {"t", "nonce": 32 random bytes of the listener, "key": its public key,
                  "sig": its signature over the link's transcript, protocol/chain/link_auth.py}
    auth         {"t", "key": the dialer's public key, "sig": its signature over the transcript}

hello -> challenge -> auth -> hello_ok (protocol/chain/link_auth.py says what is signed and checked).
Before the handshake completes a frame is at most ``HANDSHAKE_MAX_BYTES``.
``role`` is the sender's place on the link: the upstream stage (index i) sends activations and
receives grads, the downstream one (i + 1) the reverse. Activations carry the subspace
coefficients ``c = (h - T[tok]) U`` (protocol/chain/activations.py; docs/chains.md, "Subspace-projected
activations"; k = d_model without projection)
and the token ids the receiver needs to rebuild ``h``; grads carry ``g U``.

Token ids travel little-endian in the fewest bytes the vocabulary needs (1 up to 256 ids, 2 up
to 65,536, else 4: protocol/chain/activations.py's ``token_id_bytes``); float payloads little-endian in
the named dtype (fp32 is accepted for uncompressed links and debugging). ``FrameDecoder`` is the trust boundary: for
any bytes it returns well-formed frames whose tensors have the expected shape, finite values
and in-range token ids, or raises FrameError; after an error the connection must be dropped.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

import msgpack
import numpy as np
import torch

from protocol.chain.activations import token_id_bytes
from protocol.wire.bounded_unpack import bounded_unpack
from protocol.errors import FrameError
from protocol.spec import RunSpec

LINK_VERSION = 2  # the stage links' protocol: 2 since the close frame (a stage of 1 could not read one)
LENGTH = struct.Struct(">I")
ROLES = ("upstream", "downstream")
WIRE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
_DTYPE_NAMES = {v: k for k, v in WIRE_DTYPES.items()}
MAX_REASON = 512  # characters of a reject reason
MAX_ID = 128  # characters of a run digest or chain id
MAX_INT = 1 << 62  # upper bound of micro-batch ids, steps, rounds and stage indices
SLACK = 1024  # the map header, keys and small fields of the largest frame
HANDSHAKE_MAX_BYTES = 4096  # the largest frame before the handshake completes (a challenge is ~1.7 KiB)
NONCE_BYTES = 32
MAX_KEY_BYTES = 1024  # a libp2p RSA public key (4096 bits: ~550 bytes)
MAX_SIG_BYTES = 512  # an RSA-4096 signature


# --- frames ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    run: str
    chain: str
    stage: int
    round: int
    role: str
    version: int = LINK_VERSION
    nonce: bytes = b""  # the dialer's challenge to the listener; empty: no authentication


@dataclass(frozen=True)
class HelloOk:
    pass


@dataclass(frozen=True)
class Challenge:
    nonce: bytes  # the listener's challenge to the dialer
    key: bytes  # the listener's public key (libp2p protobuf)
    sig: bytes  # its signature over the link's transcript (protocol/chain/link_auth.py)


@dataclass(frozen=True)
class Auth:
    key: bytes  # the dialer's public key
    sig: bytes  # its signature over the link's transcript


@dataclass(frozen=True)
class Reject:
    reason: str


@dataclass(frozen=True, eq=False)
class Activations:
    mb: int
    step: int
    tokens: torch.Tensor  # (B, T) integer ids
    values: torch.Tensor  # (B, T, k) fp16, bf16 or fp32


@dataclass(frozen=True, eq=False)
class Grads:
    mb: int
    step: int
    values: torch.Tensor  # (B, T, k)


@dataclass(frozen=True)
class Close:
    step: int  # the first inner step the round does not take


@dataclass(frozen=True)
class Bye:
    pass


Frame = Union[Hello, HelloOk, Challenge, Auth, Reject, Activations, Grads, Close, Bye]
_TYPE_NAMES = {
    Hello: "hello", HelloOk: "hello_ok", Challenge: "challenge", Auth: "auth", Reject: "reject",
    Activations: "activations", Grads: "grads", Close: "close", Bye: "bye",
}
_FIELDS = {
    "hello": {"t", "v", "run", "chain", "stage", "round", "role", "nonce"},
    "hello_ok": {"t"},
    "challenge": {"t", "nonce", "key", "sig"},
    "auth": {"t", "key", "sig"},
    "reject": {"t", "reason"},
    "activations": {"t", "mb", "step", "shape", "dtype", "tokens", "data"},
    "grads": {"t", "mb", "step", "shape", "dtype", "data"},
    "close": {"t", "step"},
    "bye": {"t"},
}


# --- limits both ends derive from the run ------------------------------------------------------


_ID_DTYPES = {1: "<u1", 2: "<u2", 4: "<i4"}


@dataclass(frozen=True)
class FrameFormat:
    """What a link's frames must look like: B <= micro_batch sequences of exactly seq_len tokens,
    k values per token, ids below vocab_size."""

    micro_batch: int
    seq_len: int
    k: int
    d_model: int
    vocab_size: int

    def __post_init__(self):
        for name in ("micro_batch", "seq_len", "k", "d_model", "vocab_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.k > self.d_model:
            raise ValueError(f"k ({self.k}) must be at most d_model ({self.d_model})")

    @classmethod
    def for_run(cls, spec: RunSpec, micro_batch: Optional[int] = None, k: Optional[int] = None) -> "FrameFormat":
        """``micro_batch`` defaults to the run's batch size, ``k`` to d_model (no projection)."""
        m = spec.model
        return cls(
            micro_batch=spec.data.batch_size if micro_batch is None else micro_batch,
            seq_len=m.seq_len,
            k=m.d_model if k is None else k,
            d_model=m.d_model,
            vocab_size=m.vocab_size,
        )

    @property
    def token_width(self) -> int:
        return token_id_bytes(self.vocab_size)

    @property
    def max_frame_bytes(self) -> int:
        """The largest body a frame may have: fp32 values of max(d, k) per token, the ids, slack."""
        tokens = self.micro_batch * self.seq_len
        return tokens * max(self.d_model, self.k) * 4 + tokens * 4 + SLACK


# --- encoding ----------------------------------------------------------------------------------


def encode_frame(frame: Frame, fmt: Optional[FrameFormat] = None) -> bytes:
    """The length-prefixed bytes of ``frame``. With ``fmt`` (required for activations: it sets the
    width of the token ids), shapes are checked against it."""
    kind = _TYPE_NAMES.get(type(frame))
    if kind is None:
        raise TypeError(f"not a frame: {type(frame).__name__}")
    msg: Dict[str, Any] = {"t": kind}
    if isinstance(frame, Hello):
        msg.update(v=frame.version, run=frame.run, chain=frame.chain, stage=frame.stage, round=frame.round, role=frame.role,
                   nonce=frame.nonce)
    elif isinstance(frame, Challenge):
        msg.update(nonce=frame.nonce, key=frame.key, sig=frame.sig)
    elif isinstance(frame, Auth):
        msg.update(key=frame.key, sig=frame.sig)
    elif isinstance(frame, Reject):
        msg["reason"] = frame.reason[:MAX_REASON]
    elif isinstance(frame, Close):
        msg["step"] = frame.step
    elif isinstance(frame, (Activations, Grads)):
        values = frame.values.detach()
        if values.dim() != 3 or values.dtype not in _DTYPE_NAMES:
            raise ValueError(f"values must be a (B, T, k) tensor of {sorted(WIRE_DTYPES)}, got {values.dtype} {tuple(values.shape)}")
        if fmt is not None:
            _check_shape(list(values.shape), fmt, ValueError)
        msg.update(mb=frame.mb, step=frame.step, shape=list(values.shape), dtype=_DTYPE_NAMES[values.dtype])
        if isinstance(frame, Activations):
            if fmt is None:
                raise TypeError("encoding an activations frame needs the link's FrameFormat (token id width)")
            msg["tokens"] = _token_bytes(frame.tokens, tuple(values.shape[:2]), fmt.token_width)
        msg["data"] = _tensor_bytes(values)
    body = msgpack.packb(msg, use_bin_type=True)
    if len(body) > 0xFFFFFFFF:
        raise ValueError("frame too large for a 4-byte length")
    return LENGTH.pack(len(body)) + body


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.to("cpu").contiguous()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _token_bytes(tokens: torch.Tensor, shape: tuple, width: int) -> bytes:
    if tuple(tokens.shape) != shape or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must be an integer tensor of shape {shape}, got {tokens.dtype} {tuple(tokens.shape)}")
    ids = tokens.detach().to("cpu", torch.int64).numpy()
    if ids.size and (ids.min() < 0 or ids.max() >= 1 << (8 * width - (width == 4))):
        raise ValueError(f"token ids do not fit in {width} bytes")
    return ids.astype(_ID_DTYPES[width]).tobytes()


# --- decoding ----------------------------------------------------------------------------------


class FrameDecoder:
    """Turns a byte stream into validated frames: ``feed(data) -> [frames]``.

    Partial frames are buffered until complete. A length prefix above the format's limit raises at
    once, before any of its body is awaited. Any FrameError poisons the decoder: the stream has
    lost its framing (or the peer is hostile) and must be closed.
    """

    def __init__(self, fmt: FrameFormat, max_frame_bytes: Optional[int] = None):
        """``max_frame_bytes``: a tighter limit than the format's (``HANDSHAKE_MAX_BYTES`` before the
        handshake completes); it may be changed between feeds."""
        self.fmt = fmt
        self.max_frame_bytes = fmt.max_frame_bytes if max_frame_bytes is None else max_frame_bytes
        self._buf = bytearray()
        self._failed: Optional[str] = None

    @property
    def buffered(self) -> int:
        """Bytes held for a frame not complete yet."""
        return len(self._buf)

    def feed(self, data: bytes) -> List[Frame]:
        if self._failed is not None:
            raise FrameError(f"stream already failed: {self._failed}")
        try:
            return self._feed(data)
        except FrameError as e:
            self._failed = str(e)
            self._buf = bytearray()
            raise

    def _feed(self, data: bytes) -> List[Frame]:
        self._buf += data
        frames: List[Frame] = []
        while len(self._buf) >= LENGTH.size:
            (length,) = LENGTH.unpack_from(self._buf)
            if length == 0:
                raise FrameError("empty frame")
            if length > self.max_frame_bytes:
                raise FrameError(f"frame of {length} bytes exceeds the limit of {self.max_frame_bytes}")
            end = LENGTH.size + length
            if len(self._buf) < end:
                break
            body = bytes(self._buf[LENGTH.size : end])
            del self._buf[:end]
            frames.append(decode_body(body, self.fmt))
        return frames


def decode_body(body: bytes, fmt: FrameFormat) -> Frame:
    """One frame's msgpack body (without its length prefix), validated against ``fmt``."""
    msg = bounded_unpack(body, FrameError, "frame", max_array_len=8, max_map_len=16)
    if not isinstance(msg, dict):
        raise FrameError(f"frame must be a map, got {type(msg).__name__}")
    kind = msg.get("t")
    if not isinstance(kind, str) or kind not in _FIELDS:
        raise FrameError(f"unknown frame type {kind!r:.40}")
    if set(msg) != _FIELDS[kind]:
        missing = sorted(_FIELDS[kind] - set(msg))
        extra = sorted(map(str, set(msg) - _FIELDS[kind]))
        raise FrameError(f"{kind} frame fields: missing {missing}, unexpected {extra}")
    if kind == "hello":
        return Hello(
            run=_str(msg, "run", MAX_ID),
            chain=_str(msg, "chain", MAX_ID),
            stage=_int(msg, "stage"),
            round=_int(msg, "round"),
            role=_str(msg, "role", 16),
            version=_int(msg, "v"),
            nonce=_bytes(msg, "nonce", (0, NONCE_BYTES)),
        )
    if kind == "hello_ok":
        return HelloOk()
    if kind == "challenge":
        return Challenge(_bytes(msg, "nonce", (NONCE_BYTES,)), _bytes(msg, "key", range(1, MAX_KEY_BYTES + 1)),
                         _bytes(msg, "sig", range(1, MAX_SIG_BYTES + 1)))
    if kind == "auth":
        return Auth(_bytes(msg, "key", range(1, MAX_KEY_BYTES + 1)), _bytes(msg, "sig", range(1, MAX_SIG_BYTES + 1)))
    if kind == "bye":
        return Bye()
    if kind == "close":
        return Close(_int(msg, "step"))
    if kind == "reject":
        return Reject(_str(msg, "reason", MAX_REASON, allow_empty=True))
    mb, step = _int(msg, "mb"), _int(msg, "step")
    shape = msg["shape"]
    if not (isinstance(shape, list) and len(shape) == 3 and all(type(s) is int for s in shape)):
        raise FrameError(f"{kind} shape must be three integers, got {shape!r:.60}")
    _check_shape(shape, fmt, FrameError)
    dtype = msg["dtype"]
    if not isinstance(dtype, str) or dtype not in WIRE_DTYPES:
        raise FrameError(f"{kind} dtype must be one of {sorted(WIRE_DTYPES)}, got {dtype!r:.40}")
    values = _floats(msg["data"], shape, WIRE_DTYPES[dtype], kind)
    if kind == "grads":
        return Grads(mb, step, values)
    return Activations(mb, step, _tokens(msg["tokens"], shape[:2], fmt), values)


def _check_shape(shape: List[int], fmt: FrameFormat, error: type) -> None:
    b, t, k = shape
    if not (1 <= b <= fmt.micro_batch and t == fmt.seq_len and k == fmt.k):
        raise error(f"shape {shape} does not match (1..{fmt.micro_batch}, {fmt.seq_len}, {fmt.k})")


def _floats(data: Any, shape: List[int], dtype: torch.dtype, kind: str) -> torch.Tensor:
    count = shape[0] * shape[1] * shape[2]
    size = torch.empty((), dtype=dtype).element_size()
    if not isinstance(data, bytes) or len(data) != count * size:
        raise FrameError(f"{kind} data must be {count * size} bytes, got {_describe(data)}")
    values = torch.frombuffer(bytearray(data), dtype=dtype).view(*shape)
    if not bool(torch.isfinite(values).all()):
        raise FrameError(f"{kind} data holds a non-finite value")
    return values


def _tokens(data: Any, shape: List[int], fmt: FrameFormat) -> torch.Tensor:
    width = fmt.token_width
    count = shape[0] * shape[1]
    if not isinstance(data, bytes) or len(data) != count * width:
        raise FrameError(f"activations tokens must be {count * width} bytes, got {_describe(data)}")
    ids = np.frombuffer(data, dtype=_ID_DTYPES[width]).astype(np.int64)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= fmt.vocab_size):
        raise FrameError(f"activations token ids must lie in [0, {fmt.vocab_size})")
    return torch.from_numpy(ids).view(shape[0], shape[1])


def _describe(v: Any) -> str:
    return f"{len(v)} bytes" if isinstance(v, bytes) else type(v).__name__


def _int(msg: Dict[str, Any], name: str) -> int:
    v = msg[name]
    if type(v) is not int or not 0 <= v < MAX_INT:
        raise FrameError(f"frame field {name!r} must be an integer in [0, 2^62), got {v!r:.40}")
    return v


def _bytes(msg: Dict[str, Any], name: str, lengths) -> bytes:
    v = msg[name]
    if not isinstance(v, bytes) or len(v) not in lengths:
        raise FrameError(f"frame field {name!r} must be bytes of an allowed length, got {_describe(v)}")
    return v


def _str(msg: Dict[str, Any], name: str, limit: int, allow_empty: bool = False) -> str:
    v = msg[name]
    if not isinstance(v, str) or len(v) > limit or (not v and not allow_empty):
        raise FrameError(f"frame field {name!r} must be a string of at most {limit} characters")
    return v


# --- handshake ---------------------------------------------------------------------------------


def check_hello(
    frame: Frame, *, run_digest: str, chain_id: str, stage: int, round: int, role: str, version: int = LINK_VERSION
) -> Hello:
    """Accept the neighbour's hello or raise FrameError with the reason to log and send back in a
    ``reject``. ``stage`` and ``role`` are what the neighbour must be (e.g. a stage i expecting its
    upstream neighbour passes ``stage=i - 1, role="upstream"``)."""
    if not isinstance(frame, Hello):
        raise FrameError(f"expected a hello frame, got {_TYPE_NAMES.get(type(frame), type(frame).__name__)}")
    if frame.version != version:
        raise FrameError(f"protocol version {frame.version} is not {version}")
    if frame.run != run_digest:
        raise FrameError(f"peer trains run spec {frame.run!r:.40}, not {run_digest!r}")
    if frame.chain != chain_id:
        raise FrameError(f"peer is in chain {frame.chain!r:.60}, not {chain_id!r}")
    if frame.role not in ROLES:
        raise FrameError(f"unknown role {frame.role!r:.40}")
    if frame.role != role or frame.stage != stage:
        raise FrameError(f"peer is stage {frame.stage} ({frame.role}), expected stage {stage} ({role})")
    if frame.round != round:
        raise FrameError(f"peer is at round {frame.round}, this stage at round {round}")
    return frame


__all__ = [
    "Frame", "Hello", "HelloOk", "Challenge", "Auth", "Reject", "Activations", "Grads", "Close", "Bye",
    "ROLES", "WIRE_DTYPES", "FrameFormat", "FrameDecoder", "encode_frame", "decode_body", "check_hello",
    "HANDSHAKE_MAX_BYTES", "NONCE_BYTES", "LINK_VERSION",
]
