"""Compressed outer steps at equal tokens: quality and bytes of DiLoCo fp32/fp16, SparseLoCo, DCT.

    python bench/compression.py [--quick] [--json OUT] [--tune] [--demo-sweep] [--jobs N] [--payloads]

Same model, data, seeds and total tokens for every arm, R = 4 replicas of the real round loop
(``peer.round.simulate.simulate``: real encoded payloads, every replica decodes all of them):

* ``per-step DP``: the quality proxy of per-step data parallel: one process, batch R·B (the
  tokens of the R replicas' step together), N steps; its bytes are analytic: a ring all-reduce of
  fp32 gradients every step sends 2·(R−1)/R·4·params per peer;
* ``diloco fp32``, ``diloco fp16``: dense pseudo-gradients, outer Nesterov (lr 0.7, momentum 0.9);
* ``sparseloco``: error feedback, top-64 of 4096 per block, 2-bit values, outer lr 1, each
  coordinate averaged over the replicas that kept it (``--tune`` adds the plain mean);
* ``dct``: decoupled DCT momentum, top-32 coefficients per 64x64 block, fp16 values.

Bytes per peer over the run follow the exchange's all-gather (peer/exchange/gatherer.py): each member
serves its payload to the R−1 other members and fetches theirs, so sent ≈ received ≈
(R−1)·payload per round. ``--tune`` adds the tuning arms (SparseLoCo outer lr, the plain mean over
all replicas, DCT beta/k, H). ``--demo-sweep`` runs the demo-scale SparseLoCo study instead: the
0.87M demo model, 3 replicas, ~400 inner steps per replica, a few settings.

Then payload sizes by model size up to 99.5M parameters (whole-model encodes; SparseLoCo's bits
per kept entry against its indices' entropy bound); ``--payloads``: that table alone, no training.

A further table gives the wire bytes per peer per round for groups of 2, 4 and 8: SparseLoCo and
dense DiLoCo as all-gathers ((G−1)·payload) and a dense ring all-reduce (2·(G−1)/G·dense), and
where SparseLoCo's all-gather would cross the dense ring all-reduce.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgpack  # noqa: E402
import torch  # noqa: E402

from peer.training.data import load_corpus  # noqa: E402
from protocol.wire.exchange_bytes import allgather_bytes_per_round, allreduce_bytes_per_step  # noqa: E402
from peer.round.simulate import simulate, train_single  # noqa: E402
from peer.outer.robust import CLIP_MULTIPLE  # noqa: E402
from peer.outer.strategies import OuterStrategy, make_strategy  # noqa: E402
from bench.common import human, machine, now, run_jobs, table  # noqa: E402
from bench.common import warm_start as common_warm_start  # noqa: E402
from bench.swarm_check import BENCH_SWARM, check_against_simulation, run_swarm  # noqa: E402
from protocol.codecs.chunking import top_k_geometry  # noqa: E402
from protocol.codecs.index_coding import entropy_bound_bits  # noqa: E402
from protocol.spec import ModelSpec, RunSpec  # noqa: E402
from swarm.jsonout import dumps as strict_json  # noqa: E402  (NaN -> null: strict JSON)

R = 4
CONFIGS = {
    # the demo model's shape (0.87M parameters) on 64-byte sequences
    "full": dict(
        model=dict(d_model=128, n_layers=4, n_heads=4, ffn_hidden=352, seq_len=64),
        batch_size=16, inner_steps=30,
        steps=450,  # N: inner steps of each replica (15 rounds)
        lr=2e-3, warmup=30,
    ),
    # a tiny model for CI smoke tests (well under a minute)
    "quick": dict(
        model=dict(d_model=64, n_layers=2, n_heads=4, ffn_hidden=176, seq_len=32),
        batch_size=8, inner_steps=20, steps=100, lr=3e-3, warmup=10,
    ),
    # the demo: RunSpec() defaults (0.87M, 16x128), 3 peers, ~400 inner steps each
    "demo": dict(
        model=dict(),
        batch_size=16, inner_steps=30, steps=400, lr=2e-3, warmup=30,
        total_steps=3000,  # the default cosine horizon, as in the demo
        replicas=3,
    ),
}
# (label, outer changes, inner changes); "dp" is the per-step data-parallel proxy, "single" one process
BASE_ARMS = [
    ("per-step DP (1 proc, 4x batch)", "dp", {}),
    ("diloco fp32", {"strategy": "diloco", "dense_dtype": "fp32"}, {}),
    ("diloco fp16", {"strategy": "diloco", "dense_dtype": "fp16"}, {}),
    ("sparseloco", {"strategy": "sparseloco"}, {}),
    ("dct", {"strategy": "dct"}, {}),
]
TUNE_ARMS = [
    ("sparseloco plain mean", {"strategy": "sparseloco", "sparseloco": {"aggregate": "mean"}}, {}),
    ("sparseloco outer lr 2", {"strategy": "sparseloco", "lr": 2.0}, {}),
    ("sparseloco outer lr 4", {"strategy": "sparseloco", "lr": 4.0}, {}),
    ("sparseloco H=15 outer lr 2", {"strategy": "sparseloco", "inner_steps": 15, "lr": 2.0}, {}),
    ("diloco fp32 H=15", {"strategy": "diloco", "inner_steps": 15}, {}),
    ("dct beta 0.99", {"strategy": "dct", "dct": {"beta": 0.99}}, {}),
    ("dct outer lr 2", {"strategy": "dct", "lr": 2.0}, {}),
    ("dct outer lr 4", {"strategy": "dct", "lr": 4.0}, {}),
    ("dct k128", {"strategy": "dct", "dct": {"topk": 128}}, {}),
    ("sparseloco H=15", {"strategy": "sparseloco", "inner_steps": 15}, {}),
    ("sparseloco H=15 plain mean", {"strategy": "sparseloco", "inner_steps": 15, "sparseloco": {"aggregate": "mean"}}, {}),
    ("dct H=15 outer lr 2", {"strategy": "dct", "inner_steps": 15, "lr": 2.0}, {}),
    ("dct H=15 k64 outer lr 2", {"strategy": "dct", "inner_steps": 15, "lr": 2.0, "dct": {"topk": 64}}, {}),
]
DEMO_ARMS = [
    ("single process, 400 steps (reference)", "single", {}),
    ("diloco defaults (reference)", {"strategy": "diloco"}, {}),
    ("sparseloco defaults (H=30, outer lr 1)", {"strategy": "sparseloco"}, {}),
    ("sparseloco cosine horizon 400", {"strategy": "sparseloco"}, {"total_steps": 400}),
    ("sparseloco k256", {"strategy": "sparseloco", "sparseloco": {"topk": 256}}, {}),
    ("sparseloco plain mean", {"strategy": "sparseloco", "sparseloco": {"aggregate": "mean"}}, {}),
    ("sparseloco outer lr 2", {"strategy": "sparseloco", "lr": 2.0}, {}),
    ("sparseloco outer lr 3", {"strategy": "sparseloco", "lr": 3.0}, {}),
    ("sparseloco outer lr 4", {"strategy": "sparseloco", "lr": 4.0}, {}),
    ("sparseloco H=20", {"strategy": "sparseloco", "inner_steps": 20}, {}),
    ("sparseloco H=20 outer lr 2", {"strategy": "sparseloco", "inner_steps": 20, "lr": 2.0}, {}),
    ("sparseloco H=20 outer lr 3", {"strategy": "sparseloco", "inner_steps": 20, "lr": 3.0}, {}),
    ("sparseloco H=15 outer lr 2", {"strategy": "sparseloco", "inner_steps": 15, "lr": 2.0}, {}),
    ("sparseloco H=10", {"strategy": "sparseloco", "inner_steps": 10}, {}),
    ("sparseloco H=10 outer lr 2", {"strategy": "sparseloco", "inner_steps": 10, "lr": 2.0}, {}),
    ("sparseloco H=10 outer lr 3", {"strategy": "sparseloco", "inner_steps": 10, "lr": 3.0}, {}),
]
PAYLOAD_RATIO_SHAPES = {
    "64x2 (0.13M)": dict(d_model=64, n_layers=2, n_heads=4, ffn_hidden=176),
    "128x4 demo (0.87M)": dict(),
    "192x2 (0.98M)": dict(d_model=192, n_layers=2, n_heads=4, ffn_hidden=512),
    "384x6 (10.8M)": dict(d_model=384, n_layers=6, n_heads=6, ffn_hidden=1024),
    "768x12 (99.5M)": dict(d_model=768, n_layers=12, n_heads=12, ffn_hidden=2560),
}
GROUPS = (2, 4, 8)
PAYLOAD_GOAL = 200.0  # SparseLoCo against DiLoCo fp32 at the largest shape of PAYLOAD_RATIO_SHAPES


def make_spec(cfg, outer: Dict[str, Any], inner: Dict[str, Any], steps: int, seed: int = 0) -> RunSpec:
    inner = {"lr": cfg["lr"], "warmup_steps": cfg["warmup"], "total_steps": cfg.get("total_steps", steps), **inner}
    return RunSpec(run_id="bench-compression", seed=seed, model=ModelSpec(**cfg["model"])).replace(
        data={"batch_size": cfg["batch_size"], "val_batches": 8},
        inner=inner,
        outer={"inner_steps": cfg["inner_steps"], **outer},
    )


def run_arm(job) -> Dict[str, Any]:
    """One arm, in a worker process or in this one."""
    cfg, label, outer, inner, threads, init = job
    torch.set_num_threads(threads)
    # bench knobs in an arm's outer changes: "clip" (multiple of the median norm, None: no clipping; the
    # run-wide constant by default) and "seed" (of the model's initialization and the data order)
    knobs = {k: outer[k] for k in ("clip", "seed") if k in outer} if isinstance(outer, dict) else {}
    outer = {k: v for k, v in outer.items() if k not in knobs} if knobs else outer
    clip = knobs.get("clip", CLIP_MULTIPLE)
    OuterStrategy.clip_multiple = math.inf if clip is None else clip
    seed = knobs.get("seed", 0)
    corpus = load_corpus("stdlib")
    replicas = cfg.get("replicas", R)
    t = time.monotonic()
    if outer == "single":
        spec = make_spec(cfg, {"strategy": "diloco"}, inner, cfg["steps"])
        res = train_single(spec, cfg["steps"], corpus=corpus, eval_every=100, init_theta=init)
        row = dict(arm=label, strategy="single", H=1, rounds=cfg["steps"], tokens=res.tokens, val_loss=res.final_val_loss,
                   initial_val_loss=res.initial_val_loss, payload_bytes=0, sent_per_peer=0, received_per_peer=0,
                   dp_per_peer=0, curve=[(p["step"], p["val_loss"]) for p in res.history])
    elif outer == "dp":
        spec = make_spec(cfg, {"strategy": "diloco"}, inner, cfg["steps"])
        res = train_single(spec, cfg["steps"], corpus=corpus, batch_size=replicas * cfg["batch_size"], init_theta=init)
        params = spec.model.num_params()
        dp = cfg["steps"] * allreduce_bytes_per_step(params, replicas)
        row = dict(arm=label, strategy="dp", H=1, rounds=cfg["steps"], tokens=res.tokens, val_loss=res.final_val_loss,
                   initial_val_loss=res.initial_val_loss, payload_bytes=allreduce_bytes_per_step(params, replicas),
                   sent_per_peer=dp, received_per_peer=dp, dp_per_peer=dp, curve=[p["val_loss"] for p in res.history])
    else:
        spec = make_spec(cfg, outer, inner, cfg["steps"], seed)
        H = spec.outer.inner_steps
        rounds = max(1, round(cfg["steps"] / H))
        res = simulate(spec, replicas, rounds, corpus=corpus, eval_every=max(1, rounds // 5), init_theta=init)
        row = dict(arm=label, strategy=spec.outer.strategy, H=H, rounds=rounds, tokens=res.tokens,
                   val_loss=res.final_val_loss, initial_val_loss=res.initial_val_loss, payload_bytes=res.payload_bytes,
                   sent_per_peer=res.bytes_sent_per_peer, received_per_peer=res.bytes_received_per_peer,
                   dp_per_peer=res.dp_bytes_per_peer,
                   curve=[(h.round * H, h.val_loss) for h in res.history if h.val_loss is not None])
    row.update(outer=outer, inner=inner, replicas=1 if outer == "single" else replicas, **knobs,
               wall_s=time.monotonic() - t)
    print(f"  {label}: val {row['val_loss']:.4f}, payload {human(row['payload_bytes'])}, {row['wall_s']:.0f} s", flush=True)
    return row


def warm_start(cfg, steps: int, log=print):
    """θ after ``steps`` single-process steps on a shard no arm trains on (bench/common.py)."""
    spec = make_spec(cfg, {"strategy": "diloco"}, {"total_steps": max(steps, cfg["warmup"] + 1)}, steps)
    return common_warm_start(spec, steps, log)


def run_arms(cfg, arms, jobs: int, threads: int, init=None) -> List[Dict[str, Any]]:
    return run_jobs(run_arm, [(cfg, label, outer, inner, threads, init) for label, outer, inner in arms], jobs)


def add_ratios(rows):
    fp32 = next((r for r in rows if r["arm"] == "diloco fp32"), None)
    for r in rows:
        if fp32 is not None:
            r["payload_vs_fp32"] = fp32["payload_bytes"] / r["payload_bytes"]
            r["loss_vs_fp32"] = r["val_loss"] / fp32["val_loss"]
            r["sent_vs_fp32"] = fp32["sent_per_peer"] / r["sent_per_peer"]
        r["dp_over_sent"] = r["dp_per_peer"] / r["sent_per_peer"]
    return fp32


def goals(r) -> str:
    if r["strategy"] == "sparseloco":
        need = 140.0
    elif r["strategy"] == "dct":
        need = 16.0
    else:
        return ""
    if "payload_vs_fp32" not in r:
        return "goals need the diloco fp32 arm"
    ok_p = r["payload_vs_fp32"] >= need
    ok_l = r["loss_vs_fp32"] <= 1.02
    ok_d = r["dp_over_sent"] >= 1000
    return (f"payload>={need:.0f}x {'ok' if ok_p else 'MISS'}, loss<=+2% {'ok' if ok_l else 'MISS'}, "
            f"DP>=1000x {'ok' if ok_d else 'MISS'}")


def print_main(rows, with_goals=True):
    cols = ["arm", "H", "rounds", "val loss", "vs fp32", "payload/round", "vs fp32", "sent/peer", "recv/peer", "DP/sent"]
    if with_goals:
        cols.append("goals")
    lines = []
    for r in rows:
        line = [r["arm"], str(r["H"]), str(r["rounds"]), f"{r['val_loss']:.4f}", f"{r.get('loss_vs_fp32', float('nan')):.3f}",
                human(r["payload_bytes"]) + (" (analytic)" if r["strategy"] == "dp" else ""),
                "-" if r["strategy"] == "dp" else f"{r.get('payload_vs_fp32', float('nan')):.1f}x", human(r["sent_per_peer"]), human(r["received_per_peer"]),
                f"{r['dp_over_sent']:.0f}x"]
        if with_goals:
            line.append(goals(r))
        lines.append(line)
    print(table(cols, lines))
    print("\npayload/round: one peer's encoded payload for one round (for per-step DP: the analytic bytes one peer sends\n"
          "per step in an fp32 ring all-reduce). sent/peer, recv/peer: whole run, all-gather model: each member serves\n"
          "its payload to the R-1 others and fetches theirs every round. DP/sent: per-step DP bytes / sent, same steps.\n"
          "vs fp32: loss ratio (lower is better) and payload ratio (x smaller) against the diloco fp32 arm.")


def index_stats(payload: bytes, layout, codec) -> Dict[str, float]:
    """SparseLoCo's kept entries, the bytes of its index fields and their entropy bound, from a payload."""
    fields = dict(msgpack.unpackb(payload, raw=False)["t"])
    geometry = {name: top_k_geometry(tuple(shape), codec.chunk, codec.topk) for name, shape in layout.items()}
    return dict(kept=sum(b.nblocks * k for b, k in geometry.values()), idx_bytes=sum(len(fields[n]["idx"]) for n in layout),
                idx_bound_bytes=sum(b.nblocks * entropy_bound_bits(b.block_numel, k) / 8 for b, k in geometry.values()))


def payload_ratio_table(inner_steps: int):
    lines, out = [], []
    for label, m in PAYLOAD_RATIO_SHAPES.items():
        ms = ModelSpec(**m)
        layout = ms.param_shapes()
        sizes = {}
        for name, outer in (("fp32", {"strategy": "diloco"}), ("sparseloco", {"strategy": "sparseloco"}), ("dct", {"strategy": "dct"})):
            s = make_strategy(RunSpec(model=ms).replace(outer=outer), layout)
            gen = torch.Generator().manual_seed(0)
            payload = s.encode({n: torch.randn(sh, generator=gen) for n, sh in layout.items()}, 0)[0]
            sizes[name] = len(payload)
            if name == "sparseloco":
                stats = index_stats(payload, layout, s.codec)
        bits = {k: 8 * v / stats["kept"] for k, v in (("all", sizes["sparseloco"]), *stats.items())}
        lines.append([label, str(len(layout)), f"{stats['kept']:,}", f"{sizes['fp32']:,}", f"{sizes['sparseloco']:,}",
                      f"{sizes['fp32'] / sizes['sparseloco']:.1f}x", f"{bits['all']:.2f}",
                      f"{bits['idx_bytes']:.2f} ({bits['idx_bound_bytes']:.2f})", f"{sizes['dct']:,}",
                      f"{sizes['fp32'] / sizes['dct']:.1f}x"])
        out.append(dict(model=label, params=ms.num_params(), tensors=len(layout), **{f"{k}_bytes": v for k, v in sizes.items()},
                        sparseloco_ratio=sizes["fp32"] / sizes["sparseloco"], **{f"sparseloco_{k}": v for k, v in stats.items()}))
    print(table(["model", "tensors", "kept", "fp32 B", "sparseloco B", "ratio", "bits/kept", "idx bits/kept (bound)",
                 "dct B", "ratio"], lines))
    big = out[-1]
    print(f"(encode only, random tensors; SparseLoCo's Rice-coded indices vary by a few bytes with the values. bits/kept:\n"
          f"the whole payload per kept entry; idx bits/kept: its index fields, and the entropy bound log2 C(n, k) per block.)\n"
          f"Goal SparseLoCo >= {PAYLOAD_GOAL:.0f}x at {big['model']}: {big['sparseloco_ratio']:.1f}x "
          f"{'ok' if big['sparseloco_ratio'] >= PAYLOAD_GOAL else 'MISS'}")
    return out


def group_table(rows):
    dense = next(r for r in rows if r["arm"] == "diloco fp32")["payload_bytes"]
    slc = next(r for r in rows if r["strategy"] == "sparseloco")["payload_bytes"]
    lines, out = [], []
    for g in GROUPS:
        ag_s, ag_d = allgather_bytes_per_round(slc, g), allgather_bytes_per_round(dense, g)
        ring = allreduce_bytes_per_step(dense / 4, g)  # dense / 4 values of 4 bytes
        lines.append([str(g), human(ag_s), human(ag_d), human(ring), f"{ring / ag_s:.0f}x", f"{ag_d / ag_s:.0f}x"])
        out.append(dict(group=g, sparseloco_allgather=ag_s, dense_allgather=ag_d, dense_ring_allreduce=ring))
    print(table(["group G", "sparseloco all-gather", "dense all-gather", "dense ring all-reduce", "ring/slc", "dense-ag/slc"], lines))
    # (G-1)·s = 2(G-1)/G·d  ->  G = 2d/s
    crossover = 2 * dense / slc
    print(f"\nper peer per round, sent (received is the same). SparseLoCo's all-gather grows as (G-1)·payload while a\n"
          f"dense ring all-reduce stays below 2·dense: they cross at G = 2·dense/payload = {crossover:.0f} peers; below that the\n"
          f"sparse all-gather sends less. A dense all-gather (what DiLoCo does over the real exchange) costs dense/payload =\n"
          f"{dense / slc:.0f}x the sparse one at every G.")
    return out, crossover


def measured_groups(cfg, groups=GROUPS, rounds: int = 2, H: int = 4) -> List[Dict[str, Any]]:
    """Wire bytes per peer per round, measured: real swarms of G peers, SparseLoCo and dense DiLoCo.

    The payload sizes do not depend on H, so the swarms train only H inner steps per round; bytes
    are the peers' stream-level counts (payloads, digest tables, start hashes, framing)."""
    import tempfile

    out = []
    for strategy in ("sparseloco", "diloco"):
        spec = make_spec(cfg, {"strategy": strategy, "inner_steps": H}, {}, cfg["steps"]).replace(swarm=BENCH_SWARM)
        for g in groups:
            t = time.monotonic()
            with tempfile.TemporaryDirectory(prefix="voloco-bench-groups-") as tmp:
                statuses = run_swarm(spec, g, rounds, Path(tmp), log=lambda *a, **k: None)
            recs = [r for s in statuses for r in s["history"]]
            full = all(len(r["group"]) == g for r in recs)
            sent = sum(r["bytes_sent"] for r in recs) / len(recs)
            received = sum(r["bytes_received"] for r in recs) / len(recs)
            out.append(dict(strategy=strategy, group=g, sent_per_round=sent, received_per_round=received, full_groups=full,
                            rounds=rounds, wall_s=time.monotonic() - t))
            print(f"  {strategy}, group of {g}: sent {human(sent)} / received {human(received)} per peer per round"
                  f"{'' if full else ' (NOT every round had the whole group)'} ({time.monotonic() - t:.0f} s)", flush=True)
    return out


def print_measured_groups(measured, params: int) -> None:
    by = {(m["strategy"], m["group"]): m for m in measured}
    lines = []
    for g in sorted({m["group"] for m in measured}):
        s, d = by[("sparseloco", g)], by[("diloco", g)]
        ring = allreduce_bytes_per_step(params, g)
        lines.append([str(g), human(s["sent_per_round"]), human(d["sent_per_round"]), f"{d['sent_per_round'] / s['sent_per_round']:.0f}x",
                      human(ring), f"{ring / s['sent_per_round']:.0f}x"])
    print(table(["group G", "sparseloco sent (measured)", "diloco fp32 sent (measured)", "diloco/sparseloco",
                 "dense ring all-reduce (analytic)", "ring/sparseloco"], lines))
    print("per peer per round, stream level, mean over peers and rounds of real swarms on loopback (received is about the\n"
          "same). The ring all-reduce column is what one dense fp32 all-reduce of the model would send per peer.")


def real_check(cfg, outer=None) -> Dict[str, Any]:
    """The SparseLoCo arm as R real peer processes, then its simulation with the same shards."""
    import tempfile

    outer = outer or {"strategy": "sparseloco"}
    spec = make_spec(cfg, outer, {}, cfg["steps"]).replace(swarm=BENCH_SWARM)
    rounds = max(1, round(cfg["steps"] / spec.outer.inner_steps))
    peers = cfg.get("replicas", R)
    print(f"real processes: {peers} peers (1 torch thread each) + a coordinator on loopback, {spec.outer.strategy}, "
          f"{rounds} rounds of H={spec.outer.inner_steps}", flush=True)
    t = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="voloco-bench-real-") as tmp:
        statuses = run_swarm(spec, peers, rounds, Path(tmp))
    real_wall = time.monotonic() - t
    print(f"  real swarm: {real_wall:.0f} s; simulating the same run with the peers' shards ...", flush=True)
    t = time.monotonic()
    check = check_against_simulation(spec, statuses, rounds)
    check.update(real_wall_s=real_wall, sim_wall_s=time.monotonic() - t, strategy=spec.outer.strategy)
    lines = [[str(r["round"]), "yes" if r["full_group"] else "NO", r["sim_hash"], ",".join(r["real_hashes"]),
              "yes" if r["identical"] else "NO", f"{r['sim_val']:.4f}", " ".join(f"{v:.4f}" for v in r["real_val"]),
              human(r["sim_sent_per_peer"]), human(r["real_sent_per_peer"])] for r in check["per_round"]]
    print(table(["round", "all in group", "sim θ", "real θ (all peers)", "equal", "sim val", "real val (each peer)",
                 "sim sent/peer", "real sent/peer"], lines))
    print(f"\nθ bit-identical to the simulation in {check['identical_rounds']}/{rounds} rounds "
          f"({check['full_group_rounds']} rounds had every peer in one group). Real sent/peer over the run: "
          f"{human(check['real_sent_per_peer'])} on the wire (stream level) against {human(check['sim_sent_per_peer'])} "
          f"of payloads in the simulation's all-gather model "
          f"({check['real_sent_per_peer'] / check['sim_sent_per_peer']:.3f}x: digests, start hashes and stream framing).")
    return check


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, few steps: a CI smoke test")
    ap.add_argument("--tune", action="store_true", help="also run the tuning arms")
    ap.add_argument("--demo-sweep", action="store_true", help="the demo-scale SparseLoCo study (0.87M, 3 replicas, ~400 steps)")
    ap.add_argument("--only", help="comma-separated arm labels to run (exact)")
    ap.add_argument("--merge", type=Path, help="a previous --json of the same config: its rows are kept, ours replace same labels")
    ap.add_argument("--real", action="store_true",
                    help="also run the SparseLoCo arm as real peer processes over hivemind (loopback) and compare it, "
                    "round by round, with its simulation (θ hashes, validation loss, bytes)")
    ap.add_argument("--real-only", action="store_true", help="only the real-processes checks, no simulated arms")
    ap.add_argument("--payloads", action="store_true", help="only the payload sizes by model size (no training)")
    ap.add_argument("--groups", action="store_true",
                    help="also measure wire bytes per peer per round on real swarms of 2, 4 and 8 peers (SparseLoCo, dense DiLoCo)")
    ap.add_argument("--warm-start", type=int, default=0, metavar="STEPS",
                    help="start every arm from the parameters of this many single-process steps (on a shard no arm "
                    "trains on; not counted in the arms' tokens); 0: from the seed's initialization (default)")
    ap.add_argument("--json", type=Path, help="write every row, the tables' data and the configuration here")
    ap.add_argument("--jobs", type=int, default=1, help="arms run in parallel processes")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per process")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    name = "demo" if args.demo_sweep else "quick" if args.quick else "full"
    cfg = CONFIGS[name]
    arms = DEMO_ARMS if args.demo_sweep else BASE_ARMS + (TUNE_ARMS if args.tune else [])
    if args.only:
        keys = [k.strip() for k in args.only.split(",")]
        arms = [a for a in arms if a[0] in keys]
    t0 = time.monotonic()
    ms = ModelSpec(**cfg["model"])
    print(f"bench/compression.py ({name}): {now()}, {machine()}, "
          f"{args.jobs} job(s) x {args.threads} thread(s)")
    print(f"model {ms.num_params():,} parameters, batch {cfg['batch_size']}x{ms.seq_len}, {cfg.get('replicas', R)} replicas, "
          f"N={cfg['steps']} inner steps per replica, H={cfg['inner_steps']} unless stated", flush=True)
    init = None
    if args.warm_start:
        cfg = dict(cfg, warm_start=args.warm_start)
        init, _ = warm_start(cfg, args.warm_start)
    rows = run_arms(cfg, [] if args.real_only or args.payloads else arms, args.jobs, args.threads, init)
    if args.merge:
        old = json.loads(args.merge.read_text())
        if old.get("config") != json.loads(json.dumps(cfg)):
            raise SystemExit(f"--merge {args.merge}: its config differs from this run's")
        new = {r["arm"]: r for r in rows}
        order = [a[0] for a in BASE_ARMS + TUNE_ARMS + DEMO_ARMS]
        merged = {r["arm"]: r for r in old["rows"]}
        merged.update(new)
        rows = sorted(merged.values(), key=lambda r: order.index(r["arm"]) if r["arm"] in order else len(order))
        print(f"merged {len(old['rows'])} rows of {args.merge} with {len(new)} new ones")
    result: Dict[str, Any] = dict(config=cfg, name=name, rows=rows, date=now(),
                                  machine=machine())
    print()
    if args.payloads:
        result["payload_ratio_by_model"] = payload_ratio_table(cfg["inner_steps"])
    elif not rows:
        pass
    elif args.demo_sweep:
        lines = [[r["arm"], str(r["replicas"]), str(r["rounds"] * r["H"]), f"{r['initial_val_loss']:.3f}", f"{r['val_loss']:.4f}",
                  f"{r['initial_val_loss'] - r['val_loss']:.2f}", human(r["payload_bytes"]) if r["payload_bytes"] else "-",
                  " ".join(f"{v:.2f}@{s}" for s, v in r["curve"])] for r in rows]
        print(table(["setting", "peers", "steps/peer", "initial", "val loss", "drop", "payload", "curve (val@step)"], lines))
    else:
        add_ratios(rows)
        print_main(rows)
        print()
        result["payload_ratio_by_model"] = payload_ratio_table(cfg["inner_steps"])
        print()
        if any(r["strategy"] == "sparseloco" for r in rows) and any(r["arm"] == "diloco fp32" for r in rows):
            result["groups"], result["crossover_group"] = group_table(rows)
    if args.real or (args.real_only and not args.groups):
        print()
        result["real"] = real_check(cfg)
    if args.groups:
        print(f"\nwire bytes by group size, measured on real swarms (groups {', '.join(map(str, GROUPS))}):", flush=True)
        result["measured_groups"] = measured_groups(cfg)
        print_measured_groups(result["measured_groups"], ms.num_params())
    print(f"\ntotal {time.monotonic() - t0:.0f} s")
    if args.json:
        args.json.write_text(strict_json(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
