"""Hostile contributions of honest size, in the in-process simulation: what the direction check
(peer/outer/consensus.py) stops, what it costs honest runs, and whom it refuses.

    python bench/trust.py [--quick | --config full|peers|quick] [--honest 3,6] [--hostile 1,2,3]
                          [--attacks negate,negate-third,negate-big,turncoat,turncoat-noise,noise,garbage,garbage-ascii,scale,amplify,covert]
                          [--kinds slow,other-data,partial]
                          [--seeds 3] [--checks on,off] [--no-controls] [--jobs 2] [--threads 1] [--json OUT]

Every arm is ``peer.round.simulate.simulate``: R honest replicas and K hostile ones, every one the
real round loop (its own model copy, data shard, AdamW and SparseLoCo error feedback, its own round
engine that checks, screens, clips, aggregates and applies). A hostile replica trains honestly and
what it sends is made hostile (``tamper``: the same for every member, as a signed payload is):

- negate: its own honest pseudo-gradient, negated: honest norm, the opposite direction;
- negate-third: the same negation on every third of its tensors (in the order it sends them), the
  others honest: what the direction check, one test per tensor, lets through (docs/trust.md);
- negate-big: the same negation on its largest tensors (by size), a fifth of them (``BIG_SHARE``):
  the embedding, the head and both attention inputs here, 43 % of the parameters, while most of its
  tensors agree;
- turncoat: honest for its first ``TURN`` rounds (standing earned: protocol/round/standing.py's
  ESTABLISHED), then negated: a patient attacker, judged as an established sender when it turns;
- turncoat-noise: the same patient attacker, then noise (as ``noise``): no direction at all, which
  an established sender is not refused for unless it points against the others;
- noise: Gaussian noise of its honest norm, on the coordinates it would have sent;
- garbage: honest training on uniformly random tokens (a peer fed garbage data);
- garbage-ascii: the same on uniformly random bytes 1..127, as bench/hostile.py's real garbage peer
  trains: ASCII shares with Python source what a byte model learns first;
- scale: its honest contribution x1e4 (what the median-norm clip is for, for comparison);
- amplify: its honest contribution x1.45, just below the clip's 1.5x the median for a sender of a
  typical norm: the most an amplifier can hope to keep, since it must send before it sees the
  round's median;
- covert: honest signs on its coordinates at a thousandth of their magnitude, its largest quarter
  (``COVERT``) negated and carrying its whole honest norm: four values a tensor, as SparseLoCo's
  2-bit table can send. Its signs mostly agree with the others'; its mass points back.

Honest replicas that differ from the rest must not be refused (``--kinds``, 4 honest replicas and
nobody hostile, replica 0 being the odd one): ``slow`` trains a quarter of H each round (the
least an early close leaves, ``outer.min_inner_fraction``; its payloads say so, as a live peer's
that closed early do); ``other-data`` trains on English prose (this repository's docs/ and
README.md) while the others train on Python sources; ``partial``: every
replica owns one of 2 slices (protocol/model/partial.py), 2 owners a slice. Their baseline is the same arm
with the check off: what the check costs an honest run.

The baseline of an attacked arm is the R honest replicas alone, with the same seed and shards: equal
honest tokens. The loss gap is paired by seed, (attacked / clean) - 1, mean ± std over the seeds. Its
control is R + K honest replicas (the K as honest ones, same seed; shards replica0.., so the first R
are the attacked run's honest ones): what K more contributors of any kind do to this small run's loss,
the noise an attacked arm's gap is to be read against. With
``--checks off`` the direction check is off (``outer.min_agreement = 0``): what the attack does
without it. Counted over every round: honest contributions refused (false exclusions) and hostile
ones refused, from replica 0's view (every replica decides alike; the simulation asserts θ equal).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
import zlib
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import add_arm_flags, largest, machine, now, run_jobs, spread, table  # noqa: E402
from bench.compression import make_spec  # noqa: E402
from swarm.jsonout import dumps as strict_json  # noqa: E402

ATTACKS = ("negate", "negate-third", "negate-big", "turncoat", "turncoat-noise", "noise", "garbage", "garbage-ascii", "scale", "amplify", "covert")
COVERT = 0.25  # the share of its coordinates a covert sender flips: its largest
BIG_SHARE = 0.2  # the share of its tensors, the largest, a negate-big sender negates (here: embedding, head, both qkv)
TURN = 4  # rounds a turncoat sends honest updates: one more than standing.ESTABLISHED
AMPLIFY = 1.45
KINDS = ("slow", "other-data", "partial")  # honest replicas unlike the others
KIND_REPLICAS = 4
REPO = Path(__file__).resolve().parents[1]
CONFIGS = {
    # the compression bench's small model, 12 rounds of H = 20 (240 inner steps a replica)
    "full": dict(model=dict(d_model=64, n_layers=2, n_heads=4, ffn_hidden=176, seq_len=32),
                 batch_size=8, inner_steps=20, steps=240, lr=3e-3, warmup=20),
    # bench/hostile.py's real peers: the default model (d 128, 4 layers, seq 128), batch 16, 4 rounds of
    # H = 30 at the spec's lr (warm-up 30 of 3,000 steps): where a garbage peer's first rounds show
    "peers": dict(model=dict(), batch_size=16, inner_steps=30, steps=120, lr=2e-3, warmup=30, total_steps=3000),
    "quick": dict(model=dict(d_model=64, n_layers=2, n_heads=4, ffn_hidden=176, seq_len=32),
                  batch_size=8, inner_steps=10, steps=40, lr=3e-3, warmup=5),
}
HOSTILE = "hostile"  # the shard prefix of hostile replicas ("replica" for the honest ones)


def prose_corpus():
    """English prose: this repository's docs/ and README.md, as one corpus (bytes)."""
    import shutil
    import tempfile

    from peer.training.data import load_corpus

    with tempfile.TemporaryDirectory() as tmp:
        for path in sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]:
            shutil.copy(path, Path(tmp) / path.name)
        return load_corpus(tmp)


class RandomTokens:
    """A training stream of uniformly random tokens in [low, vocab): what a peer fed garbage trains on."""

    def __init__(self, stream, vocab: int, seed: int, low: int = 0):
        self.stream, self.vocab, self.low = stream, vocab, low
        self.gen = torch.Generator().manual_seed(seed)

    def next_batch(self):
        chunk = torch.randint(self.low, self.vocab, (self.stream.batch_size, self.stream.seq_len + 1), generator=self.gen)
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


def covert(t: torch.Tensor) -> torch.Tensor:
    """Honest signs on most coordinates at a tiny magnitude, the largest ``COVERT`` of them flipped and
    carrying the whole honest norm: four values a tensor, as a 2-bit codebook can send."""
    kept = t != 0
    n = int(kept.sum())
    if n == 0:
        return t
    flip = max(1, int(COVERT * n))
    mags = t.abs().flatten()
    top = torch.zeros_like(mags, dtype=torch.bool)
    top[torch.topk(mags, flip).indices] = True
    top = top.view_as(t)
    small = 1e-3 * float(mags[kept.flatten()].mean())
    large = (max(float(t.norm()) ** 2 - small ** 2 * (n - flip), 0.0) / flip) ** 0.5
    return torch.where(top, -torch.sign(t) * large, torch.sign(t) * small).to(t.dtype)


def make_tamper(attack: str):
    def tamper(round_no: int, sender: str, decoded):
        if not sender.startswith(HOSTILE) or attack in ("garbage", "garbage-ascii"):
            return decoded
        if attack == "negate" or (attack == "turncoat" and round_no >= TURN):
            return {n: -t for n, t in decoded.items()}
        if attack in ("turncoat", "turncoat-noise") and round_no < TURN:
            return decoded
        if attack == "negate-third":
            return {n: -t if k % 3 == 0 else t for k, (n, t) in enumerate(decoded.items())}
        if attack == "negate-big":  # the largest tensors, BIG_SHARE of them: most of its mass
            big = largest({n: t.numel() for n, t in decoded.items()}, BIG_SHARE)
            return {n: -t if n in big else t for n, t in decoded.items()}
        if attack == "covert":
            return {n: covert(t) for n, t in decoded.items()}
        if attack in ("scale", "amplify"):
            factor = torch.tensor(1e4 if attack == "scale" else AMPLIFY, dtype=torch.float32)
            return {n: t * factor for n, t in decoded.items()}
        gen = torch.Generator().manual_seed(zlib.crc32(f"{round_no}/{sender}".encode()))
        out = {}
        for n, t in decoded.items():
            x = torch.randn(t.shape, generator=gen) * (t != 0)
            out[n] = x * (t.norm() / (x.norm() + 1e-30))
        return out
    return tamper


def run_arm(job) -> Dict[str, Any]:
    """One simulation: (cfg, honest R, hostile K, attack or honest kind or None, check on, seed, threads)."""
    from peer.round.simulate import simulate
    from peer.training.data import TrainStream, load_corpus
    from protocol.round.round_policy import min_steps

    cfg, honest, hostile, attack, check, seed, threads = job
    torch.set_num_threads(threads)
    logging.getLogger("voloco.peer.robust").setLevel(logging.ERROR)  # every replica logs every refusal: counted below
    outer = {"strategy": "sparseloco", "min_agreement": 3.0 if check else 0.0}
    if cfg.get("fresh_agreement") is not None:
        outer["fresh_agreement"] = cfg["fresh_agreement"]
    spec = make_spec(cfg, outer, {}, cfg["steps"], seed)
    shards = [f"replica{i}" for i in range(honest)] + [f"{HOSTILE}{k}" for k in range(hostile)]
    parts = None
    if attack == "partial":
        spec, parts = spec.replace(partial={"slices": 2}), [i % 2 for i in range(honest)]
    prose = prose_corpus() if attack == "other-data" else None

    def on_replica(i, role):
        if attack == "garbage" and shards[i].startswith(HOSTILE):
            role.stream = RandomTokens(role.stream, spec.model.vocab_size, seed * 1000 + i)
        elif attack == "garbage-ascii" and shards[i].startswith(HOSTILE):
            role.stream = RandomTokens(role.stream, 128, seed * 1000 + i, low=1)
        elif attack == "other-data" and i == 0:
            role.stream = TrainStream(prose, spec.model.seq_len, spec.data.batch_size, spec.seed, shards[i])

    slow = min_steps(cfg["inner_steps"], spec.outer.min_inner_fraction)  # the least an early close leaves
    t = time.monotonic()
    rounds = max(1, cfg["steps"] // cfg["inner_steps"])
    res = simulate(spec, len(shards), rounds, corpus=load_corpus("stdlib"), seed_shards=shards, eval_every=0,
                   tamper=make_tamper(attack) if attack in ATTACKS else None, on_replica=on_replica, parts=parts,
                   steps=lambda i, r: slow if attack == "slow" and i == 0 else cfg["inner_steps"])
    refused = [s for h in res.history for s in h.excluded]
    dropped = [s for h in res.history for s, names in h.dropped.items() for _ in names]  # one entry a tensor
    z_honest = [z for h in res.history for s, z in h.scores.items() if not s.startswith(HOSTILE)]
    z_hostile = [z for h in res.history for s, z in h.scores.items() if s.startswith(HOSTILE)]
    row = dict(honest=honest, hostile=hostile, attack=attack or "clean", check=check, seed=seed,
               val_loss=res.final_val_loss, rounds=rounds,
               honest_refused=sum(1 for s in refused if not s.startswith(HOSTILE)),
               hostile_refused=sum(1 for s in refused if s.startswith(HOSTILE)),
               honest_dropped=sum(1 for s in dropped if not s.startswith(HOSTILE)),
               hostile_dropped=sum(1 for s in dropped if s.startswith(HOSTILE)),
               hostile_sent=hostile * rounds, wall_s=time.monotonic() - t,
               z_honest=(min(z_honest), max(z_honest)) if z_honest else None,
               z_hostile=(min(z_hostile), max(z_hostile)) if z_hostile else None)
    print(f"  R={honest} K={hostile} {row['attack']:8s} check {'on ' if check else 'off'} seed {seed}: "
          f"val {row['val_loss']:.4f}, refused honest {row['honest_refused']} hostile {row['hostile_refused']}/"
          f"{row['hostile_sent']}, tensors left out honest {row['honest_dropped']} hostile {row['hostile_dropped']}, "
          f"{row['wall_s']:.0f} s", flush=True)
    return row


def control(r: Dict[str, Any]) -> tuple:
    """The key of an attacked arm's control: R + K honest replicas, same check and seed."""
    return r["honest"] + r["hostile"], 0, "clean", r["check"], r["seed"]


def baseline(r: Dict[str, Any]) -> tuple:
    """The key of the run an arm is compared with, seed by seed: an attacked arm with the honest
    replicas alone (same check), an honest arm (clean, or an odd kind) with itself, check off."""
    if r["attack"] in ATTACKS:
        return r["honest"], 0, "clean", r["check"], r["seed"]
    return r["honest"], 0, r["attack"], False, r["seed"]


def summarize(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per (R, K, attack, check): loss over seeds and the gap paired with its baseline's run of its seed."""
    loss = {(r["honest"], r["hostile"], r["attack"], r["check"], r["seed"]): r["val_loss"] for r in rows}
    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["honest"], r["hostile"], r["attack"], r["check"]), []).append(r)
    out = []
    for (honest, hostile, attack, check), rs in groups.items():
        gaps = [r["val_loss"] / loss[baseline(r)] - 1 for r in rs
                if baseline(r) in loss and baseline(r) != (honest, hostile, attack, check, r["seed"])]
        controls = [r["val_loss"] / loss[control(r)] - 1 for r in rs if attack in ATTACKS and control(r) in loss]
        out.append(dict(
            honest=honest, hostile=hostile, attack=attack, check=check, seeds=len(rs),
            loss=statistics.fmean(r["val_loss"] for r in rs),
            gap=statistics.fmean(gaps) if gaps else None, gap_std=spread(gaps),
            gap_max=max(gaps) if gaps else None,
            vs_control=statistics.fmean(controls) if controls else None, vs_control_std=spread(controls),
            honest_refused=sum(r["honest_refused"] for r in rs),
            honest_sent=sum(r["honest"] * r["rounds"] for r in rs),
            hostile_refused=sum(r["hostile_refused"] for r in rs), hostile_sent=sum(r["hostile_sent"] for r in rs),
            honest_dropped=sum(r.get("honest_dropped", 0) for r in rs),
            hostile_dropped=sum(r.get("hostile_dropped", 0) for r in rs),
            z_honest=_span(r["z_honest"] for r in rs), z_hostile=_span(r["z_hostile"] for r in rs),
        ))
    return out


def _span(spans):
    """The (min, max) over (min, max) pairs, None where there were none."""
    spans = [s for s in spans if s]
    return (min(s[0] for s in spans), max(s[1] for s in spans)) if spans else None


def _z(span) -> str:
    return "-" if not span else f"{span[0]:+.1f} .. {span[1]:+.1f}"


def print_summary(summary: List[Dict[str, Any]]) -> None:
    lines = []
    for s in summary:
        gap = "-" if s["gap"] is None else (
            f"{100 * s['gap']:+.2f} % ± {100 * s['gap_std']:.2f} (max {100 * s['gap_max']:+.2f})")
        vs = "-" if s.get("vs_control") is None else f"{100 * s['vs_control']:+.2f} % ± {100 * s['vs_control_std']:.2f}"
        lines.append([f"{s['honest']} + {s['hostile']}", s["attack"], "on" if s["check"] else "off", str(s["seeds"]),
                      f"{s['loss']:.4f}", gap, vs, f"{s['honest_refused']}/{s['honest_sent']}",
                      f"{s['hostile_refused']}/{s['hostile_sent']}" if s["hostile"] else "-",
                      f"{s.get('honest_dropped', 0)} / {s.get('hostile_dropped', 0)}",
                      _z(s["z_honest"]), _z(s["z_hostile"])])
    print(table(["honest + hostile", "attack", "check", "seeds", "val loss", "vs baseline (paired)",
                 "vs R + K honest", "honest refused",
                 "hostile refused", "tensors left out (honest / hostile)", "honest z", "hostile z"], lines, left=3))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shape = ap.add_mutually_exclusive_group()
    shape.add_argument("--quick", action="store_true", help="4 rounds of H = 10: a smoke run of every arm")
    shape.add_argument("--config", choices=sorted(CONFIGS), default=None,
                    help="full (default: a d 64, 2-layer model, 12 rounds of H = 20), peers (bench/hostile.py's "
                         "real peers' shape: d 128, 4 layers, 4 rounds of H = 30) or quick (as --quick)")
    ap.add_argument("--honest", default="3,6", help="comma-separated numbers of honest replicas (default 3,6)")
    ap.add_argument("--hostile", default="1,2,3", help="comma-separated numbers of hostile replicas (default 1,2,3)")
    ap.add_argument("--attacks", default=",".join(ATTACKS), help=f"comma-separated attacks (default: {','.join(ATTACKS)})")
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help=f"comma-separated odd honest replicas, {KIND_REPLICAS} honest replicas each, check on and off "
                         f"(default: {','.join(KINDS)}; '' for none)")
    ap.add_argument("--checks", default="on,off",
                    help="direction check on, off or both (default on,off; 'off' runs only the negate attack, "
                         "the one the check exists for, unless it is the only setting)")
    ap.add_argument("--no-controls", dest="controls", action="store_false",
                    help="skip the R + K honest runs an attacked arm is also compared with (default: run them)")
    ap.add_argument("--fresh-agreement", type=float, metavar="F",
                    help="outer.fresh_agreement with the check on: the share of its round's median full-replica score a "
                         "fresh full replica must reach (default: the spec's; 0: min_agreement alone)")
    add_arm_flags(ap)
    args = ap.parse_args(argv)
    cfg = dict(CONFIGS[args.config or ("quick" if args.quick else "full")])
    if args.fresh_agreement is not None:
        if not 0 <= args.fresh_agreement <= 1:
            ap.error(f"--fresh-agreement is a share in [0, 1], got {args.fresh_agreement:g}")
        cfg["fresh_agreement"] = args.fresh_agreement
    honest = [int(x) for x in args.honest.split(",")]
    hostile = [int(x) for x in args.hostile.split(",")]
    attacks = [a for a in args.attacks.split(",") if a]
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = [a for a in attacks if a not in ATTACKS] + [k for k in kinds if k not in KINDS]
    if unknown:
        ap.error(f"unknown attack(s) or kind(s) {', '.join(unknown)}; have: {', '.join(ATTACKS + KINDS)}")
    checks = [{"on": True, "off": False}[c] for c in args.checks.split(",")]
    seeds = list(range(args.seeds))
    jobs = []
    for check in checks:
        for seed in seeds:
            for r in honest:
                jobs.append((cfg, r, 0, None, check, seed, args.threads))
                attacked = [a for a in attacks if check or len(checks) == 1 or a == "negate"]
                for attack in attacked:
                    jobs += [(cfg, r, k, attack, check, seed, args.threads) for k in hostile]
                if attacked and args.controls:  # the attacked arms' control: R + K honest replicas
                    jobs += [(cfg, r + k, 0, None, check, seed, args.threads) for k in hostile]
            jobs += [(cfg, KIND_REPLICAS, 0, kind, check, seed, args.threads) for kind in kinds]
    jobs = list({job[1:]: job for job in jobs}.values())  # a control may be another arm's clean run
    print(f"# bench/trust.py, {now()}, {machine()}: {len(jobs)} simulations, {args.jobs} at a time", flush=True)
    t0 = time.monotonic()
    rows = run_jobs(run_arm, jobs, args.jobs)
    summary = summarize(rows)
    print()
    print_summary(summary)
    print(f"\n{time.monotonic() - t0:.0f} s in all")
    if args.json:
        args.json.write_text(strict_json(dict(config=cfg, rows=rows, summary=summary, machine=machine(), date=now())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
