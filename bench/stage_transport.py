"""Stage-link transport: plain asyncio TCP against a hivemind P2P binary stream, same frames.

    python bench/stage_transport.py [--json OUT] [--rate 20mbit 5mbit] [--mbytes 4] [--pings 20] ...

Chain stages pass activation frames over plain asyncio TCP (peer/chain/links.py); this measures
what hivemind's P2P streams (p2pd: TCP + TLS/noise + yamux, with NAT traversal, relays and
authenticated peer ids) would cost instead. A receiver and a sender process (uvloop where
installed) exchange frames with a 4-byte length prefix (the first body byte says what the frame
is) over tcp (``asyncio.start_server`` / ``open_connection``) or p2p: each process starts its own
p2pd (``hivemind.P2P.create``, no DHT), the receiver registers ``add_binary_stream_handler`` and
prints its peer id and maddrs, the sender dials them (``p2p._client.connect``: P2P has no public
dial but ``initial_peers``, which would hide it in the start-up) and opens
``call_binary_stream_handler``. Per arm and transport, one run each:

1. connect s: from nothing to the first 64 B frame echoed (p2p: the sender's daemon start + dial +
   stream open, parts in the JSON); reopen ms: a second connection / stream and one 64 B echo
   while the first is up (a stage's cost per round when a daemon and connection already live);
2. bulk: ``--mbytes`` MB of frame bodies in ``--frame-bytes`` frames, then an end frame the
   receiver acks with the byte count it got: MB/s (10^6 B) and its share of the tbf rate;
3. RTT: median of ``--pings`` echoes of a 64 B frame and of an activation-sized one
   (``--act-bytes``, 33 KB = 1024 tokens x 33 B): GPipe alternates forward and backward frames;
4. wire / payload (netns arms): bytes both veth ends sent during the bulk phase (``ip -n NS -s -j
   link show``, stats64.tx.bytes, read here while the sender waits on stdin) over the bytes the
   application wrote in it: TCP/IP/Ethernet headers and ACKs, for p2p also TLS records, yamux
   headers and any p2pd chatter in that window.

Arms: loopback (both on 127.0.0.1, unshaped), and (root with ``ip netns`` only) one per ``--rate``:
two namespaces joined by a veth pair, both ends shaped by ``tc tbf`` (bench/stage_link.py's
ShapedNamespaces, deleted in ``finally``); skipped with the reason otherwise. tbf counts Ethernet
frames, so even ideal TCP payload tops out near 96 % of the rate at a 1500 B MTU.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAME = "voloco-bench-stage-transport"
TRANSPORTS = ("tcp", "p2p")
UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bps": 8, "kbps": 8e3, "mbps": 8e6}


def frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


async def send(writer, body: bytes) -> None:
    writer.write(frame(body))
    await writer.drain()


async def read_frame(reader) -> bytes:
    head = await reader.readexactly(4)
    return await reader.readexactly(int.from_bytes(head, "big"))


async def serve(reader, writer, done: asyncio.Event) -> None:
    """Receiver side of one connection/stream: B bulk (counted), E end (ack with the count),
    P ping (echoed whole), X close this stream, Q close and stop (acknowledged with q)."""
    got, bulk = 0, False
    try:
        while True:
            body = await read_frame(reader)
            kind = body[:1]
            if kind == b"B":
                got, bulk = got + 4 + len(body), True
            elif kind == b"E":
                writer.write(frame(b"A" + got.to_bytes(8, "big")))
                got = 0
            elif kind == b"P":
                writer.write(frame(body))
            else:
                if kind == b"Q":  # acknowledged: the sender must not shut its daemon down with Q in flight
                    writer.write(frame(b"q"))
                    await writer.drain()
                    done.set()
                break
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        if bulk:  # p2pd may reset a stream whose last frames (Q, q) are still in flight: the run is over
            done.set()
    finally:
        writer.close()


async def receiver(args) -> dict:
    done = asyncio.Event()
    if args.transport == "p2p":
        from hivemind.p2p import P2P
    t0 = time.perf_counter()
    p2p = None
    if args.transport == "tcp":
        server = await asyncio.start_server(lambda r, w: serve(r, w, done), args.host, 0)
        print(json.dumps({"listening": server.sockets[0].getsockname()[1]}), flush=True)
    else:
        p2p = await P2P.create(host_maddrs=[f"/ip4/{args.host}/tcp/0"])
        await p2p.add_binary_stream_handler(NAME, lambda info, r, w: serve(r, w, done))
        maddrs = [str(m).split("/p2p/")[0] for m in await p2p.get_visible_maddrs()]
        print(json.dumps({"peer_id": p2p.peer_id.to_base58(), "maddrs": maddrs}), flush=True)
    start_s = time.perf_counter() - t0
    try:
        await asyncio.wait_for(done.wait(), args.arm_timeout)
    finally:
        if p2p is not None:
            try:  # hivemind's shutdown can hang on a stream still open: bounded, it is only a bench
                await asyncio.wait_for(p2p.shutdown(), 5.0)
            except Exception:
                pass
        else:
            server.close()
    return {"receiver_start_s": start_s}


async def ping(reader, writer, size: int) -> float:
    body = b"P" + bytes(size - 1)
    t = time.perf_counter()
    await send(writer, body)
    if await read_frame(reader) != body:
        raise RuntimeError("echo differs from the frame sent")
    return time.perf_counter() - t


async def sender(args) -> dict:
    stdin = lambda: asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # noqa: E731
    peer = json.loads(args.peer)
    if args.transport == "p2p":  # imported before the clock starts: a peer has hivemind loaded already
        from hivemind.p2p import P2P, PeerID
        from multiaddr import Multiaddr
    t0 = time.perf_counter()
    parts = {}
    if args.transport == "tcp":
        reader, writer = await asyncio.open_connection(args.host, peer["listening"])
        parts["tcp_connect_s"] = time.perf_counter() - t0
        reopen = lambda: asyncio.open_connection(args.host, peer["listening"])  # noqa: E731
        p2p = None
    else:
        p2p = await P2P.create(host_maddrs=[f"/ip4/{args.self_host}/tcp/0"])
        parts["daemon_start_s"] = time.perf_counter() - t0
        pid = PeerID.from_base58(peer["peer_id"])
        t = time.perf_counter()
        await p2p._client.connect(pid, [Multiaddr(m) for m in peer["maddrs"]])
        parts["dial_s"] = time.perf_counter() - t
        t = time.perf_counter()
        _, reader, writer = await p2p.call_binary_stream_handler(pid, NAME)
        parts["stream_open_s"] = time.perf_counter() - t

        async def reopen():
            return (await p2p.call_binary_stream_handler(pid, NAME))[1:]

    parts["first_echo_s"] = await ping(reader, writer, 64)
    connect_s = time.perf_counter() - t0
    t = time.perf_counter()
    r2, w2 = await reopen()
    await ping(r2, w2, 64)
    reopen_s = time.perf_counter() - t
    await send(w2, b"X")
    w2.close()
    print(json.dumps({"connected": True}), flush=True)

    await stdin()  # the caller has read the interface counters
    n = max(1, round(args.mbytes * 1e6 / args.frame_bytes))
    data = frame(b"B" + os.urandom(args.frame_bytes - 1))
    t = time.perf_counter()
    for _ in range(n):
        writer.write(data)
        await writer.drain()
    await send(writer, b"E")
    ack = await read_frame(reader)
    bulk_s = time.perf_counter() - t
    if int.from_bytes(ack[1:], "big") != n * len(data):
        raise RuntimeError(f"receiver got {int.from_bytes(ack[1:], 'big')} B, sent {n * len(data)}")
    print(json.dumps({"bulk": True}), flush=True)

    await stdin()
    small = [await ping(reader, writer, 64) for _ in range(args.pings)]
    large = [await ping(reader, writer, args.act_bytes) for _ in range(args.pings)]
    await send(writer, b"Q")
    try:
        await asyncio.wait_for(read_frame(reader), 30.0)
    except asyncio.IncompleteReadError:
        pass  # the stream was reset after Q arrived (see serve)
    writer.close()
    if p2p is not None:
        try:
            await asyncio.wait_for(p2p.shutdown(), 5.0)
        except Exception:
            pass
    payload = n * args.frame_bytes
    return {
        "connect_s": connect_s, "connect_parts": parts, "reopen_s": reopen_s,
        "bulk_s": bulk_s, "payload_bytes": payload, "app_bytes": n * len(data) + len(frame(b"E")) + len(ack) + 4,
        "mb_per_s": payload / 1e6 / bulk_s,
        "rtt_small_s": statistics.median(small), "rtt_act_s": statistics.median(large),
        "rtt_small_all_ms": [round(x * 1e3, 2) for x in small], "rtt_act_all_ms": [round(x * 1e3, 2) for x in large],
    }  # fmt: skip


def run_loop(coro):
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:  # pragma: no cover
        return asyncio.run(coro)


# --- the orchestrator -----------------------------------------------------------------------------


def read_json(proc) -> dict:
    """The next JSON line of a worker's stdout (anything else a library prints there is skipped)."""
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited early (rc {proc.wait()})")
        if line.startswith("{"):
            return json.loads(line)


def run_pair(args, transport: str, hosts, prefixes=((), ()), counters=None) -> dict:
    """Receiver in prefixes[1] on hosts[1], sender in prefixes[0] on hosts[0]."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    base = [sys.executable, str(Path(__file__).resolve()), "--transport", transport, "--arm-timeout", str(args.arm_timeout)]
    procs = []
    watchdog = threading.Timer(args.arm_timeout, lambda: [p.kill() for p in procs])
    watchdog.start()
    try:
        procs.append(subprocess.Popen([*prefixes[1], *base, "--worker", "recv", "--host", hosts[1]], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True))
        peer = read_json(procs[0])
        procs.append(subprocess.Popen(
            [*prefixes[0], *base, "--worker", "send", "--host", hosts[1], "--self-host", hosts[0], "--peer", json.dumps(peer),
             "--mbytes", str(args.mbytes), "--frame-bytes", str(args.frame_bytes), "--act-bytes", str(args.act_bytes),
             "--pings", str(args.pings)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True))  # fmt: skip
        snd = procs[1]
        read_json(snd)  # connected
        tx0 = counters() if counters else None
        snd.stdin.write("go\n")
        snd.stdin.flush()
        read_json(snd)  # bulk done
        tx1 = counters() if counters else None
        snd.stdin.write("go\n")
        snd.stdin.close()
        out = read_json(snd)
        rcv = read_json(procs[0])
        for p in procs:
            if p.wait(timeout=args.arm_timeout):
                raise RuntimeError(f"{transport} worker exited with {p.returncode}")
    finally:
        watchdog.cancel()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    out.update(rcv)
    if counters:
        out["wire_bytes"] = (tx1[0] - tx0[0]) + (tx1[1] - tx0[1])
        out["wire_over_payload"] = out["wire_bytes"] / out["app_bytes"]
    return out


def rate_bits(rate: str):
    m = re.fullmatch(r"([\d.]+)([a-z]+)", rate.lower())
    return float(m[1]) * UNITS[m[2]] if m and m[2] in UNITS else None


def arm(args, hosts, rate=None, prefixes=((), ()), counters=None) -> dict:
    res = {t: run_pair(args, t, hosts, prefixes, counters) for t in TRANSPORTS}
    bits = rate_bits(rate) if rate else None
    for r in res.values():
        r["link_share"] = r["mb_per_s"] * 8e6 / bits if bits else None
    tcp, p2p = res["tcp"], res["p2p"]
    res["p2p_over_tcp"] = {k: p2p[k] / tcp[k] for k in ("mb_per_s", "rtt_small_s", "rtt_act_s", "connect_s", "reopen_s")}
    return res


def machine() -> dict:
    from importlib.metadata import version

    return {"python": platform.python_version(), "hivemind": version("hivemind"), "cpus": os.cpu_count(), "platform": platform.platform()}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, metavar="OUT", help="write every figure, the config and the machine to OUT")
    ap.add_argument("--rate", nargs="+", default=["20mbit", "5mbit"], help="tbf rates (tc syntax) of the netns arms, one arm each (default: 20mbit 5mbit)")
    ap.add_argument("--mbytes", type=float, default=4, help="MB (10^6 B) of frame bodies in the bulk transfer (default 4)")
    ap.add_argument("--frame-bytes", type=int, default=65536, help="body bytes of one bulk frame, plus a 4-byte length prefix (default 65536)")
    ap.add_argument("--act-bytes", type=int, default=33 * 1024, help="body bytes of the activation-sized ping frame (default 33792: 1024 tokens x 33 B)")
    ap.add_argument("--pings", type=int, default=20, help="round trips per frame size; the median is reported (default 20)")
    ap.add_argument("--no-netns", action="store_true", help="run the loopback arm only (no namespaces, no root needed)")
    ap.add_argument("--arm-timeout", type=float, default=300, help="seconds before one transport run of one arm is killed (default 300)")
    # worker mode (internal)
    for flag in ("--worker", "--transport", "--host", "--self-host", "--peer"):
        ap.add_argument(flag, help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        print(json.dumps(run_loop(sender(args) if args.worker == "send" else receiver(args))), flush=True)
        return 0
    if args.frame_bytes < 2 or args.act_bytes < 2 or args.pings < 1:
        raise SystemExit("--frame-bytes and --act-bytes must be >= 2, --pings >= 1")
    print(f"bulk {args.mbytes} MB in {args.frame_bytes} B frames, RTT median of {args.pings} (64 B and {args.act_bytes} B frames)")
    arms = {"loopback": arm(args, ("127.0.0.1", "127.0.0.1"))}
    skip = "disabled (--no-netns)" if args.no_netns else ""
    if not skip:
        from bench.stage_link import ShapedNamespaces, netns_unavailable

        skip = netns_unavailable()
    if not skip:
        try:
            for rate in args.rate:
                with ShapedNamespaces(rate) as ns:
                    arms[f"netns tbf {rate}"] = arm(args, ns.addr, rate, ns.prefixes(), ns.tx_bytes)
        except subprocess.CalledProcessError as e:
            skip = f"namespace setup failed: {' '.join(e.cmd)}: {e.stderr.strip()}"
    hdr = f"{'arm':<20} {'transport':<9} {'MB/s':>7} {'% link':>6} {'RTT 64B ms':>10} {'RTT act ms':>10} {'wire/payload':>12} {'connect s':>9} {'reopen ms':>9}"
    print(hdr)
    for label, res in arms.items():
        for t in TRANSPORTS:
            r = res[t]
            share = "-" if r["link_share"] is None else f"{100 * r['link_share']:.1f}"
            wire = f"{r['wire_over_payload']:.4f}" if "wire_over_payload" in r else "-"
            print(f"{label:<20} {t:<9} {r['mb_per_s']:>7.3f} {share:>6} {r['rtt_small_s'] * 1e3:>10.2f} {r['rtt_act_s'] * 1e3:>10.2f} "
                  f"{wire:>12} {r['connect_s']:>9.3f} {r['reopen_s'] * 1e3:>9.2f}")  # fmt: skip
    for label, res in arms.items():
        q = res["p2p_over_tcp"]
        print(f"{label}: P2P/TCP throughput {q['mb_per_s']:.2f}x, RTT 64B {q['rtt_small_s']:.2f}x, RTT act {q['rtt_act_s']:.2f}x, "
              f"connect {q['connect_s']:.1f}x, reopen {q['reopen_s']:.1f}x")  # fmt: skip
    p = arms["loopback"]["p2p"]["connect_parts"]
    print("p2p connect parts (loopback): " + ", ".join(f"{k} {v:.3f}" for k, v in p.items()))
    if skip:
        print(f"netns arms skipped: {skip}")
    if args.json:
        from swarm.jsonout import dumps as strict_json  # NaN -> null: strict JSON

        args.json.write_text(strict_json(dict(
            date=datetime.datetime.now().isoformat(timespec="seconds"), machine=machine(),
            config={k: v for k, v in vars(args).items() if k not in ("json", "worker", "transport", "host", "self_host", "peer")},
            arms=arms, netns_skipped=skip or None,
        ), indent=2, default=str) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
