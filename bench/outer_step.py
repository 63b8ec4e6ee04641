"""The CPU side of one round's exchange: what a member does between receiving its group's payloads
and the next θ, per model shape and group size, against the reference arithmetic.

    python bench/outer_step.py [--shapes 125m] [--groups 1,4,16] [--strategy sparseloco]
                               [--threads 2] [--repeats 2] [--inner-steps N] [--batch B] [--json OUT]

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

``--inner-steps N`` also runs N inner steps of the shape (after one warm-up step; batch ``--batch``
sequences of the shape's length, AdamW as a peer runs them) and prints the direction check's share of
a round's CPU: (conclude CPU seconds of ``current`` − those of ``no check``) / (H × one step's CPU
seconds + the ``current`` exchange's CPU seconds), H the spec's ``outer.inner_steps``. CPU seconds are
this process's (``time.process_time``: every thread). A smaller batch than the spec's gives a larger
share (the steps cost less, the check the same), so the figure is an upper bound for larger batches.
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
from bench.common import choose_names, exit_on_sigterm, machine, now, table, time_inner_steps  # noqa: E402
from peer.training.data import load_corpus  # noqa: E402
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


def reference_average(layout, decoded, over_choosers: bool = False, established=None, min_share: float = 0.0):
    """``peer.outer.strategies.average`` by its definition: with ``over_choosers``, the payloads that kept
    each coordinate counted in float32 and every coordinate divided by its count, or by ``min_share``
    of the payloads that carry the tensor where that is more. ``established`` is ignored: this
    bench's senders have no standing, so every weight is 1."""
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
            out[name] = acc.div_(kept.clamp_(min=max(1.0, min_share * len(parts))))
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
    cpu = {"conclude_cpu": float("inf"), "total_cpu": float("inf")}
    result = None
    for _ in range(repeats):
        # one engine encodes every member's payload (an encode leaves the strategy's buffers as
        # they are: what it sent is settled after the round), then concludes as member 0
        me = RoundEngine(strategies.make_strategy(spec), {n: t.clone() for n, t in theta.items()})
        # (only member 0's pending state is kept: each is two dense copies of the model)
        encoded, took, took_cpu = [], 0.0, 0.0
        for i in range(group):
            trained = trained_params(theta, i)
            t0, c0 = time.perf_counter(), time.process_time()
            data, pending = me.encode(me.theta, trained)
            took += time.perf_counter() - t0
            took_cpu += time.process_time() - c0
            encoded.append((data, pending if i == 0 else None))
            del trained, pending
        best["encode"] = min(best["encode"], took / group)
        payloads = {f"peer{i:02d}": data for i, (data, _) in enumerate(encoded)}
        t0, c0 = time.perf_counter(), time.process_time()
        decoded, invalid = me.decode(payloads)
        t1, c1 = time.perf_counter(), time.process_time()
        assert not invalid, invalid
        me.conclude(decoded, encoded[0][1], delivered=True)
        t2, c2 = time.perf_counter(), time.process_time()
        result = me.params_hash()
        t3, c3 = time.perf_counter(), time.process_time()
        for phase, dt in zip(PHASES[1:], (t1 - t0, t2 - t1, t3 - t2)):
            best[phase] = min(best[phase], dt)
        cpu["conclude_cpu"] = min(cpu["conclude_cpu"], c2 - c1)
        # a member encodes its own payload once: one encode's share of what all of them took
        cpu["total_cpu"] = min(cpu["total_cpu"], took_cpu / group + c3 - c0)
        del me, encoded, decoded
    return {**best, **cpu, "total": sum(best.values()), "theta": result}


def inner_step_cpu(spec: RunSpec, steps: int, batch: int) -> dict:
    """CPU and wall seconds of one inner step of ``spec``'s model at ``batch`` sequences (medians of
    ``steps``, after one warm-up step that makes AdamW's state), as a peer's InnerTrainer runs it."""
    _, _, wall, cpu = time_inner_steps(spec, load_corpus("stdlib"), steps, batch, shard="outer-step",
                                     keep_start=False)
    return {"step_cpu": sorted(cpu)[len(cpu) // 2], "step_wall": sorted(wall)[len(wall) // 2], "batch": batch}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="125m", help=f"comma-separated, of {', '.join(SHAPES)} (default 125m)")
    ap.add_argument("--groups", default="1,4,16", help="comma-separated group sizes G (default 1,4,16)")
    ap.add_argument("--strategy", default="sparseloco", choices=("sparseloco", "diloco", "dct"),
                    help="outer strategy (default sparseloco)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads, as a peer's --threads (default 2)")
    ap.add_argument("--repeats", type=int, default=2, help="timed repeats per arm, best kept (default 2)")
    ap.add_argument("--inner-steps", type=int, default=0, metavar="N",
                    help="also time N inner steps of each shape and print the direction check's share of a "
                         "round's CPU (default 0: not timed)")
    ap.add_argument("--batch", type=int, default=4, metavar="B",
                    help="sequences per inner step for --inner-steps (default 4; the 125m preset's spec says 16, "
                         "which needs about 30 GB here)")
    ap.add_argument("--json", type=Path, metavar="OUT", help="also write the rows as JSON to OUT")
    args = ap.parse_args(argv)
    shapes = choose_names(args.shapes, SHAPES, "--shapes")
    try:
        groups = [int(g) for g in args.groups.split(",")]
    except ValueError:
        ap.error(f"--groups must be comma-separated integers, got {args.groups!r}")
    if min(groups) < 1 or args.threads < 1 or args.repeats < 1 or args.batch < 1 or args.inner_steps < 0:
        ap.error("group sizes, --threads, --repeats and --batch must be >= 1, --inner-steps >= 0")
    exit_on_sigterm()
    torch.set_num_threads(args.threads)
    print(f"bench/outer_step.py: {now()}, {machine()}; {args.strategy}, {args.threads} threads", flush=True)
    rows, shares = [], []
    for shape in shapes:
        spec = RunSpec.model_validate({"model": SHAPES[shape], "outer": {"strategy": args.strategy}})
        steps = inner_step_cpu(spec, args.inner_steps, args.batch) if args.inner_steps else None
        if steps:
            print(f"  {shape} inner step, batch {args.batch}: {steps['step_cpu']:.2f} CPU s, "
                  f"{steps['step_wall']:.2f} s wall (median of {args.inner_steps})", flush=True)
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
            if steps:
                H = spec.outer.inner_steps
                check = arms["current"]["conclude_cpu"] - arms["no check"]["conclude_cpu"]
                round_cpu = H * steps["step_cpu"] + arms["current"]["total_cpu"]
                shares.append(dict(shape=shape, group=G, H=H, **steps, exchange_cpu=arms["current"]["total_cpu"],
                                   check_cpu=check, round_cpu=round_cpu, share=check / round_cpu))
    cols = ["shape", "params", "G", "arithmetic", "encode s (each)", "decode s", "conclude s", "hash s", "total s",
            "reference / this", "θ"]
    lines = [[r["shape"], f"{r['params'] / 1e6:.1f}M", str(r["group"]), r["arm"], f"{r['encode']:.3f}",
              f"{r['decode']:.3f}", f"{r['conclude']:.3f}", f"{r['hash']:.3f}", f"{r['total']:.3f}",
              f"{r['ratio']:.2f}x", r["theta"][:8]] for r in rows]
    print("\n" + table(cols, lines))
    if shares:
        cols = ["shape", "G", "batch", "step CPU s", "H", "exchange CPU s", "round CPU s", "check CPU s", "check share"]
        lines = [[r["shape"], str(r["group"]), str(r["batch"]), f"{r['step_cpu']:.2f}", str(r["H"]),
                  f"{r['exchange_cpu']:.2f}", f"{r['round_cpu']:.1f}", f"{r['check_cpu']:.2f}",
                  f"{100 * r['share']:.2f} %"] for r in shares]
        print("\nThe direction check's share of a round's CPU (H steps + one member's exchange):\n" + table(cols, lines))
    if args.json:
        args.json.write_text(strict_json(dict(date=now(), machine=machine(), args=vars(args) | {"json": str(args.json)},
                                              rows=rows, shares=shares), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
