"""The CPU side of one round's exchange: what a member does between receiving its group's payloads
and the next θ, per model shape and group size, against the reference arithmetic.

    python bench/outer_step.py [--shapes 125m] [--groups 1,4,16] [--strategy sparseloco]
                               [--threads 2] [--repeats 2] [--json OUT]

On a GPU peer this work bounds the round: the inner steps of the next round overlap it, but a
round cannot end before its exchange has (on an H100, the 125m preset, H = 30: 0.8 s of steps, a
3 s exchange; bench/RESULTS.md). For each shape and group size G: G members' pseudo-gradients
(θ after a small random step of each, a seed apiece, so their top-k supports differ), each
encoded by one engine (``RoundEngine.encode``: error feedback, top-k, quantization, index coding), then one
member's ``decode`` of the G payloads (validation included), ``conclude`` (checks, the direction
check, median-norm clipping, the aggregate, the outer step) and the θ hash, best of ``--repeats``.
The members' steps share a direction (a common random step plus one of their own), as trained
updates do, so the direction check (peer/outer/consensus.py) refuses none of them.

Three arms in one run, on the same payloads: ``current`` (the code as it is), ``no check``
(the same with ``outer.min_agreement = 0``: what the direction check costs) and ``reference``:
``peer.outer.robust.squared_norm`` and ``peer.outer.strategies.average`` replaced by their definitions (every
element squared and summed in order; the payloads that kept a coordinate counted in float32 and
every coordinate divided by it), as they were computed before they skipped what adds nothing.
Every arm must end on the same θ hash: the bench fails otherwise. Ratio: reference / the arm.
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import peer.outer.robust as robust  # noqa: E402
import peer.outer.strategies as strategies  # noqa: E402
from bench.common import choose_names, exit_on_sigterm, machine, now, table  # noqa: E402
from peer.training.model import build_model  # noqa: E402
from peer.outer.engine import RoundEngine  # noqa: E402
from protocol.spec import RunSpec  # noqa: E402
from swarm.jsonout import dumps as strict_json  # noqa: E402

SHAPES = {
    "tiny": {"d_model": 64, "n_layers": 2, "n_heads": 2, "ffn_hidden": 128, "seq_len": 64},
    "small": {"d_model": 384, "n_layers": 6, "n_heads": 6, "ffn_hidden": 1024, "seq_len": 64},
    "125m": {"preset": "125m"},
    "350m": {"preset": "350m"},
}
PHASES = ("encode", "decode", "conclude", "hash")


def reference_squared_norm(t: torch.Tensor):
    """``peer.outer.robust.squared_norm`` by its definition: every element squared in float64 and summed
    in order within each chunk, the chunks' sums in order (tests/outer/test_robust.py pins the bits to it)."""
    flat = t.detach().to("cpu", torch.float32).contiguous().reshape(-1).numpy()
    total, peak = 0.0, 0.0
    for start in range(0, flat.size, robust._CHUNK):
        part = flat[start:start + robust._CHUNK].astype(np.float64)
        peak = max(peak, float(np.abs(part).max()))
        np.multiply(part, part, out=part)
        total += float(np.cumsum(part)[-1])
    return total, peak


def reference_average(layout, decoded, over_choosers: bool = False, established=None):
    """``peer.outer.strategies.average`` by its definition: with ``over_choosers``, the payloads that kept
    each coordinate counted in float32 and every coordinate divided by its count. ``established`` is
    ignored: this bench's senders have no standing, so every weight is 1."""
    out = {}
    for name in layout:
        parts = [d[name] for d in decoded if name in d]
        if not parts:
            continue
        acc = parts[0].clone()
        for t in parts[1:]:
            acc.add_(t)
        if over_choosers:
            kept = sum(((t != 0).to(torch.float32) for t in parts[1:]), (parts[0] != 0).to(torch.float32))
            out[name] = acc.div_(kept.clamp_(min=1.0))
        else:
            out[name] = acc.div_(len(parts))
    return out


@contextmanager
def arithmetic(arm: str):
    saved = robust.squared_norm, strategies.average
    if arm == "reference":
        robust.squared_norm, strategies.average = reference_squared_norm, reference_average
    try:
        yield
    finally:
        robust.squared_norm, strategies.average = saved


def trained_params(theta, member: int):
    """Member ``member``'s parameters after its inner steps: θ plus a small step, a direction every
    member shares and one of its own seed (their top-k supports differ, their signs mostly agree)."""
    common, g = torch.Generator().manual_seed(999), torch.Generator().manual_seed(1000 + member)
    return {n: t + 1e-3 * (torch.randn(t.shape, generator=common) + torch.randn(t.shape, generator=g))
            for n, t in theta.items()}


def one_exchange(spec: RunSpec, theta, group: int, repeats: int) -> dict:
    """Best-of timings of one member's exchange in a group of ``group``, and its θ hash. Each
    member's parameters are made, encoded and dropped in turn: a real member holds its own alone,
    and 16 models' worth of them held at once slowed this process's decode five-fold."""
    best = {p: float("inf") for p in PHASES}
    result = None
    for _ in range(repeats):
        # one engine encodes every member's payload (an encode leaves the strategy's buffers as
        # they are: what it sent is settled after the round), then concludes as member 0
        me = RoundEngine(strategies.make_strategy(spec), {n: t.clone() for n, t in theta.items()})
        # (only member 0's pending state is kept: each is two dense copies of the model)
        encoded, took = [], 0.0
        for i in range(group):
            trained = trained_params(theta, i)
            t0 = time.perf_counter()
            data, pending = me.encode(me.theta, trained)
            took += time.perf_counter() - t0
            encoded.append((data, pending if i == 0 else None))
            del trained, pending
        best["encode"] = min(best["encode"], took / group)
        payloads = {f"peer{i:02d}": data for i, (data, _) in enumerate(encoded)}
        t0 = time.perf_counter()
        decoded, invalid = me.decode(payloads)
        t1 = time.perf_counter()
        assert not invalid, invalid
        me.conclude(decoded, encoded[0][1], delivered=True)
        t2 = time.perf_counter()
        result = me.params_hash()
        t3 = time.perf_counter()
        for phase, dt in zip(PHASES[1:], (t1 - t0, t2 - t1, t3 - t2)):
            best[phase] = min(best[phase], dt)
        del me, encoded, decoded
    return {**best, "total": sum(best.values()), "theta": result}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="125m", help=f"comma-separated, of {', '.join(SHAPES)} (default 125m)")
    ap.add_argument("--groups", default="1,4,16", help="comma-separated group sizes G (default 1,4,16)")
    ap.add_argument("--strategy", default="sparseloco", choices=("sparseloco", "diloco", "dct"),
                    help="outer strategy (default sparseloco)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads, as a peer's --threads (default 2)")
    ap.add_argument("--repeats", type=int, default=2, help="timed repeats per arm, best kept (default 2)")
    ap.add_argument("--json", type=Path, metavar="OUT", help="also write the rows as JSON to OUT")
    args = ap.parse_args(argv)
    shapes = choose_names(args.shapes, SHAPES, "--shapes")
    try:
        groups = [int(g) for g in args.groups.split(",")]
    except ValueError:
        ap.error(f"--groups must be comma-separated integers, got {args.groups!r}")
    if min(groups) < 1 or args.threads < 1 or args.repeats < 1:
        ap.error("group sizes, --threads and --repeats must be >= 1")
    exit_on_sigterm()
    torch.set_num_threads(args.threads)
    print(f"bench/outer_step.py: {now()}, {machine()}; {args.strategy}, {args.threads} threads", flush=True)
    rows = []
    for shape in shapes:
        spec = RunSpec.model_validate({"model": SHAPES[shape], "outer": {"strategy": args.strategy}})
        theta = {n: p.detach().clone() for n, p in build_model(spec.model, spec.seed).named_parameters()}
        params = sum(t.numel() for t in theta.values())
        unchecked = spec.replace(outer={"min_agreement": 0.0})
        for G in groups:
            arms = {}
            for arm in ("reference", "current", "no check"):
                with arithmetic(arm):
                    arms[arm] = one_exchange(unchecked if arm == "no check" else spec, theta, G, args.repeats)
                r = arms[arm]
                print(f"  {shape} G={G} {arm:9s}: " + ", ".join(f"{p} {r[p]:.3f} s" for p in PHASES), flush=True)
            if len({r["theta"] for r in arms.values()}) != 1:
                raise SystemExit(f"{shape} G={G}: the arms ended on different θ "
                                 f"({', '.join(a + ' ' + r['theta'] for a, r in arms.items())})")
            for arm, r in arms.items():
                rows.append(dict(shape=shape, params=params, group=G, arm=arm, **r,
                                 ratio=arms["reference"]["total"] / r["total"]))
    cols = ["shape", "params", "G", "arithmetic", "encode s (each)", "decode s", "conclude s", "hash s", "total s",
            "reference / this", "θ"]
    lines = [[r["shape"], f"{r['params'] / 1e6:.1f}M", str(r["group"]), r["arm"], f"{r['encode']:.3f}",
              f"{r['decode']:.3f}", f"{r['conclude']:.3f}", f"{r['hash']:.3f}", f"{r['total']:.3f}",
              f"{r['ratio']:.2f}x", r["theta"][:8]] for r in rows]
    print("\n" + table(cols, lines))
    if args.json:
        args.json.write_text(strict_json(dict(date=now(), machine=machine(), args=vars(args) | {"json": str(args.json)},
                                              rows=rows), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
