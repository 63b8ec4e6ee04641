"""The wire meter counts retransmissions apart, and only where the wire lost something: host ``a``
(50 Mbit/s) sends 2 MB to host ``b`` (5 Mbit/s), so the bridge's queue toward ``b`` overflows and
drops segments that already left ``a``; ``a``'s WireMeter (swarm/wire/meter.py) must report the
2 MB sent once, the retransmitted bytes apart (> 0), and together they match what ``a``'s interface
carried. A link that never drops may show no retransmission at all (tests/system/test_wire_bytes_hosts.py
shapes both ends alike, so its peers' queues drop locally, before the wire): this test is the one
that makes the kernel retransmit.

Needs root and ``ip netns``; skips cleanly without them. About 5 s.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.wire_bytes import ip_payload
from tests.support.netns_hosts import Hosts, needs_netns_fixture

pytestmark = pytest.mark.slow

_needs_netns = needs_netns_fixture()

SIZE = 2_000_000
PORT = 9777

RECEIVER = f"""
import socket
srv = socket.create_server(("0.0.0.0", {PORT}))
print("ready", flush=True)
conn, _ = srv.accept()
n = 0
while n < {SIZE}:
    b = conn.recv(1 << 16)
    if not b:
        break
    n += len(b)
conn.sendall(str(n).encode().ljust(16))
conn.recv(1)  # until the sender closes

"""

SENDER = f"""
import json, socket, sys, time
from dataclasses import asdict
from swarm.wire.meter import WireMeter
meter = WireMeter(period=0.1).start()
s = socket.create_connection((sys.argv[1], {PORT}), timeout=60)
s.sendall(bytes({SIZE}))
got = b""
while len(got) < 16:
    b = s.recv(16 - len(got))
    if not b:
        break
    got += b
time.sleep(0.2)  # the last acknowledgement of the reply
totals = meter.totals()  # the connection is still open (a closed one leaves the kernel's table)
print(json.dumps({{"received_by_b": int(got), "totals": asdict(totals)}}), flush=True)
"""


def test_a_lossy_path_shows_retransmitted_bytes_apart_from_the_bytes_sent():
    with Hosts({"a": "50mbit", "b": "5mbit"}) as hosts:
        receiver = hosts.popen("b", [sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE, text=True)
        assert receiver.stdout.readline().strip() == "ready"
        before = hosts.link_stats("a")
        out = subprocess.run(hosts.prefix("a") + [sys.executable, "-c", SENDER, hosts.addr("b")],
                             capture_output=True, text=True, timeout=90)
        after = hosts.link_stats("a")
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    totals = result["totals"]
    assert result["received_by_b"] == SIZE
    # each byte counted once as sent (the peer's acknowledged bytes), the few bytes b answered aside
    assert SIZE <= totals["sent"] <= SIZE + 100, totals
    assert totals["received"] == 16, totals
    assert 0 < totals["retransmitted"] < SIZE * 0.5, totals
    # what a's interface carried, less each packet's headers: the bytes sent and those sent again
    payload = ip_payload(after, "tx") - ip_payload(before, "tx")
    assert 0.9 <= payload / (totals["sent"] + totals["retransmitted"]) <= 1.1, (payload, totals, before, after)
