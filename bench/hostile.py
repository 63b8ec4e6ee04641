"""Hostile peers among honest ones, real processes: does the swarm hold?

    python bench/hostile.py [--quick] [--attacks NAME,NAME] [--honest N] [--hostile K] [--rounds R]
                            [--seeds S] [--sequential] [--nice-hostile N] [--json OUT] [--workdir DIR]

Every run is a coordinator and peers on loopback, as processes (``voloco coordinator``, ``voloco
peer --wait-peers … --max-rounds R --threads 1``): N honest peers (``--honest``, default 3) and K
hostile processes of one attack (``--hostile``, default 1). Every peer trains R rounds of H inner
steps, so honest peers train equal tokens in every run. Two clean runs are the baselines:
``honest-only`` (the N honest peers and nobody else: the honest tokens of every attacked run, the
goal's baseline) and ``clean`` (N + K honest peers: as many trainers on the machine as an attack whose
hostile processes train; the 2-core machine is shared, so round times are compared with the clean run
of as many training processes). Per run: the rounds every honest peer completed, the honest peers'
validation loss against both clean runs, whether their parameters are identical, how many honest
processes finished normally (none may exit with an error), their mean round time (first round
excluded: it holds until all peers have started), and whether the attackers were excluded, clipped,
skipped (a straggler no longer waited for), refused (a state one served) or their records ignored
(read from the honest peers' round records, statuses and logs: ids that are not honest ones). In
``state-poison`` one honest peer joins after the first round, so it must download the state; in the
``-late`` attacks the hostile peers join after the first round (fresh identities against peers that
have standing). With ``--seeds S`` every run is repeated with the run seeds 0 .. S-1 (the model's
initialization and the data order); each seed's runs are compared with that seed's clean runs, and
the table gives, per attack, the mean ± std of those paired ratios over the seeds. Peer i of every
run of a seed has the same identity (its key made from the run id, the seed and i): a peer's data
stream follows its id, so an attacked run's honest peers train on the batches of the baseline's.

An attack is one entry of ``ATTACKS``: a name, one line of description and how its hostile processes
are started. A hostile *peer* runs the real peer with one behaviour changed (bench/hostile_peers.py:
this script re-runs itself with ``--as-peer BEHAVIOUR -- PEER FLAGS``). ``poison-X``: every float on
the wire times X; ``negate`` is ``poison=-1``, an honest payload pointing the other way; ``noise``:
Gaussian noise at the honest norm; ``garbage``: the unchanged peer trained on uniformly random ASCII
(``--data``). The others run the hostile processes the multi-process tests use
(tests/support/stalling_peer.py: ``stall``, ``stall-pair``, ``stall-fresh``, ``forged-round``;
tests/support/hostile_exchange.py: ``framer``, ``silent-member``, ``silent-fresh``, ``lurk-fresh``, ``invented-owners``;
tests/support/hostile_records.py: ``forged-records``); they never train, so the honest peers
``--wait-peers N`` in those runs. A new attack is one more line in ``ATTACKS``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))

import numpy as np  # noqa: E402

from bench.common import deprioritize, machine, now, seeded_identity, tree_usage  # noqa: E402
from bench import hostile_table  # noqa: E402
from bench.hostile_table import BASELINES, hostile_of, over_seeds, pool_baselines, print_table  # noqa: E402
from bench.hostile_peers import BEHAVIOURS, run_as_peer  # noqa: E402
from bench.swarm_check import BENCH_SWARM, SEQUENTIAL  # noqa: E402
from swarm.jsonout import dumps as strict_json  # noqa: E402  (NaN -> null: strict JSON)

CONFIGS = {
    # the demo model (0.87M parameters), H = 30
    "full": dict(model={}, data={"batch_size": 16}, inner_steps=30, rounds=5),
    # the tests' tiny model: every run well under a minute
    "quick": dict(model=dict(d_model=64, n_layers=2, n_heads=2, ffn_hidden=128, seq_len=64), data={"batch_size": 8},
                  inner_steps=10, rounds=3),
}
SWARM = dict(BENCH_SWARM, round_wait=30.0, gather_timeout=15.0)


# --- attacks ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    """What an attack needs to start one of its hostile processes."""

    join: str
    run_key: str  # the fingerprint of the run's key (the coordinator's), "" if it wrote none
    rounds: int
    peer_flags: List[str]  # the flags an honest peer in its place would get (its own index, files and identity)
    workdir: Path


@dataclass(frozen=True)
class Attack:
    name: str
    what: str
    argv: Optional[Callable[[Run], List[str]]] = None  # None: the K extra peers are honest
    peer: bool = True  # the hostile process is a peer that trains (honest peers --wait-peers for it)
    late: bool = False  # one honest peer joins after the first round and must download the state
    hostile_late: bool = False  # the hostile peers join after the first round: fresh identities

    @property
    def baseline(self) -> str:
        """The clean run this attack's round time is compared with: as many peers training as here."""
        return "clean" if self.peer else "honest-only"


def hostile_peer(behaviour: str) -> Callable[[Run], List[str]]:
    """The real peer with ``behaviour`` installed (``--as-peer``)."""
    return lambda run: [sys.executable, str(HERE), "--as-peer", behaviour, "--", *run.peer_flags]


def garbage_peer(run: Run) -> List[str]:
    """The unchanged peer, its corpus 4 MB of uniformly random ASCII (bytes 1..127: utf-8 text)."""
    path = run.workdir / "garbage.txt"
    if not path.exists():
        path.write_bytes(np.random.default_rng(0).integers(1, 128, size=4 << 20, dtype=np.uint8).tobytes())
    return [sys.executable, "-m", "voloco", "peer", *run.peer_flags, "--data", str(path)]


def tests_process(module: str, *args: Callable[[Run], str]) -> Callable[[Run], List[str]]:
    """A hostile process of tests/support/ (``python -m tests.support.MODULE ARGS`` from the repository root, wherever
    this script runs from), each argument a function of the run."""
    code = f"import runpy, sys; sys.path.insert(0, {str(HERE.parents[1])!r}); runpy.run_module('tests.support.{module}', run_name='__main__')"
    return lambda run: [sys.executable, "-c", code, *(a(run) for a in args)]


_join, _key, _rounds = (lambda run: run.join), (lambda run: run.run_key), (lambda run: str(run.rounds))
_const = lambda text: (lambda run: text)  # noqa: E731

ATTACKS: Dict[str, Attack] = {a.name: a for a in [
    Attack("clean", "N + K honest peers: as many trainers as an attack whose hostile peers train"),
    Attack("honest-only", "the N honest peers and nobody else: the honest tokens of every attacked run", lambda run: [],
           peer=False),
    Attack("honest-again", "the honest-only run once more, nobody else: how far timing alone (overlap, early close) "
           "moves two runs of the same peers", lambda run: [], peer=False),
    Attack("poison-1e2", "a groupmate's well-formed payload, values x1e2", hostile_peer("poison=1e2")),
    Attack("poison-1e4", "a groupmate's well-formed payload, values x1e4", hostile_peer("poison=1e4")),
    Attack("poison-1e29", "a groupmate's well-formed payload, values x1e29", hostile_peer("poison=1e29")),
    Attack("negate", "a groupmate's honest payload, every value negated: honest norm, the opposite direction",
           hostile_peer("poison=-1")),
    Attack("negate-late", "negate, from fresh identities that join after the first round (honest peers have standing)",
           hostile_peer("poison=-1"), hostile_late=True),
    Attack("covert", "a groupmate's honest payload whose largest values are negated and carry its whole norm, the "
           "rest kept in sign at a thousandth: signs that mostly agree, mass that points back", hostile_peer("covert")),
    Attack("negate-big", "a groupmate's pseudo-gradient negated on its largest fifth of tensors (most of its mass), "
           "honest on the rest", hostile_peer("negate-big")),
    Attack("noise", "Gaussian noise at each tensor's honest norm in place of the pseudo-gradient: no information",
           hostile_peer("noise")),
    Attack("garbage", "an unchanged peer whose corpus is uniformly random ASCII: honest work on garbage data",
           garbage_peer),
    Attack("stall", "a progress record 'training' at the current round from a peer that never joins a group",
           tests_process("stalling_peer", _join, _key, _const("stall"), _const("3600")), peer=False),
    Attack("stall-pair", "two identities that claim 'training' and, both, a set of the round gathered in a group of their own",
           tests_process("stalling_peer", _join, _key, _const("pair"), _const("3600")), peer=False),
    Attack("stall-fresh", "stall under a new identity every round: no strike ever applies to it",
           tests_process("stalling_peer", _join, _key, _const("fresh"), _const("3600")), peer=False),
    Attack("forged-round", "a progress record at round 2**62 (blocks catch-up if believed)",
           tests_process("stalling_peer", _join, _key, _const("far-ahead"), _const("3600")), peer=False),
    Attack("framer", "a groupmate that lies about every other member's payload digest",
           tests_process("hostile_exchange", _join, _rounds, _const("frame")), peer=False),
    Attack("silent-member", "a groupmate that joins every group it can and then sends nothing (its gather waits out the deadline)",
           tests_process("hostile_exchange", _join, _rounds, _const("silent")), peer=False),
    Attack("silent-fresh", "silent-member under a new identity every round: no refusal or strike of an earlier round reaches it",
           tests_process("hostile_exchange", _join, _rounds, _const("silent-fresh")), peer=False),
    Attack("lurk-fresh", "silent-fresh whose record never says 'ready': no barrier sizes a group for it, and it "
           "joins one to fill a ready peer's seat", tests_process("hostile_exchange", _join, _rounds, _const("lurk-fresh")),
           peer=False),
    Attack("invented-owners", "a groupmate that lists invented owners with huge payloads in its table",
           tests_process("hostile_exchange", _join, _rounds, _const("invent")), peer=False),
    Attack("forged-records", "a DHT node that writes a run spec with lr 50, progress at round 2**62 under every "
           "peer's id and a chain assignment naming itself, with far expirations",
           tests_process("hostile_records", _join, _const("bench-hostile"), _const("3600")), peer=False),
    Attack("record-flood", "a DHT node that stores valid 16 KB records at every node it meets, 16 MiB/s in all, "
           "into their storage and their cache", tests_process("record_flood", _join, _const("3600"), _const("16")), peer=False),
    Attack("state-poison", "a groupmate that serves a late joiner θ shifted by 1 % noise (finite: only the hash tells)",
           hostile_peer("serve-poison=shift"), late=True),
]}
RENAMED = {"clean-3": "honest-only"}  # names in --json files of earlier runs
# each run of a seed against that seed's baselines; its round time against ``Attack.baseline``
compare = functools.partial(hostile_table.compare, baseline_of={name: a.baseline for name, a in ATTACKS.items()})


# --- one run ----------------------------------------------------------------------------------------
def make_spec(cfg: Dict[str, Any], seed: int = 0, sequential: bool = False, max_overlap: float = 1.0):
    """The run's spec; ``sequential``: no overlap and no early close (bench/swarm_check.py), so that a
    run's θ depends only on what entered each round, not on when its exchange ended."""
    from protocol.spec import ModelSpec, RunSpec

    outer = {"inner_steps": cfg["inner_steps"], "max_overlap": max_overlap, **(SEQUENTIAL if sequential else {})}
    return RunSpec(run_id="bench-hostile", seed=seed, model=ModelSpec(**cfg["model"])).replace(
        data=cfg["data"], outer=outer, swarm=SWARM)


def run_attack(attack: Attack, spec, rounds: int, workdir: Path, timeout: float, honest: int = 3,
               hostile: int = 1, nice: int = 0) -> Dict[str, Any]:
    """Start the run (peers 0 .. honest-1 honest, then ``hostile`` processes of the attack, at niceness
    ``nice``), wait until every honest peer has stopped (or ``timeout``), read what they report."""
    from voloco.demo import Child, coordinator_up, peer_argv, read_status

    shutil.rmtree(workdir, ignore_errors=True)  # a previous run's address file and statuses would be read as this one's
    workdir.mkdir(parents=True)
    (workdir / "run.toml").write_text(spec.to_toml())
    t0 = time.monotonic()
    children: List[Any] = []
    total = honest + hostile
    try:
        join, key = coordinator_up(workdir, workdir / "run.toml", children)
        trains = attack.argv is None or attack.peer  # a non-peer never starts training
        # who joins after the first round (its state comes from a download): waits for nobody
        late = {honest - 1} if attack.late else set(range(honest, total)) if attack.hostile_late else set()
        wait = (total if trains else honest) - len(late)
        deadline = t0 + timeout
        slots: List[Any] = [None] * total
        for i in [j for j in range(total) if j not in late] + sorted(late):
            if i in late:
                while (read_status(workdir, 0) or {}).get("round", 0) < 1 and time.monotonic() < deadline:
                    time.sleep(0.5)
            argv = peer_argv(join, workdir, i, run_key=key) + ["--wait-peers", str(1 if i in late else wait),
                                                               "--max-rounds", str(rounds)]
            seeded_identity(workdir / f"peer{i}" / "identity.key", spec, i)
            if i >= honest and attack.argv is not None:
                argv = attack.argv(Run(join, key or "", rounds, argv[4:], workdir))
                if not argv:  # no hostile process
                    continue
            slots[i] = Child(f"peer{i}", argv, workdir / f"peer{i}.log")
            if i >= honest and nice:
                deprioritize(slots[i].proc.pid, nice)
            children.append(slots[i])
        watched = slots[:honest] if attack.argv is not None else slots
        peak_rss = [0] * len(watched)  # each honest peer's process tree (its DHT process and p2p daemon too), PSS
        while any(c.proc.poll() is None for c in watched) and time.monotonic() < deadline:
            peak_rss = [max(m, tree_usage(c.proc.pid)["pss_kib"] * 1024) for m, c in zip(peak_rss, watched)]
            time.sleep(0.5)
        codes = [c.proc.poll() for c in watched]
        # a hostile process that died on its own (a bad argument, an import error) attacked nothing
        failed = [(i, c.proc.poll()) for i, c in enumerate(slots) if i >= honest and attack.argv is not None and c is not None
                  and c.proc.poll() not in (None, 0)]
    finally:
        for c in reversed(children):
            c.stop(grace=10.0)
    statuses = [read_status(workdir, i) for i in range(len(watched))]
    logs = [(workdir / f"peer{i}.log").read_text(errors="replace") for i in range(len(watched))]
    result = summarize(attack, statuses, codes, logs, rounds, time.monotonic() - t0)
    result.update(attacker_failed=bool(failed), honest_peers=honest, hostile_peers=hostile if attack.argv is not None else 0,
                  honest_peak_rss_mib=round(max(peak_rss, default=0) / 2**20, 1))
    for i, code in failed:
        print(f"  {attack.name}: hostile process {i} exited with code {code} (see {workdir / f'peer{i}.log'})")
    return result


def summarize(attack: Attack, statuses, codes, logs: List[str], rounds: int, wall: float) -> Dict[str, Any]:
    live = [s for s in statuses if s]
    ids = {s["peer_id"] for s in live}
    records = [r for s in live for r in s["history"]]
    seconds = [r["seconds"] for s in live for r in s["history"][1:]] or [r["seconds"] for r in records]
    periods = [round_period(s["history"]) for s in live]
    later = [round_period(s["history"], after_first=True) for s in live]
    vals = [s["val_loss"] for s in live if isinstance(s.get("val_loss"), float) and math.isfinite(s["val_loss"])]
    named = lambda pattern: sorted({pid for text in logs for pid in re.findall(pattern, text)} - ids)  # noqa: E731
    excluded = {pid for r in records for pid in r["excluded"] if pid not in ids}
    # false exclusions: an honest peer's update refused in a round, by any honest peer's record
    honest_refused = {(r["round"], pid) for r in records for pid in r["excluded"] if pid in ids}
    logged = [(p, w.strip()) for text in logs
              for p, w in re.findall(r"(?:excluded the update|rejected the payload) of (\S+): (.*)", text)]
    excluded |= {p for p, _ in logged} - ids
    excluded |= set(named(r"refused the state (\S+) served"))
    # why the honest peers excluded each attacker (its size, its direction, its silence...)
    reasons = [*((p, w) for r in records for p, w in r["excluded"].items()), *logged]
    why = {pid: sorted({w for p, w in reasons if p == pid}) for pid in sorted(excluded)}
    skipped = {pid for text in logs for line in re.findall(r"not waiting again for (.+?) until", text)
               for pid in line.split(", ")} - ids
    # forged records are dropped by every node's validators (nothing logs them): what counts is that
    # no honest peer took one (the run's spec, an honest round, no chain)
    spec_digests = {s.get("spec") for s in live}
    hashes = {s["params_hash"] for s in live}
    ignored = bool(live) and len(spec_digests) == 1 and all(s["round"] <= rounds and not s.get("chain") for s in live)
    return dict(
        attack=attack.name, what=attack.what, rounds=min((s["round"] for s in live), default=0), target_rounds=rounds,
        initial_val_loss=max((s["initial_val_loss"] for s in live), default=None), val_losses=[s["val_loss"] for s in live],
        val_loss=statistics.fmean(vals) if vals and len(vals) == len(live) else None,
        hashes_equal=len(hashes) == 1 and len(live) == len(statuses),
        final_hash=next(iter(hashes)) if len(hashes) == 1 else None,
        honest=len(statuses), honest_ok=sum(1 for s, c in zip(statuses, codes) if s and c == 0 and s["round"] >= rounds),
        exit_codes=codes, mean_round_s=statistics.fmean(seconds) if seconds else None,
        round_period_s=statistics.fmean(periods) if periods and None not in periods else None,
        later_period_s=statistics.fmean(later) if later and None not in later else None,
        attacker_excluded=sorted(excluded), attacker_excluded_why=why, attacker_clipped=named(r"clipped the update of (\S+) "),
        attacker_skipped=sorted(skipped), records_ignored=ignored and attack.name == "forged-records", wall_s=round(wall, 1),
        honest_refused=len(honest_refused),
    )


def round_period(history: List[Dict[str, Any]], after_first: bool = False) -> Optional[float]:
    """A peer's wall time a round: from its first round's first step to its last round's end, over the
    rounds (the first round's hold included; the start quorum's wait before it not); ``after_first``:
    from the first round's end (what a run pays a round once it is under way). A record's ``seconds``
    runs from its first step to its θ and so, with overlap, over the next round's steps: their mean
    is each round's latency, not how often rounds end. None for records without ``ended``."""
    if len(history) < 1 + after_first or not all(r.get("ended") for r in history):
        return None
    if after_first:
        return (history[-1]["ended"] - history[0]["ended"]) / (len(history) - 1)
    return (history[-1]["ended"] - (history[0]["ended"] - history[0]["seconds"])) / len(history)


SETTINGS = ("config", "rounds", "honest", "sequential", "max_overlap")  # what runs pooled together must share


def load_results(ap: argparse.ArgumentParser, path: Path, like: Optional[Dict[str, Any]] = None):
    """The runs of an earlier --json output (attacks renamed since then under today's names) and its
    settings; ``like``: settings it must share (another file's)."""
    try:
        saved = json.loads(path.read_text())
        runs = saved["results"]
        for r in runs:
            r["attack"] = RENAMED.get(r["attack"], r["attack"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        ap.error(f"{path}: not the --json output of this benchmark ({e!r})")
    settings = {key: saved.get(key) for key in SETTINGS}
    differ = [key for key in SETTINGS if like is not None and settings[key] != like[key]]
    if differ:
        ap.error(f"{path}: its runs differ from the table's in {', '.join(differ)}: their baselines do not pool")
    return runs, settings


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the tests' tiny model, 3 rounds of H = 10: a smoke test")
    ap.add_argument("--attacks", default=",".join(ATTACKS),
                    help=f"comma-separated attacks to run, in this order (default: all: {', '.join(ATTACKS)}); "
                    "the clean runs they are compared with are added: 'honest-only' (the N honest peers, the honest "
                    "tokens of an attacked run) and, where an attacker trains, 'clean' (N + K honest peers)")
    ap.add_argument("--honest", type=int, default=3, help="honest peers in every run, N (default: 3)")
    ap.add_argument("--hostile", default="1",
                    help="hostile processes of the attack in a run, K, or several: 1,2,3 runs every attack (and 'clean', "
                    "N + K honest peers) once per K, against one 'honest-only' run per seed (default: 1)")
    ap.add_argument("--rounds", type=int, help="rounds every peer trains (default: 5, --quick 3)")
    ap.add_argument("--seeds", type=int, default=1,
                    help="run every attack (and the clean runs) with the run seeds 0 .. S-1 and report the mean "
                    "± std of the per-seed ratios (default: 1)")
    ap.add_argument("--sequential", action="store_true",
                    help="peers train no step ahead of a round's exchange and close no round early: a run's θ then "
                    "depends only on what entered each round, and the table's 'θ = honest-only' says whether an "
                    "attack changed it at all (default: the spec's overlap, as real peers run)")
    ap.add_argument("--max-overlap", type=float, default=1.0, metavar="F",
                    help="outer.max_overlap of every run: at most F x H steps ahead of an exchange in flight (default: 1.0; "
                    "not with --sequential)")
    ap.add_argument("--nice-hostile", type=int, default=0, metavar="N",
                    help="run the hostile processes at niceness N (1-19): on this shared machine they then take CPU "
                    "mostly while the honest peers wait, as attackers on machines of their own would not take it "
                    "at all; what is left of an attack's round time is what the swarm's protocol costs (default: 0)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take before it is stopped (default: 600)")
    ap.add_argument("--workdir", type=Path, help="where every run's logs and status files go (default: a temporary folder)")
    ap.add_argument("--json", type=Path, metavar="OUT", help="also write every run's figures as JSON to OUT")
    ap.add_argument("--table", type=Path, metavar="IN", help="print the table of an earlier run's --json output and exit")
    ap.add_argument("--baselines-from", type=Path, nargs="+", metavar="JSON", default=[],
                    help="with --table: these --json outputs' honest runs (honest-only, honest-again) of the same "
                         "seeds join IN's, and each seed's baseline is their mean (timing noise: two honest runs "
                         "of one seed differ by a few %%)")
    ap.add_argument("--as-peer", metavar="BEHAVIOUR",
                    help=f"internal, how this script starts a hostile peer: install BEHAVIOUR ({', '.join(BEHAVIOURS)}, "
                    "e.g. poison=1e4) and run `voloco peer` with the flags after `--`")
    if "--as-peer" in argv and "--" in argv:
        cut = argv.index("--")
        args = ap.parse_args(argv[:cut])
        return run_as_peer(args.as_peer, argv[cut + 1:])
    args = ap.parse_args(argv)
    if args.baselines_from and not args.table:
        ap.error("--baselines-from pools the baselines of a table: it needs --table")
    if args.table:
        saved, settings = load_results(ap, args.table)
        if args.baselines_from:
            saved = pool_baselines(saved, [r for path in args.baselines_from for r in load_results(ap, path, settings)[0]])
        for seed in sorted({r.get("seed", 0) for r in saved}):
            mine = [r for r in saved if r.get("seed", 0) == seed]
            base = [r for r in mine if r["attack"] == "honest-only"]
            for k in sorted({hostile_of(r) for r in mine} - {0}):
                compare(base + [r for r in mine if hostile_of(r) == k])
        print_table(over_seeds(saved))
        return 0
    names = [RENAMED.get(n.strip(), n.strip()) for n in args.attacks.split(",") if n.strip()]
    unknown = [n for n in names if n not in ATTACKS]
    if unknown:
        ap.error(f"unknown attack(s) {', '.join(unknown)}; have: {', '.join(ATTACKS)}")
    # honest-only for every attack; clean (N + K honest) only where an attacker trains, for its round time
    attacks = [ATTACKS[n] for n in names if n not in BASELINES]
    needed = {"honest-only"} if attacks else set()
    needed |= {"clean"} if any(a.baseline == "clean" for a in attacks) else set()
    baselines = [b for b in BASELINES if b in names or b in needed]
    names = baselines + [n for n in names if n not in baselines]
    name = "quick" if args.quick else "full"
    cfg = CONFIGS[name]
    rounds = args.rounds or cfg["rounds"]
    if rounds < 2:
        ap.error("--rounds must be at least 2")
    if args.seeds < 1:
        ap.error("--seeds must be at least 1")
    try:
        ks = sorted({int(k) for k in args.hostile.split(",") if k.strip()})
    except ValueError:
        ap.error(f"--hostile {args.hostile!r}: comma-separated counts, e.g. 1,2,3")
    if args.honest < 2 or not ks or ks[0] < 1:
        ap.error("--honest must be at least 2 and every --hostile count at least 1")
    if not 0.0 < args.max_overlap <= 1.0:
        ap.error(f"--max-overlap {args.max_overlap}: a fraction of H in (0, 1]")
    if not 0 <= args.nice_hostile <= 19:
        ap.error(f"--nice-hostile {args.nice_hostile}: a niceness from 0 to 19")
    if args.sequential and args.max_overlap < 1.0:
        ap.error("--max-overlap caps the steps of an overlapped round: it means nothing with --sequential")
    spec = make_spec(cfg, sequential=args.sequential, max_overlap=args.max_overlap)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="voloco-hostile-"))
    print(f"bench/hostile.py ({name}): {now()}, {machine()}\n{spec.outer.strategy}, "
          f"{spec.model.num_params():,} parameters, {args.honest} honest peers + {','.join(map(str, ks))} hostile, {rounds} rounds of H={spec.outer.inner_steps}"
          f"{', sequential (no overlap, no early close)' if args.sequential else ''}"
          f"{f', outer.max_overlap {args.max_overlap:g}' if args.max_overlap < 1 else ''}"
          f"{f', hostile processes at niceness {args.nice_hostile}' if args.nice_hostile else ''}; "
          f"logs in {workdir}", flush=True)
    t0 = time.monotonic()
    results = []
    for seed in range(args.seeds):
        def one(n: str, k: int) -> Dict[str, Any]:
            where = workdir / (f"{n}" if n == "honest-only" else f"{n}-k{k}")
            where = where if args.seeds == 1 else workdir / f"seed{seed}" / where.name
            r = dict(run_attack(ATTACKS[n], make_spec(cfg, seed, args.sequential, args.max_overlap), rounds, where, args.timeout, args.honest, k,
                                args.nice_hostile), seed=seed,
                     k=0 if n == "honest-only" else k)
            print(f"  {n}{'' if n == 'honest-only' else f' K={k}'}{'' if args.seeds == 1 else f' (seed {seed})'}: "
                  f"{r['rounds']}/{rounds} rounds, val {r['val_loss']}, honest ok {r['honest_ok']}/{r['honest']}, "
                  f"{r['wall_s']:.0f} s", flush=True)
            return r

        base = [one("honest-only", 0)] if "honest-only" in names else []
        results += base
        for k in ks:
            runs = [one(n, k) for n in names if n != "honest-only"]
            compare(base + runs)  # each seed's runs against that seed's clean runs of the same K
            results += runs
    print()
    print_table(over_seeds(results))
    print(f"\ntotal {time.monotonic() - t0:.0f} s")
    if args.json:
        args.json.write_text(strict_json(dict(config=cfg, name=name, rounds=rounds, date=now(), machine=machine(),
                                             honest=args.honest, hostile=ks, sequential=args.sequential,
                                             max_overlap=args.max_overlap, nice_hostile=args.nice_hostile,
                                             results=results), indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
