"""swarm/persistent_reads.py: the p2p daemon's persistent connection is read on after an answer to a
call its caller gave up a moment before; a real DHT node's processes run the wrapped reader."""

from __future__ import annotations

import asyncio
import uuid

from hivemind.p2p.p2p_daemon_bindings.control import ControlClient
from hivemind.p2p.p2p_daemon_bindings.utils import write_pbmsg
from hivemind.proto import p2pd_pb2

from swarm import persistent_reads
from swarm.dht.node import start_dht
from tests.support.dht_nodes import LOOPBACK


class _Bytes:
    def __init__(self):
        self.data = b""

    def write(self, b: bytes) -> None:
        self.data += b

    async def drain(self) -> None:
        pass


async def _read(reader_method) -> tuple:
    """Two answers on the connection: one to a call whose future was cancelled (its caller timed out, and
    has not yet run to take it out of ``_pending_calls``), then one to a call still waiting."""
    client = ControlClient(daemon_connector=None, _initialized_with_create=True)
    loop = asyncio.get_running_loop()
    late, live = uuid.uuid4(), uuid.uuid4()
    client._pending_calls[late] = loop.create_future()
    client._pending_calls[late].cancel()
    client._pending_calls[live] = loop.create_future()
    out = _Bytes()
    for call, data in ((late, b"late"), (live, b"live")):
        await write_pbmsg(out, p2pd_pb2.PersistentConnectionResponse(
            callId=call.bytes, callUnaryResponse=p2pd_pb2.CallUnaryResponse(response=data)))
    reader = asyncio.StreamReader()
    reader.feed_data(out.data)
    reader.feed_eof()
    try:
        await reader_method(client, reader)
        died = None
    except Exception as e:
        died = e
    answer = client._pending_calls[live]
    return died, answer.result() if answer.done() else None


def test_hivemind_s_own_reader_dies_at_an_answer_to_a_cancelled_call():
    # the failure the wrapper exists for: every later answer and request on the connection goes unread
    died, live = asyncio.run(_read(persistent_reads._original))
    assert isinstance(died, asyncio.InvalidStateError)
    assert live is None


def test_the_wrapped_reader_drops_that_answer_and_reads_on():
    died, live = asyncio.run(_read(persistent_reads._read_on))
    assert died is None
    assert live == b"live"


async def _reader_name(_dht, _node) -> str:
    return ControlClient._read_from_persistent_conn.__name__


def test_a_dht_node_s_own_process_runs_the_wrapped_reader():
    node = start_dht((), LOOPBACK)
    try:
        assert node.run_coroutine(_reader_name) == "_read_on"
    finally:
        node.shutdown()
