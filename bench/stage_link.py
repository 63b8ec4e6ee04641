"""Tokens/s of a 2-stage chain over TCP, compressed vs uncompressed stage link.

    python bench/stage_link.py [--json OUT] [--d 128] [--layers 2] [--k 16] [--rate 20mbit 5mbit] ...

Two processes, one stage each (torch on one thread each: the machine has two cores), linked by
peer/chain/links.py's StageLink; stage 1 listens, stage 0 dials. Each arm runs ``--warmup`` steps,
then times ``--steps`` inner steps (GPipe, ``--micro`` micro-batches, AdamW) at stage 0, whose
step ends when the last gradient frame is in: tokens/s = batch x seq_len / median step time.
Each arm alternates uncompressed and compressed runs ``--repeats`` times and reports the median
run (on a shared machine, other load moves single runs a lot). The
links carry fp16 values either way; "uncompressed" is k = d (the plain hidden state minus
T[tok], 2d bytes a token forward), "compressed" k = ``--k`` (subspace projection, 2k + 1).

Arms:

* loopback: both processes on 127.0.0.1 (the link is nearly free: measures the codec's cost);
* netns (root only, with ``ip netns``), one arm per ``--rate``: each process in its own network
  namespace, the two linked by a veth pair whose ends both shape egress with ``tc ... tbf``; the
  addresses (10.x.y.1/30, 10.x.y.2/30) exist only on that veth, inside those namespaces, so no
  traffic leaves them. The namespaces (and with them the veth) are deleted in ``finally``.
  Skipped with a note when not root or when ``ip netns`` fails.

The ratio compressed/uncompressed of tokens/s is printed per arm, and for the netns arms the bytes
the two interfaces sent against the bytes of the frames the links sent (wire / frames: TCP/IP and
Ethernet headers, ACKs and the handshake are the interfaces' alone). It is bounded by the
compute: a step can be no faster than the stages' forward + backward, so the ratio approaches
the byte ratio only when the link dominates (small models on slow links).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import shutil
import statistics
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import exit_on_sigterm  # noqa: E402
from peer.training.inner import InnerTrainer  # noqa: E402
from peer.chain.gpipe import run_inner_step  # noqa: E402
from peer.training.model import build_model  # noqa: E402
from peer.chain.links import StageIdentity, connect_link, link_codec, run  # noqa: E402
from peer.chain.listener import StageListener  # noqa: E402
from protocol.chain.frames import FrameFormat  # noqa: E402
from protocol.spec import RunSpec  # noqa: E402
from swarm.jsonout import dumps as strict_json  # noqa: E402  (NaN -> null: strict JSON)

CHAIN = "ch-bench-stage-link"


def make_run(args) -> RunSpec:
    return RunSpec(run_id="bench-stage-link", seed=0).replace(
        model=dict(d_model=args.d, n_layers=args.layers, n_heads=args.heads, ffn_hidden=args.ffn, seq_len=args.seq),
        data=dict(batch_size=args.batch),
        inner=dict(lr=1e-3, warmup_steps=1, total_steps=10_000),
    )


# --- one stage (a worker process) ----------------------------------------------------------------


async def worker(args) -> dict:
    torch.set_num_threads(1)
    spec = make_run(args)
    n = spec.model.n_layers
    cut = n // 2
    stage_index = args.worker
    stage = build_model(spec.model, spec.seed, blocks=(0, cut) if stage_index == 0 else (cut, n))
    trainer = InnerTrainer(stage, spec.inner)
    T = build_model(spec.model, spec.seed, blocks=(0, 1)).embed.weight.detach().clone()  # both ends: the same bits
    fmt = FrameFormat.for_run(spec, micro_batch=args.batch // args.micro, k=args.k)
    codec = link_codec(args.d, args.k, spec.seed, torch.float16)
    local = StageIdentity(spec.digest(), CHAIN, stage_index, 0)
    g = torch.Generator().manual_seed(1)
    batches = [
        (x, torch.roll(x, -1, dims=1))
        for x in (torch.randint(0, 256, (args.batch, args.seq), generator=g) for _ in range(args.warmup + args.steps))
    ]
    listener = None
    if stage_index == 1:
        listener = await StageListener.start(args.host, args.port, local=local, role="downstream", fmt=fmt, codec=codec, timeout=120)
        print(json.dumps({"listening": listener.port}), flush=True)
        link = await listener.accept(60)
        kw = dict(upstream=link)
    else:
        deadline = time.monotonic() + 30
        while True:
            try:
                link = await connect_link(args.host, args.port, local=local, role="upstream", fmt=fmt, codec=codec, timeout=120)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)
        kw = dict(downstream=link)
    times, losses = [], []
    sent0 = 0
    for i, batch in enumerate(batches):
        if i == args.warmup:
            sent0 = link.bytes_sent
        t0 = time.perf_counter()
        loss = await run_inner_step(stage, trainer, T=T, micro_batches=args.micro, batch=batch, **kw)
        times.append(time.perf_counter() - t0)
        if loss is not None:
            losses.append(loss)
    sent = link.bytes_sent - sent0
    await link.close()
    if listener is not None:
        await listener.close()
    measured = times[args.warmup :]
    step_s = statistics.median(measured)  # the machine may be shared: the median resists outliers
    return {
        "stage": stage_index,
        "seconds": sum(measured),
        "step_s": step_s,
        "tokens_per_s": args.batch * args.seq / step_s,
        "bytes_sent_per_step": sent / len(measured),
        "bytes_sent_total": link.bytes_sent,  # every frame of the link's life, handshake included
        "losses": losses,
    }


# --- the arms --------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_argv(args, stage: int, k: int, host: str, port: int):
    return [
        sys.executable, str(Path(__file__).resolve()), "--worker", str(stage), "--host", host, "--port", str(port), "--k", str(k),
        "--d", str(args.d), "--layers", str(args.layers), "--heads", str(args.heads), "--ffn", str(args.ffn),
        "--seq", str(args.seq), "--batch", str(args.batch), "--micro", str(args.micro),
        "--steps", str(args.steps), "--warmup", str(args.warmup),
    ]  # fmt: skip


def run_pair(args, k: int, host: str, prefixes=((), ()), counters=None) -> dict:
    """Both stages as subprocesses (``prefixes``: e.g. ``ip netns exec NS`` per stage).
    ``counters()``: (stage 0's, stage 1's) interface tx bytes, read before and after the run."""
    tx0 = counters() if counters else None
    port = free_port() if host == "127.0.0.1" else 7300 + random.randrange(1000)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = []
    try:
        procs.append(subprocess.Popen([*prefixes[1], *worker_argv(args, 1, k, host, port)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True))
        ready = procs[0].stdout.readline()  # {"listening": port}
        if not ready:
            raise RuntimeError("stage 1 did not start")
        procs.append(subprocess.Popen([*prefixes[0], *worker_argv(args, 0, k, host, port)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True))
        outs = []
        for p in procs:
            out, _ = p.communicate(timeout=args.arm_timeout)
            if p.returncode:
                raise RuntimeError(f"stage worker exited with {p.returncode}")
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    first, last = (outs[1], outs[0]) if outs[0]["stage"] == 1 else (outs[0], outs[1])
    tokens = args.batch * args.seq
    wire = {}
    if counters:
        tx1 = counters()
        frames = first["bytes_sent_total"] + last["bytes_sent_total"]
        wire = {"wire_bytes": (tx1[0] - tx0[0]) + (tx1[1] - tx0[1]), "frame_bytes": frames}
    return {**wire,
        "k": k,
        "tokens_per_s": first["tokens_per_s"],
        "step_s": first["step_s"],
        "fwd_bytes_per_token": first["bytes_sent_per_step"] / tokens,
        "bwd_bytes_per_token": last["bytes_sent_per_step"] / tokens,
        "final_loss": last["losses"][-1] if last["losses"] else None,
    }


def arm(args, host: str, prefixes=((), ()), counters=None) -> dict:
    """Uncompressed and compressed, alternated ``--repeats`` times; the median run of each."""
    runs = {"uncompressed": [], "compressed": []}
    for _ in range(args.repeats):
        runs["uncompressed"].append(run_pair(args, args.d, host, prefixes, counters))
        runs["compressed"].append(run_pair(args, args.k, host, prefixes, counters))
    out = {}
    for name, rs in runs.items():
        rs.sort(key=lambda r: r["tokens_per_s"])
        out[name] = dict(rs[len(rs) // 2], all_tokens_per_s=[round(r["tokens_per_s"]) for r in rs])
    return out


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)


class ShapedNamespaces:
    """Two network namespaces joined by a veth pair, egress shaped by tbf on both ends."""

    def __init__(self, rate: str):
        tag = f"{os.getpid() % 100000}{random.randrange(100):02d}"
        self.ns = (f"vlcbench-{tag}-a", f"vlcbench-{tag}-b")
        self.dev = (f"vlc{tag}a", f"vlc{tag}b")
        octet = random.randrange(1, 250)
        self.addr = (f"10.213.{octet}.1", f"10.213.{octet}.2")
        self.rate = rate
        self.created = []

    def __enter__(self):
        try:
            for ns in self.ns:
                _sh("ip", "netns", "add", ns)
                self.created.append(ns)
            # both ends are created directly inside the namespaces: the host's stack never sees them
            _sh("ip", "-n", self.ns[0], "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1], "netns", self.ns[1])
            for ns, dev, addr in zip(self.ns, self.dev, self.addr):
                _sh("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
                _sh("ip", "-n", ns, "link", "set", dev, "up")
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                    "rate", self.rate, "burst", "32kb", "latency", "100ms")  # fmt: skip
            return self
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc):
        for ns in reversed(self.created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.created = []

    def prefixes(self):
        return tuple(("ip", "netns", "exec", ns) for ns in self.ns)

    def tx_bytes(self):
        """Bytes each end's veth sent (Ethernet frames: TCP/IP headers, ACKs and handshakes included)."""
        out = []
        for ns, dev in zip(self.ns, self.dev):
            r = subprocess.run(["ip", "-n", ns, "-s", "-j", "link", "show", "dev", dev], check=True, capture_output=True, text=True)
            out.append(json.loads(r.stdout)[0]["stats64"]["tx"]["bytes"])
        return tuple(out)


def netns_unavailable() -> str:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "not root"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "ip or tc not installed"
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if r.returncode:
        return f"ip netns unavailable: {r.stderr.strip()}"
    return ""


def machine() -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(), "platform": platform.platform()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=352)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--k", type=int, default=16, help="compressed link width")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="runs per arm and link (median reported)")
    ap.add_argument("--rate", nargs="+", default=["20mbit", "5mbit"], help="tbf rates of the netns arms, one arm each")
    ap.add_argument("--no-netns", action="store_true")
    ap.add_argument("--arm-timeout", type=float, default=300)
    # worker mode (internal)
    ap.add_argument("--worker", type=int, choices=(0, 1), help=argparse.SUPPRESS)
    ap.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    exit_on_sigterm()
    if args.worker is not None:
        print(json.dumps(run(worker(args))), flush=True)
        return 0

    params = make_run(args).model.num_params()
    print(f"model d={args.d} layers={args.layers} ffn={args.ffn} seq={args.seq} ({params / 1e6:.2f}M params), "
          f"batch {args.batch} in {args.micro} micro-batches, 2 stages, k {args.d} vs {args.k}, fp16 links")  # fmt: skip
    arms = {"loopback": arm(args, "127.0.0.1")}
    skip = "disabled (--no-netns)" if args.no_netns else netns_unavailable()
    if not skip:
        try:
            for rate in args.rate:
                with ShapedNamespaces(rate) as ns:
                    arms[f"netns tbf {rate}"] = arm(args, ns.addr[1], ns.prefixes(), ns.tx_bytes)
        except subprocess.CalledProcessError as e:
            skip = f"namespace setup failed: {' '.join(e.cmd)}: {e.stderr.strip()}"
    print(f"{'arm':<22} {'link':<13} {'k':>4} {'B/token fwd':>11} {'B/token bwd':>11} {'step s':>8} {'tokens/s':>9}  runs")
    for label, res in arms.items():
        for name, r in res.items():
            print(f"{label:<22} {name:<13} {r['k']:>4} {r['fwd_bytes_per_token']:>11.1f} {r['bwd_bytes_per_token']:>11.1f} "
                  f"{r['step_s']:>8.3f} {r['tokens_per_s']:>9.0f}  {r['all_tokens_per_s']}")  # fmt: skip
        u, c = res["uncompressed"], res["compressed"]
        res["ratio"] = c["tokens_per_s"] / u["tokens_per_s"]
        res["byte_ratio"] = (u["fwd_bytes_per_token"] + u["bwd_bytes_per_token"]) / (c["fwd_bytes_per_token"] + c["bwd_bytes_per_token"])
    for label, res in arms.items():
        print(f"{label}: compressed / uncompressed tokens/s = {res['ratio']:.2f}x (bytes on the link {res['byte_ratio']:.1f}x fewer)")
    print("frames' bytes per token against the codec's formula (fp16: forward 2k + 1, backward 2k), and the interfaces")
    print(f"{'arm':<22} {'k':>4} {'formula B/tok':>13} {'frames B/tok':>12} {'wire / frames':>13}")
    for label, res in arms.items():
        for name in ("uncompressed", "compressed"):
            r = res[name]
            formula = (2 * r["k"] + 1) + 2 * r["k"]
            framed = r["fwd_bytes_per_token"] + r["bwd_bytes_per_token"]
            r["formula_bytes_per_token"] = formula
            ratio = r["wire_bytes"] / r["frame_bytes"] if r.get("frame_bytes") else None
            r["wire_over_frames"] = ratio
            print(f"{label:<22} {r['k']:>4} {formula:>13} {framed:>12.1f} {'-' if ratio is None else f'{ratio:.3f}':>13}")
    if skip:
        print(f"netns arm skipped: {skip}")
    if args.json:
        args.json.write_text(strict_json(dict(
            date=datetime.datetime.now().isoformat(timespec="seconds"), machine=machine(),
            config={k: v for k, v in vars(args).items() if k not in ("json", "worker", "host", "port")},
            params=params, arms=arms, netns_skipped=skip or None,
        ), indent=2) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
