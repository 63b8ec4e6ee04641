"""bench/hostile.py's table: each run against its seed's baselines, the rows over seeds, the print.
Guarded by tests/bench/test_bench_hostile.py."""

from __future__ import annotations

import statistics
from typing import Any, Dict, List

from bench.common import table

BASELINES = ("clean", "honest-only")  # the runs every attack is compared with, in the order they run
HONEST = ("honest-only", "honest-again")  # runs of the honest peers alone


def compare(results: List[Dict[str, Any]], baseline_of: Dict[str, str]) -> None:
    """Per run: its loss against ``honest-only`` (the N honest peers: the honest tokens of every
    attacked run, the goal's baseline) and against ``clean`` (N + K honest peers: what the attackers'
    share would have added, had they trained honestly), its round time against the clean run with as
    many training processes (``baseline_of``: attack -> ``Attack.baseline``, the 2-core machine is
    shared; bench/hostile.py's ``compare`` passes its attacks')."""
    runs = {r["attack"]: r for r in results}

    def ratio(r, base, key):
        b = runs.get(base)
        return r[key] / b[key] if b is not None and b.get(key) and r.get(key) is not None else None

    honest_hash = (runs.get("honest-only") or {}).get("final_hash")
    for r in results:
        # the attacked run ended on the honest-only run's θ bit for bit (--sequential: it changed nothing)
        r["same_theta"] = None if not honest_hash or r["attack"] in BASELINES else r.get("final_hash") == honest_hash
        r["loss_vs_honest"] = ratio(r, "honest-only", "val_loss")
        r["loss_vs_clean"] = ratio(r, "clean", "val_loss") if r["attack"] != "honest-only" else None
        r["time_vs_clean"] = ratio(r, baseline_of[r["attack"]], "mean_round_s")  # a round's latency
        r["period_vs_clean"] = ratio(r, baseline_of[r["attack"]], "round_period_s")  # how often rounds end
        r["later_vs_clean"] = ratio(r, baseline_of[r["attack"]], "later_period_s")  # ... after the first


def pool_baselines(results: List[Dict[str, Any]], extra: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """``results`` with each seed's honest runs (``honest-only`` and ``honest-again``, of ``results`` and
    of ``extra``, earlier runs of the same code) as one ``honest-only`` run: their mean val loss and
    round time. Two runs of the same honest peers differ by a few % with overlap and early close
    (which steps ran ahead of an exchange follows timing), so an attack's gap is read against the mean."""
    seeds = {r.get("seed", 0) for r in results}
    honest: Dict[int, List[Dict[str, Any]]] = {}
    for r in results + extra:
        if r["attack"] in HONEST and r.get("seed", 0) in seeds:
            honest.setdefault(r.get("seed", 0), []).append(r)
    pooled = []
    for seed, runs in sorted(honest.items()):
        row = dict(runs[0], attack="honest-only", k=0, pooled=len(runs), final_hash=None,
                   val_loss=statistics.fmean(r["val_loss"] for r in runs),
                   mean_round_s=statistics.fmean(r["mean_round_s"] for r in runs),
                   # runs from before ``ended`` was recorded have no period: the mean of those that do
                   **{key: (statistics.fmean(r[key] for r in runs if r.get(key)) if any(r.get(key) for r in runs)
                            else None) for key in ("round_period_s", "later_period_s")},
                   rounds=min(r["rounds"] for r in runs), hashes_equal=all(r["hashes_equal"] for r in runs),
                   honest=sum(r["honest"] for r in runs), honest_ok=sum(r["honest_ok"] for r in runs))
        row.pop("honest_refused", None)
        if all("honest_refused" in r for r in runs):  # runs from before it was counted have none
            row["honest_refused"] = sum(r["honest_refused"] for r in runs)
        pooled.append(row)
    return pooled + [r for r in results if r["attack"] not in HONEST]


def hostile_of(r: Dict[str, Any]) -> int:
    """The K a run belongs to (runs of --json files from before --hostile took a list: 1)."""
    return r.get("k", 0 if r["attack"] == "honest-only" else 1)


def over_seeds(results: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per attack from its runs over several seeds (each already ``compare``d with its own
    seed's clean runs): the mean of each figure, the std of the paired ratios, every honest process
    counted, θ equal only if equal in every run, the attacker's treatment from any run."""
    rows: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in results:
        rows.setdefault((r["attack"], hostile_of(r)), []).append(r)

    def mean(runs, key):
        values = [r[key] for r in runs if r.get(key) is not None]
        return statistics.fmean(values) if len(values) == len(runs) else None

    def std(runs, key):
        values = [r[key] for r in runs if r.get(key) is not None]
        return statistics.pstdev(values) if len(values) == len(runs) > 1 else None

    out = []
    for (attack, k), runs in rows.items():
        row = dict(attack=attack, k=k, seeds=[r.get("seed", 0) for r in runs], rounds=min(r["rounds"] for r in runs),
                   target_rounds=runs[0]["target_rounds"], val_loss=mean(runs, "val_loss"),
                   hashes_equal=all(r["hashes_equal"] for r in runs), honest=sum(r["honest"] for r in runs),
                   honest_ok=sum(r["honest_ok"] for r in runs), mean_round_s=mean(runs, "mean_round_s"),
                   round_period_s=mean(runs, "round_period_s"), later_period_s=mean(runs, "later_period_s"),
                   honest_refused=(sum(r["honest_refused"] for r in runs) if all("honest_refused" in r for r in runs)
                                   else None),  # None: runs from before it was counted
                   attacker_failed=any(r.get("attacker_failed") for r in runs),
                   honest_peak_rss_mib=max((r["honest_peak_rss_mib"] for r in runs if r.get("honest_peak_rss_mib")), default=None))
        for key in ("loss_vs_honest", "loss_vs_clean", "time_vs_clean", "period_vs_clean", "later_vs_clean"):
            row[key], row[f"{key}_std"] = mean(runs, key), std(runs, key)
        for key in ("attacker_excluded", "attacker_clipped", "attacker_skipped"):
            row[key] = sorted({p for r in runs for p in r.get(key, [])})
        row["records_ignored"] = all(r.get("records_ignored") for r in runs)
        same = [r["same_theta"] for r in runs if r.get("same_theta") is not None]
        row["same_theta"] = f"{sum(same)}/{len(same)}" if same else "-"
        out.append(row)
    return out


def print_table(results: List[Dict[str, Any]]) -> None:
    def verdict(r):
        if r["attack"] in BASELINES + HONEST:
            return "-"
        if r.get("attacker_failed"):
            return "NOT RUN (the hostile process failed)"
        how = [w for w, key in (("excluded", "attacker_excluded"), ("clipped", "attacker_clipped"),
                                ("skipped", "attacker_skipped"), ("records ignored", "records_ignored")) if r.get(key)]
        return f"yes ({', '.join(how)})" if how else "no"

    def pct(r, key):
        x, spread = r.get(key), r.get(f"{key}_std")
        return "-" if x is None else f"{100 * (x - 1):+.2f} %" + ("" if spread is None else f" ± {100 * spread:.2f}")

    def secs(x):
        return "-" if x is None else f"{x:.1f} s"

    def times(r, key):
        return "-" if r.get(key) is None else f"{r[key]:.2f}x"

    lines = [[r["attack"], str(r.get("k", 1)) if r["attack"] not in HONEST else "-", f"{r['rounds']}/{r['target_rounds']}",
              "-" if r["val_loss"] is None else f"{r['val_loss']:.4f}",
              pct(r, "loss_vs_honest"), pct(r, "loss_vs_clean"),
              "yes" if r["hashes_equal"] else "NO", r.get("same_theta", "-"), f"{r['honest_ok']}/{r['honest']}", "-" if r.get("honest_refused") is None else str(r["honest_refused"]),
              secs(r.get("round_period_s")), times(r, "period_vs_clean"), times(r, "later_vs_clean"),
              times(r, "time_vs_clean"), "-" if not r.get("honest_peak_rss_mib") else f"{r['honest_peak_rss_mib']:.0f} MiB",
              verdict(r)] for r in results]
    seeds = max((len(r.get("seeds", [0])) for r in results), default=1)
    print(table(["attack", "K", "rounds", "honest val loss", "vs honest-only", "vs clean", "θ equal", "θ = honest-only", "honest ok", "honest refused", "round time",
                 "vs clean*", "from round 2*", "latency*", "honest RSS peak", "attacker excluded/clipped"], lines))
    if seeds > 1:
        print(f"\nover {seeds} seeds: figures are means; the loss ratios are paired by seed, mean ± std.")
    print("\nvs honest-only: against the N honest peers and nobody else, the honest tokens of every attacked run (the\n"
          "goal's baseline); vs clean: against N + K honest peers (what the attackers' share adds when it is clipped,\n"
          "not dropped). round time: a peer's wall time from its first step to its last round's end, over the\n"
          "rounds (how often rounds end); from round 2: the same from the first round's end; latency: a round's\n"
          "mean span from its first step to its θ, first round excluded (with overlap it runs over the next round's\n"
          "steps). *against the clean run with as many training\n"
          "processes: 'clean' for attackers that train, 'honest-only' for those that do not. honest ok: honest processes that finished every round and\n"
          "exited normally; θ = honest-only: runs (of the seeds) whose honest peers ended on the honest-only run's θ bit\n"
          "for bit (with --sequential: the attack changed nothing but time); honest refused: (round, honest sender) pairs whose update an honest peer refused; honest RSS peak: the largest proportional resident memory\n"
          "(PSS) of an honest peer with its DHT process and p2p daemon, sampled every 0.5 s. Goals: loss within 2 % of honest-only, 0 honest processes lost, round time within 1.25x.")
