"""What the benchmark scripts share: the machine line, byte sizes, plain-text tables, the arms'
process pool and the warm start every arm of a run starts from."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import platform
import signal
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from protocol.spec import RunSpec
from swarm.wire.meter import process_tree


def exit_on_sigterm() -> None:
    """SIGTERM ends the benchmark as Ctrl+C does: through its ``with`` blocks and ``finally`` clauses, so
    the test hosts (network namespaces) and the peers in them are torn down, not left running."""
    def stop(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def machine() -> str:
    return f"{platform.machine()} {os.cpu_count()} CPU cores, torch {torch.__version__}"


def now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f}"


def spread(xs: Sequence[float]) -> float:
    """The sample standard deviation of ``xs`` (the ± of a benchmark's mean over seeds); 0.0 for fewer
    than two values (one seed has no spread)."""
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def table(cols, lines, left=1) -> str:
    """Columns padded to their widest cell: the first ``left`` ones left-aligned, the others right."""
    widths = [max([len(c)] + [len(line[i]) for line in lines]) for i, c in enumerate(cols)]  # no lines: the header alone
    fmt = lambda row: "  ".join(v.ljust(w) if i < left else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths)))  # noqa: E731
    return "\n".join([fmt(cols), "  ".join("-" * w for w in widths)] + [fmt(line) for line in lines])


def best_of(fn, repeats: int):
    """(fn()'s result, the fastest of ``repeats`` wall-clock timings of it, in seconds)."""
    out, best = None, float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return out, best


def run_jobs(fn: Callable[[Any], Any], work: Sequence[Any], jobs: int) -> List[Any]:
    """``fn`` over ``work`` in order: here with one job, else in ``jobs`` spawned processes."""
    if jobs <= 1:
        return [fn(w) for w in work]
    import multiprocessing as mp

    with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
        return list(pool.map(fn, work))


def add_arm_flags(ap) -> None:
    """The flags of a benchmark whose arms are simulations run in a process pool over seeds
    (``run_summarized``): --seeds, --jobs, --threads, --json."""
    from pathlib import Path

    ap.add_argument("--seeds", type=int, default=3, help="seeds per arm, 0..N-1 (default 3)")
    ap.add_argument("--jobs", type=int, default=2, help="arms run at a time, each in its own process (default 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per arm (default 1)")
    ap.add_argument("--json", type=Path, help="write every run and the summary as JSON here")


def run_summarized(fn: Callable[[Any], Any], work: Sequence[Any], jobs: int, summarize: Callable, show: Callable,
                   json_path=None, **doc) -> Tuple[List[Any], Any]:
    """``run_jobs``, then the summary of its rows printed (``show``) with the wall seconds, and the
    rows, the summary and ``doc`` written as strict JSON to ``json_path`` if given."""
    from swarm.jsonout import dumps as strict_json

    t = time.monotonic()
    rows = run_jobs(fn, work, jobs)
    summary = summarize(rows)
    print()
    show(summary)
    print(f"\n{time.monotonic() - t:.0f} s in all")
    if json_path is not None:
        json_path.write_text(strict_json(dict(doc, runs=rows, summary=summary, machine=machine(), date=now())))
    return rows, summary


def warm_start(spec: RunSpec, steps: int, log=print) -> Tuple[Any, float]:
    """θ after ``steps`` single-process steps on a shard no arm trains on: the shared start of
    every arm (DiLoCo's protocol), and its validation loss. Its inner optimizer is not carried over."""
    from peer.training.data import load_corpus
    from peer.round.simulate import train_single

    t = time.monotonic()
    ws = train_single(spec, steps, corpus=load_corpus("stdlib"), shard="warm-start", keep_theta=True)
    log(f"  warm start: {steps} single-process steps shared by every arm, val {ws.final_val_loss:.4f} "
        f"({time.monotonic() - t:.0f} s; not counted in the tokens below)", flush=True)
    return ws.theta, ws.final_val_loss


def time_inner_steps(spec: RunSpec, corpus, steps: int, batch: int = 0, shard: str = "bench",
                     keep_start: bool = True):
    """``steps`` inner steps of ``spec``'s model as a peer's InnerTrainer runs them, after one warm-up
    step that makes AdamW's state: (the model, its parameters before the warm-up, the wall and the
    CPU seconds of each timed step). ``batch``: sequences a step (0: the spec's). ``keep_start``
    False: no copy of the parameters is made (None in its place; a 125m copy is about 0.5 GB)."""
    from peer.training.data import TrainStream
    from peer.training.inner import InnerTrainer
    from peer.training.model import build_model

    model = build_model(spec.model, spec.seed)
    trainer = InnerTrainer(model, spec.inner)
    stream = TrainStream(corpus, spec.model.seq_len, batch or spec.data.batch_size, spec.seed, shard=shard)
    start = {n: p.detach().clone() for n, p in model.named_parameters()} if keep_start else None
    trainer.step(*stream.next_batch())
    wall, cpu = [], []
    for _ in range(steps):
        x, y = stream.next_batch()
        t0, c0 = time.perf_counter(), time.process_time()
        trainer.step(x, y)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return model, start, wall, cpu


def decode_payloads(engine, payloads, round_no: int, shared, mismatch: str):
    """What one member's round engine decodes in a simulated round: every payload, in the canonical
    order. Really decoded in round 0, and while no member's decode is ``shared`` yet (checked
    identical to it when there is one); later rounds reuse ``shared``, decoding being a pure
    function of the bytes."""
    if round_no == 0 or shared is None:
        decoded, invalid = engine.decode(payloads)
        assert not invalid, f"{mismatch}: rejected {invalid}"
        if shared is not None:
            for a, b in zip(shared, decoded):
                assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), mismatch
        return decoded
    return shared


def largest(sizes: Dict[str, int], share: float) -> set:
    """The names of the largest ``share`` of ``sizes`` (name -> elements; at least one, ties by name):
    the tensors a negate-big attacker negates (bench/trust.py, bench/hostile_peers.py)."""
    return set(sorted(sizes, key=lambda n: (-sizes[n], n))[: max(1, int(share * len(sizes)))])


def choose_names(arg: str, known, flag: str) -> list:
    """A comma-separated choice from ``known`` (a flag's value); SystemExit naming what is unknown."""
    names = [s.strip() for s in arg.split(",") if s.strip()]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise SystemExit(f"{flag}: unknown {bad or 'empty list'}; choose from {', '.join(known)}")
    return names


def seeded_identity(path, spec: RunSpec, slot: int) -> None:
    """Write peer ``slot``'s identity file for every run of ``spec``'s run id and seed: a peer's data
    stream follows its id, so runs paired by seed train their peers on the same batches."""
    from swarm.access.identity import write_identity

    write_identity(str(path), hashlib.sha256(f"{spec.run_id}/{spec.seed}/{slot}".encode()).digest())


def deprioritize(pid: int, nice: int) -> None:
    """Run process ``pid``'s whole session at niceness ``nice``: its process group (its DHT, averager and
    p2pd processes) and, where Linux groups a session's processes for scheduling (autogroup, on when
    /proc/PID/autogroup exists), the session's group too. Without the second, a niced peer started
    with a session of its own (voloco/demo.py's ``Child``) still takes a full share of the CPU from the
    other sessions: nice weighs processes only against others of the same session."""
    os.setpriority(os.PRIO_PGRP, pid, nice)
    try:
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:  # not Linux, autogroup off, or the process has exited
        pass


def proc_status_kib(pid, field: str) -> Optional[int]:
    """A size from /proc/PID/status in KiB (``pid`` a number or "self"; VmHWM: the peak resident
    size, VmRSS: the current one); None if it has no such field. OSError if it cannot be read."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


def _proc_status(pid: int) -> Dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def _kib(fields: Dict[str, str], key: str) -> int:
    return int(fields.get(key, "0 kB").split()[0])


def tree_usage(root: int) -> Dict[str, Any]:
    """Memory (KiB: resident, VmRSS, and proportional, Pss: a page shared by n processes counts 1/n
    in each, so forked processes' shared pages count once in the sum), open descriptors and threads
    of ``root``'s process tree, in all and per process."""
    procs = []
    for pid in process_tree(root):
        try:
            st, fds = _proc_status(pid), len(os.listdir(f"/proc/{pid}/fd"))
            with open(f"/proc/{pid}/smaps_rollup") as f:
                pss = _kib(dict(line.split(":", 1) for line in f if ":" in line), "Pss")
        except (OSError, ValueError):  # ended between the walk and the read
            continue
        procs.append({"pid": pid, "name": st.get("Name", "?"), "rss_kib": _kib(st, "VmRSS"), "pss_kib": pss,
                      "fds": fds, "threads": int(st.get("Threads", "0"))})
    return {"processes": procs, **{k: sum(p[k] for p in procs) for k in ("rss_kib", "pss_kib", "fds", "threads")}}


def reset_peak_rss(pid="self") -> None:
    """Start process ``pid``'s VmHWM again at its current resident size (Linux: clear_refs 5)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


class CpuQuota:
    """A CPU cgroup that holds at most ``cores`` cores' time; processes started inside
    ``with quota.entered():`` are in it, with every process they start.

    On one machine a swarm's peers share its cores, so a larger swarm also gives each peer less CPU
    and its waits (polls, timeouts) last more wall seconds: per-peer costs then grow with the
    machine's oversubscription as well as with the swarm. A quota of ``peers x share`` cores, entered
    only while the peers are started, keeps each peer's share equal across swarm sizes, as peers on
    machines of their own have. Linux only, as root: cgroup v1's cpu controller
    (``/sys/fs/cgroup/cpu``) or cgroup v2 with cpu enabled. Guarded by tests/bench/test_bench_scale.py."""

    PERIOD_US = 100_000
    EMPTY_WAIT_S = 30.0  # how long ``close`` waits for the processes left in it (a peer's helpers) to exit

    def __init__(self, cores: float, name: str):
        if cores <= 0:
            raise ValueError(f"a CPU quota needs a positive number of cores, not {cores}")
        v1, v2 = "/sys/fs/cgroup/cpu", "/sys/fs/cgroup"
        quota = max(1000, int(cores * self.PERIOD_US))
        if os.path.exists(os.path.join(v1, "cpu.cfs_quota_us")):
            root, own = v1, _own_cgroup("cpu")
            files = {"cpu.cfs_period_us": str(self.PERIOD_US), "cpu.cfs_quota_us": str(quota)}
        elif "cpu" in _read(os.path.join(v2, "cgroup.subtree_control")).split():
            root, own = v2, _own_cgroup("")
            files = {"cpu.max": f"{quota} {self.PERIOD_US}"}
        else:
            raise SystemExit("a CPU quota needs the cgroup cpu controller (/sys/fs/cgroup/cpu, or cgroup v2 with "
                             "cpu in cgroup.subtree_control) and root")
        self.home = os.path.join(root, own.strip("/"))  # where this process is, and goes back to
        # beside it, not under it (v2 lets a cgroup that has children hold no process)
        self.path = os.path.join(root, os.path.dirname(own.rstrip("/")).strip("/"), name)
        try:
            os.makedirs(self.path, exist_ok=True)
            for f, value in files.items():
                with open(os.path.join(self.path, f), "w") as out:
                    out.write(value)
        except OSError as e:
            self.close()
            raise SystemExit(f"could not set a CPU quota in {self.path} ({e}): run as root on Linux") from e
        self.cores = cores

    @staticmethod
    def _move(cgroup: str, pid: int) -> None:
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(pid))

    def entered(self):
        """While inside, this process (and so every process it starts) is in the cgroup; on leaving,
        it is back in its own."""
        @contextlib.contextmanager
        def inside():
            try:
                self._move(self.path, os.getpid())
            except OSError as e:
                raise SystemExit(f"could not enter the CPU quota {self.path} ({e}): run as root on Linux") from e
            try:
                yield self
            finally:
                try:
                    self._move(self.home, os.getpid())
                except OSError as e:  # never hides how the block ended
                    print(f"could not leave the CPU quota {self.path} for {self.home}: {e}", flush=True)

        return inside()

    def pids(self) -> List[int]:
        return [int(p) for p in _read(os.path.join(self.path, "cgroup.procs")).split()]

    def close(self) -> None:
        """Remove the cgroup. The processes started in it may outlive their parents a little (a peer's
        DHT, averager and p2pd exit after it): they get ``EMPTY_WAIT_S`` to exit, then SIGKILL."""
        deadline = time.monotonic() + self.EMPTY_WAIT_S
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for _ in range(20):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.25)
        print(f"could not remove the CPU quota's cgroup {self.path}: remove it with rmdir once it is empty", flush=True)


def _own_cgroup(controller: str) -> str:
    """This process's cgroup path for ``controller`` (v1), or its unified one (v2: ``controller`` "")."""
    for line in _read("/proc/self/cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        if (controller and controller in controllers.split(",")) or (not controller and controllers == ""):
            return path
    return "/"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""
