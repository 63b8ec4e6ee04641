"""Peers of mixed speeds: what the median-norm clip costs a round whose slower peers closed it early.

    python bench/mixed_speed.py [--quick] [--shapes 2/1,4/1,4/3] [--strategies sparseloco,diloco]
                                [--clips uncounted,counted,off] [--amplifier] [--seeds 3] [--jobs 2]
                                [--threads 1] [--json OUT]

A slower peer closes its round early, after a quarter of H at least (``outer.min_inner_fraction``,
peer/round/early_close.py), and its update covers fewer steps, so its norm is smaller. The clip
(peer/outer/robust.py) holds each update to 1.5x the round's lower median norm: where the early
closers are half the round or more, that median is theirs, and the peers that trained all H steps
are clipped to it. Each payload now says how many steps its update covers, and the clip compares
an update with the others' norms scaled to its own steps (``robust.medians_at_steps``).

Every arm is ``peer.round.simulate.simulate`` (every replica the real round engine: its own model,
data shard, AdamW, error feedback; real payloads; θ asserted bit-identical every round). A shape
R/S has R replicas whose first S train a quarter of H a round, rounded up, and claim as much (the
least an early close leaves: ``min_steps``); the others train H. Clip arms, paired by seed:

- ``uncounted``: the clip as it was before payloads counted steps (every norm compared as is);
- ``counted``: the clip of today (each norm compared at the update's own steps, scaled in
  proportion: ``robust.STEP_POWER`` = 1);
- ``sqrt`` (not run by default): scaled by the square root of the steps' ratio instead, a rule that
  grants an amplifier less and a full-speed peer less too;
- ``off``: no median clip (the finite checks stay): what the clip costs at all.

``--amplifier``: one more replica, hostile, that trains H steps honestly, claims H and sends its
update x1e4: what a counted clip lets an amplifier keep in a round of early closers (its baseline
is the same shape without it, same clip).

The gap is paired by seed against ``off``: (loss / loss with clip off) - 1, mean ± spread over the
seeds. Clipped: the share of the full-speed replicas' contributions the clip scaled, and the
smallest scale, from replica 0's view (every replica decides alike).
"""

from __future__ import annotations

import argparse
import functools
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import add_arm_flags, run_summarized, spread, table  # noqa: E402
from bench.compression import make_spec  # noqa: E402
from bench.trust import CONFIGS  # noqa: E402

CLIPS = ("uncounted", "counted", "off")
POWERS = {"uncounted": 0.0, "sqrt": 0.5}  # robust.medians_at_steps' power in these arms (counted: robust.STEP_POWER)
AMPLIFY = 1e4
HOSTILE = "hostile"


@functools.lru_cache(maxsize=1)
def corpus():
    """The default corpus, read once per worker process (reading it takes longer than an arm)."""
    from peer.training.data import load_corpus

    return load_corpus("stdlib")


def run_arm(job) -> Dict[str, Any]:
    """One simulation: (cfg, R, S slow, strategy, clip arm, amplifier, seed, threads)."""
    import math

    from peer.outer.robust import CLIP_MULTIPLE, STEP_POWER
    from peer.outer.strategies import OuterStrategy
    from peer.round.simulate import simulate
    from protocol.round.round_policy import min_steps

    cfg, R, S, strategy, clip, amplifier, seed, threads = job
    torch.set_num_threads(threads)
    logging.getLogger("voloco.peer.robust").setLevel(logging.ERROR)
    OuterStrategy.clip_multiple = math.inf if clip == "off" else CLIP_MULTIPLE  # a worker runs many arms: set both ways
    OuterStrategy.step_power = POWERS.get(clip, STEP_POWER)
    spec = make_spec(cfg, {"strategy": strategy}, {}, cfg["steps"], seed)
    H = cfg["inner_steps"]
    shards = [f"replica{i}" for i in range(R)] + ([f"{HOSTILE}0"] if amplifier else [])
    factor = torch.tensor(AMPLIFY, dtype=torch.float32)

    def tamper(round_no, sender, decoded):
        return {n: t * factor for n, t in decoded.items()} if sender.startswith(HOSTILE) else decoded

    t = time.monotonic()
    rounds = max(1, cfg["steps"] // H)
    slow = min_steps(H, spec.outer.min_inner_fraction)  # the least an early close leaves
    res = simulate(spec, len(shards), rounds, corpus=corpus(), seed_shards=shards, eval_every=0,
                   steps=lambda i, r: slow if i < S else H, tamper=tamper if amplifier else None)
    fast = set(shards[S:R])
    scales = [h.clipped.get(s, 1.0) for h in res.history for s in fast]
    row = dict(R=R, slow=S, strategy=strategy, clip=clip, amplifier=amplifier, seed=seed, val_loss=res.final_val_loss,
               fast_clipped=sum(1 for x in scales if x < 1.0), fast_sent=len(scales), min_scale=min(scales, default=1.0),
               hostile_scale=min((h.clipped.get(f"{HOSTILE}0", 1.0) for h in res.history), default=1.0),
               wall_s=time.monotonic() - t)
    print(f"  {R}/{S} {strategy} clip {clip}{' +amplifier' if amplifier else ''} seed {seed}: val {row['val_loss']:.4f}, "
          f"fast clipped {row['fast_clipped']}/{row['fast_sent']} (min scale {row['min_scale']:.3f}), "
          f"{row['wall_s']:.0f} s", flush=True)
    return row


def summarize(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per (R, S, strategy, clip, amplifier): loss over seeds, the gap paired with the clip-off run of its seed
    (same shape, no amplifier) and, for an amplifier arm, with the same clip without it."""
    loss = {(r["R"], r["slow"], r["strategy"], r["clip"], r["amplifier"], r["seed"]): r["val_loss"] for r in rows}
    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["R"], r["slow"], r["strategy"], r["clip"], r["amplifier"]), []).append(r)
    out = []
    for (R, S, strategy, clip, amplifier), rs in groups.items():
        off = [r["val_loss"] / loss[(R, S, strategy, "off", False, r["seed"])] - 1 for r in rs
               if (R, S, strategy, "off", False, r["seed"]) in loss]
        alone = [r["val_loss"] / loss[(R, S, strategy, clip, False, r["seed"])] - 1 for r in rs
                 if amplifier and (R, S, strategy, clip, False, r["seed"]) in loss]
        out.append(dict(R=R, slow=S, strategy=strategy, clip=clip, amplifier=amplifier, seeds=len(rs),
                        loss=statistics.fmean(r["val_loss"] for r in rs),
                        gap=statistics.fmean(off) if off else None, gap_std=spread(off),
                        vs_alone=statistics.fmean(alone) if alone else None, vs_alone_std=spread(alone),
                        fast_clipped=sum(r["fast_clipped"] for r in rs), fast_sent=sum(r["fast_sent"] for r in rs),
                        min_scale=min(r["min_scale"] for r in rs),
                        hostile_scale=max(r["hostile_scale"] for r in rs) if amplifier else None))
    return out


def show(summary: List[Dict[str, Any]]) -> None:
    pct = lambda m, s: "-" if m is None else f"{100 * m:+.2f} % ± {100 * s:.2f}"  # noqa: E731
    lines = [[f"{s['R']}/{s['slow']}", s["strategy"], s["clip"] + (" +amp" if s["amplifier"] else ""), str(s["seeds"]),
              f"{s['loss']:.4f}", pct(s["gap"], s["gap_std"]), pct(s["vs_alone"], s["vs_alone_std"]),
              f"{s['fast_clipped']}/{s['fast_sent']}", f"{s['min_scale']:.3f}",
              "-" if s["hostile_scale"] is None else f"{s['hostile_scale']:.2e}"] for s in summary]
    print(table(["R/slow", "strategy", "clip", "seeds", "val loss", "vs clip off (paired)", "vs no amplifier",
                 "fast clipped", "min scale", "amplifier kept at most"], lines, left=3))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 rounds of H = 10: a smoke run of every arm")
    ap.add_argument("--shapes", default="2/1,4/1,4/3",
                    help="comma-separated R/S: R replicas, the first S of them slow (default 2/1,4/1,4/3)")
    ap.add_argument("--strategies", default="sparseloco", help="comma-separated outer strategies (default sparseloco)")
    ap.add_argument("--clips", default=",".join(CLIPS),
                    help=f"comma-separated clip arms: {', '.join(CLIPS)} or sqrt (default {','.join(CLIPS)}; off always runs)")
    ap.add_argument("--amplifier", action="store_true",
                    help="also run each shape with one more replica that sends its update x1e4 (clip arms but off)")
    add_arm_flags(ap)
    args = ap.parse_args(argv)
    cfg = dict(CONFIGS["quick" if args.quick else "full"])
    try:
        shapes = [tuple(int(x) for x in s.split("/")) for s in args.shapes.split(",") if s]
    except ValueError:
        ap.error(f"--shapes is R/S,R/S..., got {args.shapes!r}")
    if any(len(s) != 2 or not 0 <= s[1] <= s[0] or s[0] < 1 for s in shapes):
        ap.error(f"each shape is R/S with 0 <= S <= R and R >= 1, got {args.shapes!r}")
    clips = [c for c in args.clips.split(",") if c]
    if any(c not in CLIPS and c not in POWERS for c in clips):
        ap.error(f"--clips takes {', '.join(CLIPS)}, got {args.clips!r}")
    strategies = [s for s in args.strategies.split(",") if s]
    jobs = [(cfg, R, S, st, clip, False, seed, args.threads)
            for st in strategies for R, S in shapes for clip in dict.fromkeys(clips + ["off"]) for seed in range(args.seeds)]
    if args.amplifier:
        jobs += [(cfg, R, S, st, clip, True, seed, args.threads)
                 for st in strategies for R, S in shapes for clip in clips if clip != "off" for seed in range(args.seeds)]
    print(f"# bench/mixed_speed.py: {len(jobs)} simulations, {args.jobs} at a time", flush=True)
    run_summarized(run_arm, jobs, args.jobs, summarize, show, args.json, config=cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
