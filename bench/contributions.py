"""At most K contributions a round, as a swarm grows from 16 to 1,000 peers (in-process simulation).

    python bench/contributions.py [--quick] [--sizes 16,64,256,1000] [--k 32] [--rounds 6] [--seeds 3]
                                  [--min-share S] [--jobs 2] [--threads 1] [--json OUT]

Every arm is ``peer.round.simulate.simulate``: N replicas of the real round loop (each its own model
copy, data shard, AdamW and SparseLoCo error feedback, its own round engine), at equal tokens:

- ``all``: every contribution of the round enters θ (``outer.max_contributions`` = 0: every peer
  downloads and decodes N − 1 payloads a round);
- ``K``: at most K enter θ (``outer.max_contributions`` = K, protocol/round/choice.py); a replica passed
  over keeps its update in its error feedback for a later round.

The round engine of replica 0 chooses, decodes, checks, clips, aggregates and applies; the others
take its θ and settle their own buffers (``RoundEngine.follow``; the first round, at the smallest
size if it is at most 64, every replica concludes itself and the simulation asserts them equal). Per
size, paired by seed: the final validation loss of ``K`` against ``all``, (K / all) − 1, mean ± std
over the seeds; the payloads sent at all a round after the first (with K, the replicas the lineage's
eligibility table let send: protocol/round/eligibility.py); per peer and round, the payloads it
needs (decodes: those drawn, counted), their bytes, and the seconds its engine spent choosing and
decoding them. No network: bytes are the real payloads' lengths, what a peer would download if it
fetched only what enters θ.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import add_arm_flags, human, machine, now, run_summarized, spread, table  # noqa: E402
from bench.compression import make_spec  # noqa: E402

CONFIGS = {
    # a model small enough for 1,000 replicas in one process: ~30 K parameters, 4 x 32 tokens a step
    "full": dict(model=dict(d_model=32, n_layers=2, n_heads=2, ffn_hidden=88, seq_len=32),
                 batch_size=4, inner_steps=10, steps=60, lr=3e-3, warmup=10),
    "quick": dict(model=dict(d_model=32, n_layers=2, n_heads=2, ffn_hidden=88, seq_len=32),
                  batch_size=4, inner_steps=5, steps=15, lr=3e-3, warmup=3),
}


VERIFY_MAX = 64  # the largest swarm whose every replica concludes the first round itself


def run_arm(job) -> Dict[str, Any]:
    """One simulation: (cfg, N replicas, K (0: all), seed, threads, verify, min_share or None)."""
    from peer.round.simulate import simulate
    from peer.training.data import load_corpus

    cfg, n, k, seed, threads, verify, min_share = job
    torch.set_num_threads(threads)
    logging.getLogger("voloco.peer.robust").setLevel(logging.ERROR)
    spec = make_spec(cfg, {"strategy": "sparseloco", "max_contributions": k}, {}, cfg["steps"], seed)
    if min_share is not None:
        spec = spec.replace(outer={"sparseloco": {"min_share": min_share}})
    rounds = max(1, cfg["steps"] // cfg["inner_steps"])
    t = time.monotonic()
    res = simulate(spec, n, rounds, corpus=load_corpus("stdlib"), eval_every=0, verify_rounds=int(verify),
                   conclude_rounds=int(verify))
    hist = res.history
    mean_payload = statistics.fmean(b for h in hist for b in h.payload_bytes)
    decodes = statistics.fmean(h.contributors + len(h.excluded) for h in hist)  # drawn (≤ K a part), measured
    row = dict(
        n=n, k=k, seed=seed, rounds=rounds, tokens=res.tokens, val_loss=res.final_val_loss,
        initial_val_loss=res.initial_val_loss,
        contributors=[h.contributors for h in hist],
        senders=[h.senders for h in hist],  # payloads sent at all (K > 0: about 5/4 K once p has settled)
        refused=sum(len(h.excluded) for h in hist),
        decodes_per_round=decodes,  # own payload included; downloads: the others', K of them at most
        download_per_round=(decodes if k and k < n else n - 1) * mean_payload,
        decode_s_per_round=statistics.fmean(h.decode_s for h in hist),
        round_s=statistics.fmean(h.seconds for h in hist), wall_s=time.monotonic() - t,
    )
    print(f"  N={n:5d} {'all' if not k else f'K={k}':6s} seed {seed}: val {row['val_loss']:.4f}, "
          f"senders {row['senders']}, contributors {row['contributors']}, decode {row['decode_s_per_round']:.2f} s/round, "
          f"{row['wall_s']:.0f} s", flush=True)
    return row


def summarize(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per (N, K): loss over seeds and its gap to the all-gather of the same N, paired by seed."""
    loss = {(r["n"], r["k"], r["seed"]): r["val_loss"] for r in rows}
    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["n"], r["k"]), []).append(r)
    out = []
    for (n, k), rs in sorted(groups.items()):
        gaps = [r["val_loss"] / loss[(n, 0, r["seed"])] - 1 for r in rs if k and (n, 0, r["seed"]) in loss]
        out.append(dict(
            n=n, k=k, seeds=len(rs), loss=statistics.fmean(r["val_loss"] for r in rs),
            loss_std=spread([r["val_loss"] for r in rs]),
            gap=statistics.fmean(gaps) if gaps else None, gap_std=spread(gaps),
            decodes=statistics.fmean(r["decodes_per_round"] for r in rs),
            senders=statistics.fmean(statistics.fmean(r["senders"][1:] or r["senders"]) for r in rs),
            download=statistics.fmean(r["download_per_round"] for r in rs),
            decode_s=statistics.fmean(r["decode_s_per_round"] for r in rs),
            refused=sum(r["refused"] for r in rs), tokens=rs[0]["tokens"],
        ))
    return out


def print_summary(summary: List[Dict[str, Any]]) -> None:
    lines = []
    for s in summary:
        gap = "-" if s["gap"] is None else f"{100 * s['gap']:+.2f} % ± {100 * s['gap_std']:.2f}"
        lines.append([str(s["n"]), "all" if not s["k"] else f"K = {s['k']}", str(s["seeds"]), f"{s['tokens']:,}",
                      f"{s['loss']:.4f} ± {s['loss_std']:.4f}", gap, f"{s['senders']:.1f}", f"{s['decodes']:.1f}", human(s["download"]),
                      f"{s['decode_s'] * 1e3:.0f} ms", str(s["refused"])])
    print(table(["peers", "enter θ", "seeds", "tokens", "val loss", "vs all (paired)", "sent/round (after round 1)",
                 "decodes/peer/round",
                 "download/peer/round", "choose+decode/round", "refused"], lines, left=2))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 rounds of H = 5 at 8 and 24 peers, K = 4: a smoke run")
    ap.add_argument("--sizes", help="comma-separated swarm sizes (default 16,64,256,1000; --quick: 8,24)")
    ap.add_argument("--k", type=int, help="contributions that enter θ a round (default 32; --quick: 4)")
    ap.add_argument("--rounds", type=int, help="rounds of H inner steps (default 6; --quick: 3)")
    ap.add_argument("--min-share", type=float,
                    help="outer.sparseloco.min_share of every arm: the chosen average divides a coordinate by no fewer "
                         "than this share of the payloads that carry its tensor (default: the spec's, 0.25)")
    add_arm_flags(ap)
    args = ap.parse_args(argv)
    if args.min_share is not None and not 0.0 <= args.min_share <= 1.0:
        ap.error("--min-share must be between 0 and 1")
    cfg = dict(CONFIGS["quick" if args.quick else "full"])
    if args.rounds is not None:
        cfg["steps"] = args.rounds * cfg["inner_steps"]
    sizes = [int(x) for x in (args.sizes or ("8,24" if args.quick else "16,64,256,1000")).split(",")]
    k = args.k if args.k is not None else (4 if args.quick else 32)
    if k < 1 or any(n < 2 for n in sizes) or args.seeds < 1 or cfg["steps"] < 1:
        raise SystemExit("--k must be >= 1, every size >= 2, --rounds and --seeds >= 1")
    print(f"# at most K = {k} contributions a round, {now()}, {machine()}")
    print(f"# model {cfg['model']}, batch {cfg['batch_size']}, H = {cfg['inner_steps']}, "
          f"{cfg['steps']} inner steps a replica; sizes {sizes}, {args.seeds} seeds", flush=True)
    # the largest swarms first, so the two jobs end together; every replica concludes the first
    # round itself at the smallest size (the shortcut checked), if it is small: at 1,000 replicas
    # that is 1,000 outer steps of 1,000 contributions each
    work = [(cfg, n, arm, seed, args.threads, n == min(sizes) and n <= VERIFY_MAX, args.min_share)
            for n in sorted(sizes, reverse=True) for seed in range(args.seeds) for arm in (0, k)]
    run_summarized(run_arm, work, args.jobs, summarize, print_summary, args.json, config=cfg, k=k, sizes=sizes,
                   min_share=args.min_share)
    return 0


if __name__ == "__main__":
    sys.exit(main())
