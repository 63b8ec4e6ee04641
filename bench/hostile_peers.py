"""What a hostile peer process changes before it runs the real peer: one behaviour each.

bench/hostile.py starts a hostile *peer* as ``python bench/hostile.py --as-peer BEHAVIOUR -- PEER
FLAGS``: ``run_as_peer`` installs the behaviour (one function of ``BEHAVIOURS``, given the text after
``=``) and runs ``voloco peer`` unchanged, so everything but that one behaviour is the honest code.
Guarded by tests/bench/test_bench_hostile.py.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Dict, List

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))

import msgpack  # noqa: E402
import numpy as np  # noqa: E402


def scale_payload(data: bytes, factor: float) -> bytes:
    """The same payload with every float on the wire multiplied by ``factor`` (clamped finite)."""
    message = msgpack.unpackb(data, raw=False)
    dtype = np.dtype("<f2") if str(message["codec"]).endswith("fp16") else np.dtype("<f4")
    limit = float(np.finfo(dtype).max)
    for _, fields in message["t"]:
        for key in ("lut", "val", "data"):
            if key in fields:
                values = np.frombuffer(fields[key], dtype=dtype).astype(np.float64) * factor
                fields[key] = np.clip(values, -limit, limit).astype(dtype).tobytes()
    return msgpack.packb(message, use_bin_type=True)


def covert_payload(data: bytes, tiny: float = 1e-3) -> bytes:
    """The same SparseLoCo payload with each tensor's 2-bit table changed: the outer bins (its largest
    values) negated and scaled to carry the tensor's whole honest norm, the inner bins kept in sign at
    ``tiny`` of their size. Same indices and codes: most of its signs still agree with honest ones,
    while its mass points back (bench/trust.py's ``covert``, on the wire). Other codecs pass unchanged."""
    message = msgpack.unpackb(data, raw=False)
    for _, fields in message["t"]:
        if "lut" not in fields or "codes" not in fields:
            continue
        lut = np.frombuffer(fields["lut"], dtype="<f4").astype(np.float64)
        if lut.size != 4:
            continue
        raw = np.frombuffer(fields["codes"], dtype=np.uint8)
        codes = (np.unpackbits(raw, bitorder="little").reshape(-1, 2) * [1, 2]).sum(1)  # padding counts as bin 0
        counts = np.bincount(codes, minlength=4).astype(np.float64)
        honest = float((counts * lut ** 2).sum())
        outer, inner = counts[[0, 3]] @ lut[[0, 3]] ** 2, counts[[1, 2]] @ lut[[1, 2]] ** 2
        if outer <= 0:
            continue
        scale = max(honest - tiny ** 2 * inner, 0.0) ** 0.5 / outer ** 0.5
        new = np.array([-scale * lut[0], tiny * lut[1], tiny * lut[2], -scale * lut[3]])
        fields["lut"] = new.astype("<f4").tobytes()
    return msgpack.packb(message, use_bin_type=True)


def covert(arg: str) -> None:
    """Every payload this peer sends goes through ``covert_payload``; everything else stays honest."""
    from peer.outer.engine import RoundEngine

    encode = RoundEngine.encode

    def covered(self, round_start, trained, steps=None):
        data, pending = encode(self, round_start, trained, steps)
        return covert_payload(data), pending

    RoundEngine.encode = covered


def poison(arg: str) -> None:
    """Every payload this peer sends is scaled by float(arg); everything else stays honest."""
    from peer.outer.engine import RoundEngine

    factor, encode = float(arg), RoundEngine.encode

    def poisoned(self, round_start, trained, steps=None):
        data, pending = encode(self, round_start, trained, steps)
        return scale_payload(data, factor), pending

    RoundEngine.encode = poisoned


def serve_poison(arg: str) -> None:
    """The state this peer serves to newcomers is poisoned; it trains and exchanges honestly.
    ``shift``: θ plus noise of 1 % of each tensor's scale (finite and plausible: only the hash tells);
    ``huge``: θ times 1e30 (inf after the cast to float32)."""
    import torch

    from peer.round.state_sync import StateSync

    if arg not in ("shift", "huge"):
        raise SystemExit(f"serve-poison={arg!r}: shift or huge")
    shareable = StateSync.shareable_state

    def poisoned(self):
        meta, tensors = shareable(self)
        gen = torch.Generator().manual_seed(1)
        if arg == "huge":
            return meta, [t.double() * 1e30 for t in tensors]
        return meta, [t + 0.01 * (float(t.abs().mean()) + 1e-3) * torch.randn(t.shape, generator=gen) for t in tensors]

    StateSync.shareable_state = poisoned


def _opened(engine, encoded):
    """What RoundEngine.encode does after encoding: the round's payload is the open one (a redo's
    corrections wait for it to settle)."""
    with engine.lock:
        engine._open = encoded[1]
    return encoded


def noise(arg: str) -> None:
    """This peer trains honestly, then sends Gaussian noise in place of each tensor's pseudo-gradient,
    at that tensor's honest norm (times float(arg), default 1): an update of honest size that carries
    no information. The noise is seeded by the round, so every round's differs."""
    import torch

    from peer.outer.engine import RoundEngine
    from peer.outer.strategies import pseudo_gradient

    factor = float(arg or 1.0)

    def noisy(self, round_start, trained, steps=None):  # RoundEngine.encode with its pseudo-gradient replaced
        gen = torch.Generator().manual_seed(1_000_003 * int(self.round) + 7)
        sent = {}
        for name, delta in pseudo_gradient(dict(round_start), trained, self.strategy.layout).items():
            r = torch.randn(delta.shape, generator=gen).to(delta.device)
            sent[name] = r * (factor * float(delta.norm()) / (float(r.norm()) + 1e-12))
        return _opened(self, self.strategy.encode(sent, self.round, steps=steps))

    RoundEngine.encode = noisy


def negate_big(arg: str) -> None:
    """This peer trains honestly and sends its pseudo-gradient negated on its largest tensors (by
    size), a fraction float(arg) of them (default 0.2), honest on the rest: most of its mass points
    back while most of its tensors agree (bench/trust.py's ``negate-big``)."""
    import math

    from bench.common import largest
    from peer.outer.engine import RoundEngine
    from peer.outer.strategies import pseudo_gradient

    try:
        share = float(arg or 0.2)
    except ValueError:
        share = math.nan
    if not 0 < share <= 1:
        raise SystemExit(f"negate-big={arg!r}: a share of the tensors, above 0 and at most 1")

    def negated(self, round_start, trained, steps=None):  # RoundEngine.encode with its pseudo-gradient changed
        layout = self.strategy.layout
        big = largest({n: math.prod(s) for n, s in layout.items()}, share)
        delta = pseudo_gradient(dict(round_start), trained, layout)
        return _opened(self, self.strategy.encode({n: -t if n in big else t for n, t in delta.items()}, self.round,
                                                  steps=steps))

    RoundEngine.encode = negated


BEHAVIOURS: Dict[str, Callable[[str], None]] = {"poison": poison, "serve-poison": serve_poison, "noise": noise,
                                                  "covert": covert, "negate-big": negate_big}


def run_as_peer(behaviour: str, peer_flags: List[str]) -> int:
    kind, _, arg = behaviour.partition("=")
    if kind not in BEHAVIOURS:
        raise SystemExit(f"--as-peer {behaviour!r}: no behaviour {kind!r} (have: {', '.join(BEHAVIOURS)})")
    BEHAVIOURS[kind](arg)
    from voloco.cli import main

    return main(["peer", *peer_flags])
