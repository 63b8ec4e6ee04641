"""What one DHT call costs on the wire: hivemind's unary call against a DHT channel (swarm/dht/channels.py).

    python bench/dht_channels.py [--calls 200] [--value-bytes 300] [--json OUT]

Needs root (a network namespace of its own, tests/support/netns_hosts.py): two voloco DHT nodes run on the
loopback of one host, and nothing else does, so the loopback's counters are the two nodes' traffic
alone. Node b sends ``--calls`` stores of a ``--value-bytes`` value (a progress record is about 300
bytes with its signature) and as many finds of that key to node a, one every 50 ms: first as hivemind
sends them (a unary call: p2pd opens a libp2p stream for each), then over the channel b keeps open
to a. Bytes are the loopback's frames (IP and TCP headers included, each packet counted once: both
directions of every call); the ratio is unary against channel, in the same run. CPU is what both nodes'
processes (their DHT processes and p2p daemons) spent over the calls, less what they spend idle over as
long (measured first, over 3 s), a call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SPACING_S = 0.05
MAX_VALUE_BYTES = 256 * 1024  # a find's answer holds 8 of them, and a frame is at most 4 MiB


def _lo() -> tuple:
    base = "/sys/class/net/lo/statistics/"
    return tuple(int(open(base + name).read()) for name in ("tx_bytes", "tx_packets"))


async def _calls(kind: str, method: str, count: int, value_bytes: int, peer, _dht, node) -> float:
    """In b's DHT process: ``count`` calls to ``peer``, unary or over the channel; their seconds."""
    from hivemind.dht.protocol import DHTProtocol
    from hivemind.dht.routing import DHTID
    from hivemind.proto import dht_pb2
    from hivemind.utils import get_dht_time

    protocol = node.protocol
    stub = (partial(DHTProtocol.get_stub, protocol) if kind == "unary" else protocol.get_stub)(peer)
    key = DHTID.generate(source="bench-key").to_bytes()
    began = time.monotonic()
    for i in range(count):
        if method == "store":
            request = dht_pb2.StoreRequest(keys=[key], subkeys=[protocol.serializer.dumps(f"peer-{i % 8}")],
                                           values=[protocol.serializer.dumps(b"v" * value_bytes)],
                                           expiration_time=[get_dht_time() + 60], in_cache=[False],
                                           peer=protocol.node_info)
            response = await stub.rpc_store(request, timeout=5)
            assert list(response.store_ok) == [True], response
        else:
            response = await stub.rpc_find(dht_pb2.FindRequest(keys=[key], peer=protocol.node_info), timeout=5)
            assert response.results, response
        await asyncio.sleep(SPACING_S)
    return time.monotonic() - began


IDLE_S = 3.0


def inside(args) -> dict:
    from swarm.cpu_meter import HelperCpu
    from swarm.dht.node import start_dht

    subprocess.run(["ip", "link", "set", "lo", "up"], check=False)
    a = start_dht((), ["/ip4/127.0.0.1/tcp/0"])
    b = start_dht(a.get_visible_maddrs(), ["/ip4/127.0.0.1/tcp/0"])
    rows = []
    try:
        for kind in ("unary", "channel"):  # warm both paths (the channel opens on its first call)
            b.run_coroutine(partial(_calls, kind, "store", 3, args.value_bytes, a.peer_id))
        time.sleep(1.0)
        cpu = HelperCpu(lambda: [os.getpid()])  # this process and its children: both nodes, their daemons
        cpu.since_last()
        time.sleep(IDLE_S)
        idle_rate = (cpu.since_last() or 0.0) / IDLE_S
        for method in ("store", "find"):
            for kind in ("unary", "channel"):
                before, cpu_began = _lo(), time.monotonic()
                cpu.since_last()
                took = b.run_coroutine(partial(_calls, kind, method, args.calls, args.value_bytes, a.peer_id))
                time.sleep(0.5)  # the last acknowledgements
                after = _lo()
                spent = (cpu.since_last() or 0.0) - idle_rate * (time.monotonic() - cpu_began)
                rows.append({"method": method, "transport": kind, "calls": args.calls, "seconds": took,
                             "bytes": after[0] - before[0], "packets": after[1] - before[1], "cpu_s": spent})
    finally:
        b.shutdown()
        a.shutdown()
    return {"value_bytes": args.value_bytes, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--calls", type=int, default=200, help="calls of each kind, at least 1 (default 200)")
    ap.add_argument("--value-bytes", type=int, default=300, help=f"bytes of each stored value, 1 to {MAX_VALUE_BYTES} (default 300)")
    ap.add_argument("--json", metavar="OUT", help="also write the figures to this JSON file")
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.calls < 1 or not 1 <= args.value_bytes <= MAX_VALUE_BYTES:
        ap.error(f"--calls must be >= 1 and --value-bytes in [1, {MAX_VALUE_BYTES}] (a find's answer holds 8 values, a frame at most 4 MiB)")
    if args.inside:
        print(json.dumps(inside(args)), flush=True)
        os._exit(0)  # the nodes are shut down; skip the interpreter's teardown of their threads

    from tests.support.netns_hosts import Hosts, netns_unavailable

    if (why := netns_unavailable()) is not None:
        print(f"needs network namespaces: {why}", file=sys.stderr)
        return 2
    with Hosts(["a"], rate=None) as hosts:
        cmd = hosts.prefix("a") + [sys.executable, os.path.abspath(__file__), "--inside", "--calls", str(args.calls),
                                   "--value-bytes", str(args.value_bytes)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        print(out.stderr[-4000:], file=sys.stderr)
        return 1
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{args.calls} calls of each kind, {args.value_bytes}-byte values, one every {SPACING_S * 1000:.0f} ms, "
          f"loopback frames of both directions")
    print(f"{'method':<7} {'transport':<9} {'bytes/call':>10} {'packets/call':>12} {'ms/call':>8} {'CPU ms/call':>11}")
    by = {(r["method"], r["transport"]): r for r in result["rows"]}
    for r in result["rows"]:
        ms = 1000 * (r["seconds"] / r["calls"] - SPACING_S)
        print(f"{r['method']:<7} {r['transport']:<9} {r['bytes'] / r['calls']:>10.0f} {r['packets'] / r['calls']:>12.1f} "
              f"{ms:>8.2f} {1000 * r['cpu_s'] / r['calls']:>11.2f}")
    for method in ("store", "find"):
        u, c = by[(method, "unary")], by[(method, "channel")]
        result[f"{method}_bytes_ratio"] = u["bytes"] / c["bytes"]
        print(f"{method}: unary / channel = {u['bytes'] / c['bytes']:.2f}x the bytes, "
              f"{u['packets'] / c['packets']:.2f}x the packets, {u['cpu_s'] / max(c['cpu_s'], 1e-9):.2f}x the CPU")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
