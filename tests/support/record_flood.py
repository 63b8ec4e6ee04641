"""A DHT node that floods every node it meets with valid records, for tests and bench/hostile.py:

    python -m tests.support.record_flood JOIN_ADDR SECONDS [MIB_PER_S]

It joins with a plain hivemind DHT and, for SECONDS, stores records that every voloco node must
accept (unowned keys, 16 KB values, an honest six-minute TTL) at every node of its routing table,
half into their storage and half into their cache, at about MIB_PER_S (default 4) in all. Each node
holds at most its bound of them (swarm/dht/store_quota.py); without it, a node kept them all.

It prints ``stored <bytes accepted> at <nodes> nodes`` after each pass.
"""

from __future__ import annotations

import functools
import os
import sys
import time

import hivemind
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.proto import dht_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time

VALUE_BYTES = 16 << 10
BATCH = 32  # records a request


async def _flood_once(count: int, _dht, node) -> tuple:
    """``count`` records at every node of the routing table; (bytes accepted, nodes reached)."""
    protocol = node.protocol
    peers = list(protocol.routing_table.uid_to_peer_id.values())
    value = MSGPackSerializer.dumps(os.urandom(VALUE_BYTES))
    accepted = 0
    for peer in peers:
        for start in range(0, count, BATCH):
            n = min(BATCH, count - start)
            request = dht_pb2.StoreRequest(
                keys=[DHTID.generate().to_bytes() for _ in range(n)], subkeys=[DHTProtocol.IS_REGULAR_VALUE] * n,
                values=[value] * n, expiration_time=[get_dht_time() + 360] * n,
                in_cache=[(start // BATCH) % 2 == 1] * n, peer=protocol.node_info)
            try:
                answer = await protocol.get_stub(peer).rpc_store(request, timeout=10)
                accepted += sum(answer.store_ok) * len(value)
            except Exception:
                pass
    return accepted, len(peers)


async def _routing_size(_dht, node) -> int:
    return len(node.protocol.routing_table.uid_to_peer_id)


def main() -> None:
    join, seconds = sys.argv[1], float(sys.argv[2])
    rate = float(sys.argv[3]) if len(sys.argv) > 3 else 4.0
    from tests.support import record_flood as this  # (run as __main__: the DHT process unpickles these by module)

    dht = hivemind.DHT(initial_peers=[join], host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    deadline, total = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        t = time.monotonic()
        nodes = max(1, dht.run_coroutine(this._routing_size))
        count = max(1, int(rate * 2**20 / VALUE_BYTES / nodes))  # a second's worth at the rate, over the nodes
        accepted, reached = dht.run_coroutine(functools.partial(this._flood_once, count))
        total += accepted
        print(f"stored {total} at {reached} nodes", flush=True)
        time.sleep(max(0.0, 1.0 - (time.monotonic() - t)))
    dht.shutdown()


if __name__ == "__main__":
    main()
