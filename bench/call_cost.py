"""What one small P2P call costs in CPU, by how it is made: hivemind's unary call against a stream.

    python bench/call_cost.py [--calls 300] [--json OUT]

Two hivemind P2P instances (each with its own p2p daemon) in this process, on the loopback: one
serves, the other calls it ``--calls`` times each way, 5 ms apart, a ~100-byte request and
answer (the size of a barrier's question and its progress record, peer/exchange/ready_notices.py):

- ``unary``: hivemind's unary call (carried on the daemon's persistent connection: a libp2p stream
  between the daemons, none between a daemon and its Python client);
- ``stream, 1 answer`` / ``stream, 2 answers``: a protobuf stream handler (hivemind's
  ``_iterate_protobuf_stream_handler``: the caller's and the server's Python each open a connection of
  their own to their daemon for the stream), answered with one message, or with two.

CPU is what this process and both daemons spent over each kind's calls, less what they spend idle
over as long (measured first, over 3 s), a call; the ratio is against the unary call of the same
run. It is why a barrier's question and the merge's question to the same peer are two unary calls,
not one stream carrying both answers (docs/scale.md, "What a peer's exchange costs").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import AsyncIterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hivemind.p2p import P2P, P2PContext, ServicerBase  # noqa: E402
from hivemind.proto import averaging_pb2  # noqa: E402

SPACING_S = 0.005
IDLE_S = 3.0
CALL_TIMEOUT_S = 5.0  # one call's bound: a daemon that stops answering ends the run, not hangs it
KINDS = ("unary", "stream, 1 answer", "stream, 2 answers")


RECORD = b"r" * 100


class Answers(ServicerBase):
    async def rpc_unary(self, request: averaging_pb2.AveragingData, context: P2PContext) -> averaging_pb2.AveragingData:
        return averaging_pb2.AveragingData(tensor_part={"buffer": RECORD})

    async def rpc_stream(self, request: averaging_pb2.AveragingData,
                         context: P2PContext) -> AsyncIterator[averaging_pb2.AveragingData]:
        for _ in range(int(request.weight)):
            yield averaging_pb2.AveragingData(tensor_part={"buffer": RECORD})


async def _read_all(stub, request) -> None:
    async for _answer in await stub.rpc_stream(request):
        pass


async def _calls(stub, kind: str, count: int) -> float:
    request = averaging_pb2.AveragingData(tensor_part={"buffer": b"q" * 100}, weight=2.0 if kind.endswith("2 answers") else 1.0)
    began = time.monotonic()
    for _ in range(count):
        if kind == "unary":
            await stub.rpc_unary(request, timeout=CALL_TIMEOUT_S)
        else:
            await asyncio.wait_for(_read_all(stub, request), CALL_TIMEOUT_S)
        await asyncio.sleep(SPACING_S)
    return time.monotonic() - began


async def measure(calls: int) -> list:
    """Two P2P instances on the loopback, shut down whatever happens, and the calls between them."""
    server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        caller = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await server.get_visible_maddrs())
        try:
            return await _measure(server, caller, calls)
        finally:
            await caller.shutdown()
    finally:
        await server.shutdown()


async def _measure(server, caller, calls: int) -> list:
    """Each kind's calls from ``caller`` to ``server``, with both sides' CPU less their idle rate."""
    from swarm.cpu_meter import HelperCpu

    await Answers().add_p2p_handlers(server)
    stub = Answers.get_stub(caller, server.peer_id)
    for kind in KINDS:  # the connection and both paths warm
        await _calls(stub, kind, 3)
    cpu = HelperCpu(lambda: [os.getpid()])  # this process and its children: both daemons
    cpu.since_last()
    await asyncio.sleep(IDLE_S)
    idle_rate = (cpu.since_last() or 0.0) / IDLE_S
    rows = []
    for kind in KINDS:
        began = time.monotonic()
        cpu.since_last()
        took = await _calls(stub, kind, calls)
        spent = (cpu.since_last() or 0.0) - idle_rate * (time.monotonic() - began)
        rows.append({"kind": kind, "calls": calls, "seconds": took, "cpu_s": spent})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--calls", type=int, default=300, help="calls of each kind, at least 10 (default 300)")
    ap.add_argument("--json", metavar="OUT", help="also write the figures to this JSON file")
    args = ap.parse_args(argv)
    if args.calls < 10:
        ap.error("--calls must be at least 10")
    from bench.common import machine, now, table

    rows = asyncio.run(asyncio.wait_for(measure(args.calls), 60 + args.calls * len(KINDS) * CALL_TIMEOUT_S))
    base = rows[0]["cpu_s"] / rows[0]["calls"]  # <= 0 where the CPU counters cannot be read, or too few calls
    print(f"{machine()}, {now()}: {args.calls} calls of each kind, {SPACING_S * 1000:.0f} ms apart, ~100-byte "
          f"request and answer; CPU of both sides (this process and both p2p daemons), less their idle rate")
    print(table(["call", "CPU ms/call", "vs unary", "wall ms/call"],
                [[r["kind"], f"{1000 * r['cpu_s'] / r['calls']:.2f}", f"{r['cpu_s'] / r['calls'] / base:.2f}x" if base > 0 else "n/a",
                  f"{1000 * r['seconds'] / r['calls']:.1f}"] for r in rows]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "date": now(), "calls": args.calls, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
