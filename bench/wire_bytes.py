"""True wire bytes: what each peer says it sent and received against its host's interface counters.

A coordinator and ``--peers`` peers, each on a test host of its own (tests/support/netns_hosts.py: network
namespaces on a bridge, every link capped with tbf at ``--rate``), train ``--rounds`` rounds of a
tiny SparseLoCo run (``--wait-peers``: they start together) and stop. Per peer:

- accounted: the wire bytes in its final status (swarm/wire/meter.py: the kernel's TCP payload
  counters of every socket of its process tree), and their breakdown (payload as the peer counts
  it, control plane: the rest);
- interface: its host's ``eth0`` counters over the peer's life, as IP payload: the bytes less
  66 bytes a packet (Ethernet 14, IPv4 20, TCP 20 with the 12-byte timestamp option every segment
  after the handshake carries). The interface counts a GSO packet once with one set of headers,
  so this estimate holds whatever the segmentation; a SYN's options (8 bytes more), a SACK block
  or an ARP frame (less) shift it by a few bytes a packet;
- the control plane's bytes per round and per minute between its first and last round's end
  (start-up excluded), for each ``--heartbeat`` period given (the spec's ``swarm.heartbeat_period``).

Needs root (network namespaces). ``--ops N`` instead measures what one progress-record write and
one read cost on the wire, summed over a DHT of N nodes on loopback (no root needed): the unit
costs behind the control plane's rates (a write per heartbeat and per state change, a read per
poll of the round's barrier).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import exit_on_sigterm, human, machine, now, table  # noqa: E402
from protocol.spec import RunSpec  # noqa: E402
from tests.support.netns_hosts import Hosts, netns_unavailable  # noqa: E402

HEADER_BYTES = 14 + 20 + 32  # Ethernet, IPv4, TCP with timestamps: what a data segment or pure ACK carries
TINY_MODEL = {"d_model": 64, "n_layers": 2, "n_heads": 2, "ffn_hidden": 128, "seq_len": 64}


def bench_spec(heartbeat: float, inner_steps: int = 20) -> RunSpec:
    """The tiny run of the tests (tests/swarm_harness.TINY_SPEC) with a given heartbeat period."""
    return RunSpec(run_id="wire-bytes", seed=1).replace(
        model=TINY_MODEL, data={"batch_size": 8, "val_batches": 2}, inner={"lr": 3e-3, "warmup_steps": 5},
        outer={"strategy": "sparseloco", "inner_steps": inner_steps},
        swarm={"matchmaking_time": 2.0, "round_wait": 20.0, "gather_timeout": 10.0, "heartbeat_period": heartbeat},
    )


def ip_payload(stats: Dict[str, int], way: str) -> int:
    """TCP payload bytes an interface carried one way (``rx``/``tx``): its bytes less the headers."""
    return stats[f"{way}_bytes"] - HEADER_BYTES * stats[f"{way}_packets"]


def snmp(hosts: Hosts, name: str) -> Dict[str, int]:
    """The TCP and UDP counters of host ``name``'s network stack (/proc/net/snmp in its namespace)."""
    text = subprocess.run(hosts.prefix(name) + ["cat", "/proc/net/snmp"], capture_output=True, text=True,
                          check=True).stdout.splitlines()
    out: Dict[str, int] = {}
    for head, values in zip(text[::2], text[1::2]):
        proto, keys = head.split(":", 1)
        if proto in ("Tcp", "Udp"):
            out.update({f"{proto}{k}": int(v) for k, v in zip(keys.split(), values.split(":", 1)[1].split())})
    return out


def _delta(after: Dict[str, int], before: Dict[str, int]) -> Dict[str, int]:
    return {k: after[k] - before[k] for k in after}


def _read(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _voloco(hosts: Hosts, host: str, args: List[str], log: Path):
    out = open(log, "wb")
    return hosts.popen(host, [sys.executable, "-m", "voloco", *args], stdout=out, stderr=subprocess.STDOUT,
                       stdin=subprocess.DEVNULL)


def measure(spec: RunSpec, workdir: Path, peers: int = 3, rounds: int = 3, rate: str = "20mbit",
            timeout: float = 300.0) -> Dict[str, Any]:
    """Run the swarm on hosts of their own; per peer, the accounted and the interface bytes."""
    names = [f"p{i}" for i in range(peers)]
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "run.toml"
    config.write_text(spec.to_toml())
    with Hosts(["coord", *names], rate=rate) as hosts:
        address = workdir / "coordinator.addr"
        coord = _voloco(hosts, "coord", ["coordinator", "--config", str(config), "--address-file", str(address)],
                        workdir / "coord.log")
        deadline = time.monotonic() + 60
        while not (address.is_file() and address.read_text().strip()):
            if time.monotonic() > deadline or coord.poll() is not None:
                raise RuntimeError(f"the coordinator did not start; see {workdir / 'coord.log'}")
            time.sleep(0.2)
        join = [a for a in address.read_text().split() if f"/ip4/{hosts.addr('coord')}/" in a][0]
        run_key = (workdir / "coordinator.addr.run-key").read_text().strip()
        before = {n: {**hosts.link_stats(n), **snmp(hosts, n)} for n in names}
        procs, started = {}, {}
        for n in names:
            d = workdir / n
            d.mkdir(exist_ok=True)
            procs[n] = _voloco(hosts, n, ["peer", "--join", join, "--run-key", run_key, "--threads", "1",
                                          "--status-file", str(d / "status.json"), "--identity", str(d / "identity.key"),
                                          "--wait-peers", str(peers), "--max-rounds", str(rounds)], workdir / f"{n}.log")
            started[n] = time.monotonic()
        snapshots: Dict[str, Dict[int, tuple]] = {n: {} for n in names}  # rounds done -> (time, wire)
        ended: Dict[str, float] = {}
        deadline = time.monotonic() + timeout
        while len(ended) < peers:
            if time.monotonic() > deadline:
                for p in procs.values():
                    p.send_signal(signal.SIGINT)
                raise TimeoutError(f"the peers did not finish {rounds} rounds in {timeout:.0f} s; logs in {workdir}")
            for n in names:
                s = _read(workdir / n / "status.json")
                if s and s.get("wire") and s.get("rounds") and s["rounds"] not in snapshots[n]:
                    snapshots[n][s["rounds"]] = (time.monotonic(), s["wire"])
                if n not in ended and procs[n].poll() is not None:
                    ended[n] = time.monotonic()
            time.sleep(0.25)
        after = {n: {**hosts.link_stats(n), **snmp(hosts, n)} for n in names}
    rows = [_row(n, _read(workdir / n / "status.json"), _delta(after[n], before[n]), ended[n] - started[n],
                 snapshots[n]) for n in names]
    return {"rate": rate, "peers": peers, "rounds": rounds, "heartbeat_period": spec.swarm.heartbeat_period, "rows": rows}


def _row(name: str, status: Optional[dict], link: Dict[str, int], wall: float, snaps: Dict[int, tuple]) -> Dict[str, Any]:
    wire = (status or {}).get("wire") or {}
    row: Dict[str, Any] = {"peer": name, "rounds": (status or {}).get("rounds", 0), "wall_s": wall, "link": link,
                           "wire": wire, "payload_sent": (status or {}).get("bytes_sent", 0),
                           "payload_received": (status or {}).get("bytes_received", 0)}
    for way, io in (("sent", "tx"), ("received", "rx")):
        row[f"interface_{way}"] = ip_payload(link, io)
        row[f"ratio_{way}"] = wire.get(way, 0) / max(1, row[f"interface_{way}"])
    if len(snaps) >= 2:  # the control plane between the first and the last round's end
        (r0, (t0, w0)), (r1, (t1, w1)) = min(snaps.items()), max(snaps.items())
        control = sum(w1[f"{w}_by"]["control"] - w0[f"{w}_by"]["control"] for w in ("sent", "received"))
        row["control_per_round"] = control / (r1 - r0)
        row["control_per_minute"] = control / max(1e-9, t1 - t0) * 60
    return row


def report(results: List[Dict[str, Any]]) -> str:
    lines = []
    for res in results:
        for r in res["rows"]:
            w = r["wire"]
            lines.append([
                f"{res['heartbeat_period']:g} s", r["peer"], str(r["rounds"]), f"{r['wall_s']:.0f}",
                human(w.get("sent", 0)), human(r["interface_sent"]), f"{r['ratio_sent']:.3f}",
                human(w.get("received", 0)), human(r["interface_received"]), f"{r['ratio_received']:.3f}",
                human(r["payload_sent"]), human(w.get("sent_by", {}).get("control", 0)),
                human(r.get("control_per_round", float("nan"))), human(r.get("control_per_minute", float("nan"))),
            ])
    cols = ["heartbeat", "peer", "rounds", "wall s", "sent (acct)", "sent (iface)", "ratio", "recv (acct)",
            "recv (iface)", "ratio", "payload sent", "control sent", "control/round", "control/min"]
    return table(cols, lines, left=2)


async def _lean_read(key: str, first: bool, _dht, node) -> None:
    """In a node's DHT process: one lean read of ``key`` (swarm/dht/lean_read.py), from no kept view if ``first``."""
    from swarm.dht.lean_read import forget_views, lean_get
    from swarm.dht.replica_reads import NEAREST_BEAM
    if first:
        await forget_views(_dht, node)
    await lean_get(node, key, NEAREST_BEAM, lambda: node.get(key, latest=True, beam_size=NEAREST_BEAM))


def op_costs(nodes: int = 4, reps: int = 10) -> Dict[str, float]:
    """Bytes on the wire (sent, summed over every node of a ``nodes``-node DHT on loopback) of one
    ``publish_progress`` and one ``read_progress`` (what ``Membership.publish`` and ``view`` do). A
    write is measured twice in the same run: through hivemind's own ``store`` (the baseline, which
    fetches the key's value from every node its search asks) and as voloco stores (swarm/dht/lean_store.py);
    a network read three times: hivemind's ``get`` (the baseline: every replica sends the whole
    dictionary) and voloco's lean read (swarm/dht/lean_read.py) with no view kept (every record is
    new to the reader, as after a round of keep-alives) and with the last read's view (nothing
    changed since). ``read`` is a peer's read as it is made: from its own storage where it is a replica."""
    from swarm import records
    from protocol.dht.keys import peers_key
    from swarm.dht.node import start_dht
    from swarm.dht.replica_reads import NEAREST_BEAM
    from swarm.records import publish_progress, read_progress
    from swarm.wire.meter import WireMeter
    from protocol.dht.records import Progress

    spec = RunSpec(run_id="ops")
    record = Progress(1, 3, "training", spec.digest(), 2.5, 2.6, 123456, 9000.0, 40000, 40000, "0123456789abcdef",
                      -1, "cpu", 0.9, "public")
    dhts = [start_dht([], ["/ip4/127.0.0.1/tcp/0"])]
    dhts += [start_dht(dhts[0].get_visible_maddrs()[:1], ["/ip4/127.0.0.1/tcp/0"]) for _ in range(nodes - 1)]
    meters = [WireMeter(root=d.pid, feed=None).start() for d in dhts]  # each node's own p2pd
    try:
        for d in dhts:
            publish_progress(d, "ops", d.peer_id.to_base58(), record, ttl=60).result()
        me = dhts[1]

        def cost(op) -> float:
            time.sleep(1.5)
            before = sum(m.totals().sent for m in meters)
            for _ in range(reps):
                op()
            time.sleep(1.5)
            return (sum(m.totals().sent for m in meters) - before) / reps

        def write() -> None:
            publish_progress(me, "ops", me.peer_id.to_base58(), record, ttl=60).result()

        records.LEAN_STORES = False
        try:
            baseline = cost(write)
        finally:
            records.LEAN_STORES = True
        lean = cost(write)
        key = peers_key("ops")
        return {"nodes": nodes, "records": len(read_progress(me, "ops")), "write_hivemind": baseline, "write": lean,
                "read_hivemind": cost(lambda: me.get(key, latest=True, beam_size=NEAREST_BEAM)),
                "read_lean_first": cost(lambda: me.run_coroutine(partial(_lean_read, key, True))),
                "read_lean_again": cost(lambda: me.run_coroutine(partial(_lean_read, key, False))),
                "read": cost(lambda: read_progress(me, "ops"))}
    finally:
        for m in meters:
            m.shutdown()
        for d in dhts:
            d.shutdown()


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peers", type=int, default=3, help="peers, each on a test host of its own (default: 3)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds each run trains before its peers stop (default: 4)")
    ap.add_argument("--rate", default="20mbit", help="every host's link cap, both ways, as tc writes it (default: 20mbit)")
    ap.add_argument("--heartbeat", default="2.0", help="comma-separated swarm.heartbeat_period values, one run each")
    ap.add_argument("--inner-steps", type=int, default=20, help="inner steps H of a round (default: 20)")
    ap.add_argument("--workdir", type=Path, default=None, help="where logs and status files go (default: a new "
                    "temporary directory)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results as JSON to this file")
    ap.add_argument("--ops", type=int, default=0, metavar="N", help="instead: measure one record write (hivemind's "
                    "store and voloco's) and one read (hivemind's get and voloco's lean read) on N DHT nodes on "
                    "loopback (no namespaces needed)")
    args = ap.parse_args(argv)
    exit_on_sigterm()
    if args.ops:
        ops = op_costs(args.ops)
        print(f"{machine()}, {now()}: a DHT of {ops['nodes']} nodes holding {ops['records']} progress records, bytes "
              "on the wire (all nodes' bytes sent)")
        print(table(["operation", "bytes", "vs hivemind's store"], [
            ["write, hivemind's store", human(ops["write_hivemind"]), "1.00"],
            ["write, lean store", human(ops["write"]), f"{ops['write'] / ops['write_hivemind']:.2f}"],
        ]))
        print(table(["operation", "bytes", "vs hivemind's get"], [
            ["read, hivemind's get", human(ops["read_hivemind"]), "1.00"],
            ["read, lean, no view kept", human(ops["read_lean_first"]), f"{ops['read_lean_first'] / ops['read_hivemind']:.2f}"],
            ["read, lean, nothing new", human(ops["read_lean_again"]), f"{ops['read_lean_again'] / ops['read_hivemind']:.2f}"],
            ["read, as a peer reads", human(ops["read"]), f"{ops['read'] / ops['read_hivemind']:.2f}"],
        ]))
        if args.json:
            args.json.write_text(json.dumps({"machine": machine(), "date": now(), "ops": ops}, indent=1))
        return
    why = netns_unavailable()
    if why:
        sys.exit(f"needs network namespaces: {why}")
    root = args.workdir or Path(tempfile.mkdtemp(prefix="voloco-wire-"))
    results = []
    for hb in (float(h) for h in args.heartbeat.split(",")):
        spec = bench_spec(hb, args.inner_steps)
        results.append(measure(spec, root / f"hb{hb:g}", args.peers, args.rounds, args.rate))
        print(report(results[-1:]), flush=True)
    print(f"\n{machine()}, {now()}; tiny SparseLoCo run, {args.peers} peers on {args.rate} hosts")
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "date": now(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
