"""Long runs of a few honest peers on a loaded host: how often is an honest member's update lost?

    python bench/honest_rounds.py [--peers 3] [--seeds 3] [--rounds 100] [--H 10] [--load 4]
                                  [--nice 0,5,10] [--swarm tests|defaults] [--max-group-size N]
                                  [--arms waits,hasty,hasty-no-late] [--json OUT] [--workdir DIR]

For each seed: a coordinator and ``--peers`` honest peers as processes on loopback
(tests/support/swarm_harness.py, the tiny model, SparseLoCo, ``--threads 1``, ``--wait-peers`` all of them;
the tests' short ``[swarm]`` waits, or with ``--swarm defaults`` the spec's own, as a user's run has),
trained for ``--rounds`` rounds while ``--load`` processes spin on the CPU beside them (a busy loop
each, at normal priority: the load average it makes is sampled and printed), peer i at the niceness
``--nice`` gives it (mixed speeds: the slower peers close rounds early, groups form while a peer is
still training, and matchmaking waits out its leader's expiration). Nobody is hostile, so
every round should be one group of every peer, with every payload counted. Per seed, over the rounds
every peer recorded:

- ``excluded``: rounds in which a peer's record excludes a member (nobody hostile: each is an
  honest update lost for that round);
- ``refused``: rounds in which the direction check refused an honest update (peer/outer/consensus.py:
  a false positive; the sender keeps the update in its error feedback);
- ``short``: rounds whose group lacked a peer of the run (it gathered elsewhere, or alone);
- ``took set``: rounds a peer ended by taking another group's set or deferring ("taking their set",
  "our group completed it", "found no group" in its log);
- ``states``: states a peer installed (it fell behind and caught up by download);
- ``cleared``: of those, installs that zeroed the peer's local buffers (the state was more than
  ``Timing.keep_local_rounds`` past its own round): the updates they held are lost;
- ``θ apart``: rounds whose peers' parameter hashes differ;
- ``lost s``: the seconds those rounds took beyond the run's median round;
- ``late joins``: members that learnt of their group only from the others' requests and joined it
  (peer/exchange/late_join.py: each one a member that would otherwise have been excluded).

- ``late sets`` / ``group takes``: rounds a peer concluded again with sets a slower group named after
  its merge (peer/round/union.py ``take_named_sets``) / with sets its next group held.

``--arms`` runs each seed once per arm: ``waits``, the peers as they are; ``hasty``, peers whose merge
never waits for another group (tests/support/hasty_peer.py: every group that gathers first concludes
without the later groups' sets, the split a slow group causes, made to happen every round); and
``hasty-no-late``, the same without taking the late sets before the next matchmaking (the behaviour
before it). With ``--max-group-size`` below ``--peers`` a round forms several groups.

The failure this finds: a follower that missed the message naming its group (peer/exchange/late_join.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import deprioritize, exit_on_sigterm, machine, now, table  # noqa: E402
from swarm.jsonout import dumps as strict_json  # noqa: E402
from tests.support.swarm_harness import TINY_SPEC, Swarm, refused_senders  # noqa: E402

TOOK_SET = ("taking their set", "our group completed it", "found no group")
LATE_JOIN = "its message naming the group had missed us"
LATE_SETS = "of the round that another group named after our merge into its union"  # peer/round/union.py
GROUP_TAKES = "of the round that our group held into its union"
ARMS = ("waits", "hasty", "hasty-no-late")
INSTALLED = "installed the state of round"
CLEARED = "cleared this peer's local"  # peer/round/state_sync.py: a state too far ahead zeroed its buffers


def _done(status, rounds: int) -> bool:
    return bool(status) and (status.get("round", 0) >= rounds or status.get("state") == "stopped")


class Load:
    """``n`` busy-loop processes, and the 1-minute load average sampled every 5 s while they run."""

    def __init__(self, n: int):
        # a session each: scheduled as the peers are (each one session, weighed against the others by autogroup)
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(n)]
        self.samples, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(5.0):
            self.samples.append(os.getloadavg()[0])

    def close(self) -> None:
        self._stop.set()
        for p in self.procs:
            p.kill()
            p.wait()


def spec_text(seed: int, H: int, swarm: str = "tests", max_group_size: int = 0) -> str:
    text = TINY_SPEC.format(run_id=f"honest-{seed}", strategy="sparseloco", inner_steps=H).replace("seed = 1", f"seed = {seed}")
    text = text.split("[swarm]")[0] if swarm == "defaults" else text
    if max_group_size:
        text += ("" if "[swarm]" in text else "\n[swarm]\n") + f"max_group_size = {max_group_size}\n"
    return text


def run_seed(args, seed: int, workdir: Path, arm: str = "waits") -> dict:
    swarm = Swarm(workdir, spec_text=spec_text(seed, args.H, args.swarm, args.max_group_size))
    names = [f"p{i}" for i in range(args.peers)]
    t0 = time.monotonic()
    module = "voloco" if arm == "waits" else "tests.support.hasty_peer"
    env = {"VOLOCO_HASTY_NO_LATE_SETS": "1"} if arm == "hasty-no-late" else None
    try:
        for name, nice in zip(names, args.nice):
            proc = swarm.add_peer(name, "--wait-peers", str(args.peers), "--max-rounds", str(args.rounds + 5), checkpoint=False,
                                  module=module, env=env)
            deprioritize(proc.proc.pid, nice)
        # past the counted rounds, or stopped at --max-rounds: a peer that caught up by state
        # completed fewer rounds itself than the run's round number
        swarm.wait(lambda: all(_done(swarm.status(n), args.rounds) for n in names), args.timeout,
                   f"{args.rounds} rounds on every peer")
        statuses = {n: swarm.status(n) for n in names}
        logs = {n: swarm.peers[n].text() for n in names}
    finally:
        swarm.close()
    ids = {s["peer_id"] for s in statuses.values()}
    by_round = {}
    for s in statuses.values():
        for r in s["history"]:
            by_round.setdefault(r["round"], []).append(r)
    rounds = sorted(by_round)[: args.rounds]
    median = statistics.median(max(r["seconds"] for r in by_round[n]) for n in rounds)
    bad = {"excluded": set(), "refused": set(), "short": set(), "apart": set()}
    for n in rounds:
        recs = by_round[n]
        if any(set(r["excluded"]) - refused_senders(r) for r in recs):
            bad["excluded"].add(n)
        if any(refused_senders(r) for r in recs):
            bad["refused"].add(n)
        if any(set(r["group"]) != ids for r in recs) or len(recs) < len(ids):
            bad["short"].add(n)
        if len({r["params_hash"] for r in recs}) > 1:
            bad["apart"].add(n)
    took = sum(text.count(phrase) for text in logs.values() for phrase in TOOK_SET)
    late = sum(text.count(LATE_JOIN) for text in logs.values())
    any_bad = set().union(*bad.values())
    lost = sum(max(0.0, max(r["seconds"] for r in by_round[n]) - median) for n in any_bad)
    return dict(seed=seed, arm=arm, rounds=len(rounds),
                late_sets=sum(text.count(LATE_SETS) for text in logs.values()),
                group_takes=sum(text.count(GROUP_TAKES) for text in logs.values()), excluded=len(bad["excluded"]), refused=len(bad["refused"]),
                short=len(bad["short"]), took_set=took, states=sum(text.count(INSTALLED) for text in logs.values()),
                cleared=sum(text.count(CLEARED) for text in logs.values()),
                apart=len(bad["apart"]), lost_s=lost, late_joins=late, median_round_s=median, wall_s=time.monotonic() - t0,
                bad_rounds=sorted(any_bad))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=3, help="honest peers per run (default 3)")
    ap.add_argument("--seeds", type=int, default=3, help="runs, one per seed 1..N (default 3)")
    ap.add_argument("--rounds", type=int, default=100, help="rounds counted per run (default 100)")
    ap.add_argument("--H", type=int, default=10, help="inner steps per round (default 10)")
    ap.add_argument("--load", type=int, default=4, help="busy-loop processes beside the peers (default 4)")
    ap.add_argument("--nice", default="0,5,10", help="niceness of peer 0, 1, ... (the last repeats; default 0,5,10)")
    ap.add_argument("--swarm", default="tests", choices=("tests", "defaults"),
                    help="[swarm] waits: the tests' short ones (default) or the spec's defaults (matchmaking 3 s, gather 30 s)")
    ap.add_argument("--max-group-size", type=int, default=0,
                    help="swarm.max_group_size of the run (default: the spec's); below --peers, a round forms several groups")
    ap.add_argument("--arms", default="waits",
                    help="comma-separated, each run once per seed: waits (the peers as they are), hasty (merges never wait "
                         "for another group), hasty-no-late (hasty, the late sets not taken); default waits")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds one run may take (default 3600)")
    ap.add_argument("--json", type=Path, metavar="OUT", help="also write the rows as JSON to OUT")
    ap.add_argument("--workdir", type=Path, help="keep every run's logs and status files here (default: a temporary folder, removed)")
    args = ap.parse_args(argv)
    try:
        nice = [int(n) for n in args.nice.split(",")]
    except ValueError:
        ap.error(f"--nice must be comma-separated integers, not {args.nice!r}")
    args.nice = (nice + [nice[-1]] * args.peers)[: args.peers]
    if min(args.peers - 1, args.seeds, args.rounds, args.H) < 1 or args.load < 0 or args.timeout <= 0 or args.max_group_size < 0:
        ap.error("--peers must be >= 2, --seeds, --rounds and --H >= 1, --load and --max-group-size >= 0, --timeout > 0")
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not args.arms or any(a not in ARMS for a in args.arms):
        ap.error(f"--arms takes a comma-separated list of {', '.join(ARMS)}")
    exit_on_sigterm()
    print(f"bench/honest_rounds.py: {now()}, {machine()}; {args.peers} peers, H={args.H}, {args.rounds} rounds x "
          f"{args.seeds} seeds, {args.load} busy loops, niceness {args.nice}, {args.swarm} waits", flush=True)
    rows = []
    load = Load(args.load)
    try:
        with contextlib.ExitStack() as stack:
            tmp = args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="voloco-honest-"))
            Path(tmp).mkdir(parents=True, exist_ok=True)
            for seed, arm in [(s, a) for s in range(1, args.seeds + 1) for a in args.arms]:
                workdir = Path(tmp) / (f"seed{seed}" if arm == "waits" else f"seed{seed}-{arm}")
                workdir.mkdir(exist_ok=args.workdir is not None)
                row = run_seed(args, seed, workdir, arm)
                row["load"] = statistics.mean(load.samples[-max(1, int(row["wall_s"] / 5)):]) if load.samples else 0.0
                rows.append(row)
                print(f"  seed {seed} {arm}: {row['rounds']} rounds, {row['apart']} with θ apart, {row['excluded']} with an exclusion, {row['refused']} with a "
                      f"refusal, {row['short']} short, {row['states']} states installed, "
                      f"load {row['load']:.1f}, bad rounds {row['bad_rounds']}", flush=True)
    finally:
        load.close()
    cols = ["seed", "arm", "rounds", "excluded", "refused", "short", "took set", "states", "cleared", "θ apart", "late sets",
            "group takes", "lost s", "late joins", "median round s", "load avg"]
    lines = [[str(r["seed"]), r["arm"], str(r["rounds"]), str(r["excluded"]), str(r["refused"]), str(r["short"]), str(r["took_set"]),
              str(r["states"]), str(r["cleared"]), str(r["apart"]), str(r["late_sets"]), str(r["group_takes"]),
              f"{r['lost_s']:.1f}", str(r["late_joins"]), f"{r['median_round_s']:.2f}", f"{r['load']:.1f}"] for r in rows]
    for arm in args.arms:
        of = [r for r in rows if r["arm"] == arm]
        total = ["all", arm, str(sum(r["rounds"] for r in of))] + [str(sum(r[k] for r in of)) for k in (
            "excluded", "refused", "short", "took_set", "states", "cleared", "apart", "late_sets", "group_takes")]
        lines.append(total + [f"{sum(r['lost_s'] for r in of):.1f}", str(sum(r["late_joins"] for r in of)), "", ""])
    print("\n" + table(cols, lines))
    if args.json:
        args.json.write_text(strict_json(dict(date=now(), machine=machine(), args=vars(args) | {"json": str(args.json), "workdir": str(args.workdir or "")},
                                              rows=rows), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
