"""A peer's state served over real libp2p streams (peer/exchange/state_serving.py) through its serve
gate (protocol/round/serve_gate.py): a download is served whole; a peer over its downloads for the
window is answered "busy" while another still gets the state; a stream that stalls holds its slot
only until its lease ends."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hivemind.dht import DHT
from hivemind.p2p import P2P
from hivemind.proto import averaging_pb2

from peer.exchange.gatherer import PayloadGatherer
from peer.exchange.state_download import StateDownloader, StateServerBusy
from protocol.dht.keys import averager_prefix
from protocol.round.timing import Timing
from swarm.loop_thread import run_in_fresh_loop
from tests.round.test_liveness import SPEC
from tests.support.dht_nodes import loopback_nodes


@pytest.fixture
def nodes():
    yield from loopback_nodes(SPEC, 3)


def gatherer(dht, timing, **kw) -> PayloadGatherer:
    return PayloadGatherer(dht, prefix=averager_prefix(SPEC.run_id), schema=SPEC.digest().encode(), timing=timing, **kw)


async def _stall(maddr, handle: str, peer) -> int:
    """Ask for the state, read nothing for a while (the server's sends back up), then read what is left
    until the stream ends: the bytes that came."""
    p2p = await P2P.replicate(maddr)
    try:
        _, reader, writer = await p2p.call_binary_stream_handler(peer, handle)
        await P2P.send_protobuf(averaging_pb2.DownloadRequest(), writer)
        await P2P.send_protobuf(P2P.END_OF_STREAM, writer)
        await asyncio.sleep(6.0)
        got = 0
        while chunk := await asyncio.wait_for(reader.read(1 << 20), 20.0):
            got += len(chunk)
        writer.close()
        return got
    finally:
        await p2p.shutdown()


def test_downloads_pass_the_serve_gate_and_a_stalled_one_frees_its_slot_at_its_lease(nodes):
    # a download keeps its slot while it keeps up with 8 MiB/s (after 2 s), and a part goes within 2 s
    timing = Timing().with_(serves_at_once=1, serves_per_peer=1, serve_window_s=600.0, download_min_rate=8 << 20)
    server = gatherer(nodes[0], timing, gather_timeout=2.0)
    first, second = gatherer(nodes[1], timing), gatherer(nodes[2], timing)
    try:
        for g in (server, first, second):
            g.run_in_background(await_ready=True)
        theta = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        big = torch.zeros(16 << 20)  # 64 MiB: more than a stream's buffers hold
        server.state_provider = lambda: ({"round": 3}, [theta.clone(), big])
        server.allow_state_sharing = True
        peer = server.peer_id.to_base58()
        size = 4 * (12 + big.numel())
        fetch = StateDownloader(nodes[1], first, min_rate=1 << 20)
        meta, tensors = fetch(peer, expected_bytes=size, timeout=30.0, tensors=2)
        assert meta == {"round": 3} and torch.equal(tensors[0], theta) and tensors[1].numel() == big.numel()
        with pytest.raises(StateServerBusy, match="busy: began 1 downloads"):
            fetch(peer, expected_bytes=size, timeout=30.0, tensors=2)
        # a downloader that stalls holds the only slot: another is answered busy, until the stalled stream
        # falls behind and is cut (the slot then free), long before its 64 MiB were sent
        handle = type(server)._get_handle_name(server.prefix, "rpc_download_state")
        maddr = nodes[3].run_coroutine(DHT._get_p2p_daemon_listen_maddr)
        pool = ThreadPoolExecutor(1)
        stall = pool.submit(run_in_fresh_loop, _stall(maddr, handle, server.peer_id), "stall")
        time.sleep(1.0)
        other = StateDownloader(nodes[2], second, min_rate=1 << 20)
        with pytest.raises(StateServerBusy, match="serving 1 downloads already"):
            other(peer, expected_bytes=size, timeout=30.0, tensors=2)
        deadline = time.monotonic() + 20.0
        while True:
            try:
                meta, tensors = other(peer, expected_bytes=size, timeout=30.0, tensors=2)
                break
            except StateServerBusy:
                assert time.monotonic() < deadline, "the stalled download kept its slot"
                time.sleep(0.5)
        assert torch.equal(tensors[0], theta)
        assert stall.result(timeout=40.0) < size // 2  # cut: most of the state never went out
        pool.shutdown()
    finally:
        for g in (server, first, second):
            g.shutdown()



def test_a_download_left_at_once_keeps_its_place_until_the_host_answered():
    """The host copies θ and the shared state for every download the gate admits, whether or not its
    asker still reads: 40 strangers that left at once started 40 copies in 0.3 s while the gate let
    one stranger in at a time. A download left before the host answered keeps its place until then."""
    from types import SimpleNamespace

    from hivemind.compression import NoCompression
    from hivemind.p2p import P2PContext, PeerID

    from peer.exchange.state_serving import StateServing
    from protocol.wire.signed import Signer

    copies = []

    async def go():
        answered = asyncio.Event()

        async def host_copy():  # the host process's copy of the state, slow
            copies.append(1)
            await answered.wait()
            return b"", [torch.zeros(4)], None

        server = SimpleNamespace(allow_state_sharing=True, timing=Timing().with_(serves_at_once=2), _serve_gate=None,
                                 _known=frozenset(), _mates=frozenset(), _log_refusal=lambda peer, why: None,
                                 _get_current_state_from_host_process=host_copy, state_compression=NoCompression(),
                                 _cut=StateServing._cut)

        async def left_at_once(key):
            context = P2PContext(handle_name="h", local_id=PeerID(Signer.generate().peer_id), remote_id=PeerID(key.peer_id))
            stream = StateServing.rpc_download_state(server, averaging_pb2.DownloadRequest(), context)
            task = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0.05)
            task.cancel()  # the asker reset its stream
            await asyncio.gather(task, return_exceptions=True)
            await stream.aclose()
            return task

        for _ in range(5):
            await left_at_once(Signer.generate())
        busy = len(server._serve_gate.slots)
        answered.set()
        await asyncio.sleep(0.05)
        return busy, len(server._serve_gate.slots)

    busy, after = asyncio.run(go())
    assert copies == [1] and busy == 1  # one stranger's copy at a time: the others were answered busy
    assert after == 0  # its place given back once the host answered
