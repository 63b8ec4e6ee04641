"""A DHT node's calls to a peer over one stream kept open, in place of a stream for each call.

hivemind's DHTProtocol sends every ping, store and find as a unary call, and its p2p daemon opens a
libp2p stream for each: the stream's open, accept and close frames and their acknowledgements are
most of a small call's packets. At 10 Mbit/s these calls, not the payloads, were most of a SparseLoCo
peer's bytes (bench/RESULTS.md, "What a SparseLoCo peer's packets are"). One 340-byte store on
loopback cost 1,517 bytes on the wire in 12 packets as a unary call, and 625 bytes in 3 packets on a
stream kept open.

A channel carries hivemind's own request and response messages (and a lean read's ``FIND_NEWER``,
served by swarm/dht/lean_read.py, which no unary handler knows), framed by
protocol/dht/channel_frames.py, to one peer; calls are pipelined (each has an id its answer echoes).
The serving side hands each request to the node's DHTProtocol through hivemind's ``AuthRPCWrapper``,
as hivemind's own handlers are registered: a private run's authorizer checks every request, the
record validators every record, the routing table learns the caller, exactly as for a unary call.

The calling side installs itself as the protocol's ``get_stub``, under hivemind's ``AuthRPCWrapper``
(requests are signed as before). A peer that does not serve channels (plain hivemind, an older
voloco) is called unary, and so is any peer for a while after a channel to it could not be opened:
``NO_CHANNEL_FIRST_S`` after the first failure, twice as long after each next one, at most
``NO_CHANNEL_S`` (a node contacted while it still starts, before its channels are served, gets a
channel a second later, not after 15 s of unary calls through a start-up's burst of calls;
tests/swarm/test_dht_channels.py). A channel closed before its first answer (a server at its bound takes
the stream, then closes it) counts as a failed open; the back-off ends with a channel's first answer.
A call whose channel broke before it was answered is made again unary, signed anew in a private run
(pings, stores and finds may be repeated).

A find answered over a channel names at most ``FIND_NEIGHBORS`` nearest nodes a key, not hivemind's
``bucket_size`` (20): voloco's lean searches keep 8 (a key's 5 replicas and 3 spares,
swarm/dht/lean_store.py), a beam a farther node cannot enter, and the caller builds a PeerID (a base58
string) for every node named. At 32 peers the 20 names were
53 of a peer's 61 KB of find answers a round (bench/RESULTS.md, "Ninety-fifth session"); a unary find,
which plain hivemind peers make, still names 20.

Bounds: a frame's body is at most hivemind's own unary bound (4 MiB). A caller keeps at most
``MAX_PENDING`` calls in flight on a channel and ``MAX_CHANNELS`` channels open; it closes a channel
idle for ``IDLE_S`` (looked for every ``SWEEP_S``, so always before its server would), or whose last
``TIMEOUTS_TO_CLOSE`` calls went unanswered in time (the next call opens another). A server serves at
most ``MAX_SERVED_PER_PEER`` channels of one peer and ``MAX_SERVED`` in all, reads one request at a time
from each, and closes one silent for ``SERVED_IDLE_S``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any, Callable, Dict, Optional, Tuple

from hivemind.dht.protocol import DHTProtocol
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import dht_pb2
from hivemind.utils.auth import AuthRole, AuthRPCWrapper

from protocol.dht.channel_frames import (
    ERROR, FIND, FIND_NEWER, HEADER_BYTES, MAX_BODY_BYTES, METHODS, OK, PING, STORE, ChannelFrameError, answer_header,
    error_body, parse_header, request_header,
)
from swarm.call_limits import CallLimiter
from swarm.dht.lean_read import NewerRecords, no_channel_now, not_served
from swarm.dht.lean_store import SPARE_CANDIDATES

logger = logging.getLogger("voloco.swarm")

HANDLER = "voloco.dht.channel.v1"
MAX_PENDING = 32
MAX_CHANNELS = 256
# a channel is kept while the peer serves it (``SERVED_IDLE_S``): closed at most IDLE_S + SWEEP_S idle, before
# the server would; at 32 peers a round's DHT keys land on other nodes each round, and at 60 s a peer opened
# 2.0 channels a round anew (bench/RESULTS.md, "Ninety-fourth session")
IDLE_S = 240.0
SWEEP_S = 10.0  # how often idle channels are looked for
NO_CHANNEL_FIRST_S = 1.0  # unary calls to a peer after its first failed open ...
NO_CHANNEL_S = 15.0  # ... doubling with each failure that follows, up to this
OPEN_TIMEOUT_S = 5.0
MAX_SERVED_PER_PEER = 4
MAX_SERVED = 1024
SERVED_IDLE_S = 300.0
TIMEOUTS_TO_CLOSE = 2
# nearest nodes a find over a channel names a key, and never fewer than a lean search keeps (num_replicas + spares)
FIND_NEIGHBORS = 8
BODY_TIMEOUT_S = 30.0  # a body announced by a header must arrive within this, and an answer leave

REQUESTS = {PING: dht_pb2.PingRequest, STORE: dht_pb2.StoreRequest, FIND: dht_pb2.FindRequest,
            FIND_NEWER: dht_pb2.FindRequest}
RESPONSES = {PING: dht_pb2.PingResponse, STORE: dht_pb2.StoreResponse, FIND: dht_pb2.FindResponse,
             FIND_NEWER: dht_pb2.FindResponse}


class ChannelBroken(ConnectionError):
    """The channel closed before the call was answered."""


class ChannelError(RuntimeError):
    """The serving peer answered the call with an error."""


# ---- the serving side -------------------------------------------------------------------------------
class _FewNeighbors:
    """The node's DHTProtocol, whose finds name at most ``FIND_NEIGHBORS`` nearest nodes a key (trimmed
    before the authorizer's wrapper signs the answer)."""

    def __init__(self, protocol: DHTProtocol):
        self.protocol = protocol
        self.named = max(FIND_NEIGHBORS, protocol.num_replicas + SPARE_CANDIDATES)

    def __getattr__(self, name: str):
        return getattr(self.protocol, name)

    async def rpc_find(self, request: dht_pb2.FindRequest, context) -> dht_pb2.FindResponse:
        response = await self.protocol.rpc_find(request, context)
        for result in response.results:
            del result.nearest_node_ids[self.named:]
            del result.nearest_peer_ids[self.named:]
        return response


class ChannelServer:
    """Serves channels: each request goes to the node's DHTProtocol as hivemind's handlers send it."""

    def __init__(self, protocol: DHTProtocol):
        self.protocol = protocol
        self.servicer = AuthRPCWrapper(_FewNeighbors(protocol), AuthRole.SERVICER, protocol.authorizer)
        # FIND_NEWER (swarm/dht/lean_read.py): checked by the same authorizer as hivemind's calls
        self.newer = AuthRPCWrapper(NewerRecords(protocol), AuthRole.SERVICER, protocol.authorizer)
        self.serving = CallLimiter(MAX_SERVED_PER_PEER, MAX_SERVED)  # the channels open, by peer
        self.stats: Counter = Counter()

    async def handle(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = stream_info.peer_id
        with self.serving.admit(peer) as admitted:
            if not admitted:
                self.stats["refused_channels"] += 1
                writer.close()
                return
            self.stats["channels"] += 1
            try:
                await self._serve_channel(peer, reader, writer)
            finally:
                writer.close()

    async def _serve_channel(self, peer: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One request at a time, each answered before the next is read, until the channel closes or falls silent."""
        try:
            while True:
                try:
                    head = parse_header(await asyncio.wait_for(reader.readexactly(HEADER_BYTES), SERVED_IDLE_S),
                                        answer=False)
                    body = await asyncio.wait_for(reader.readexactly(head.length), BODY_TIMEOUT_S)
                except ChannelFrameError as e:
                    self.stats["bad_frames"] += 1
                    logger.debug(f"DHT channel from {peer}: {e}; closing it")
                    return
                except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
                    return
                status, out = await self._serve(head.kind, body, peer)
                writer.write(answer_header(status, head.call_id, len(out)) + out)
                await asyncio.wait_for(writer.drain(), BODY_TIMEOUT_S)  # a caller that reads nothing is dropped
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            return

    async def _serve(self, method: int, body: bytes, peer: PeerID):
        name = METHODS[method]
        try:
            request = REQUESTS[method].FromString(body)
        except Exception:
            self.stats["bad_requests"] += 1
            return ERROR, error_body(f"{name}: not a {REQUESTS[method].__name__}")
        context = P2PContext(handle_name=f"{type(self.protocol).__name__}.{name}", local_id=self.protocol.p2p.peer_id,
                             remote_id=peer)
        try:
            response = await getattr(self.newer if method == FIND_NEWER else self.servicer, name)(request, context)
        except Exception as e:
            logger.debug(f"DHT channel {name} from {peer} failed: {e!r}")
            return ERROR, error_body(f"{name} failed: {type(e).__name__}")
        if response is None:  # the authorizer refused the request
            self.stats["refused_calls"] += 1
            return ERROR, error_body(f"{name}: request refused")
        out = response.SerializeToString()
        if len(out) > MAX_BODY_BYTES:
            return ERROR, error_body(f"{name}: the answer is over the channel's bound")
        self.stats[name] += 1
        return OK, out


# ---- the calling side -------------------------------------------------------------------------------
class _Channel:
    """One open stream to a peer, with the calls in flight on it."""

    def __init__(self, peer: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.peer, self.reader, self.writer = peer, reader, writer
        self.pending: Dict[int, asyncio.Future] = {}
        self.next_id = 0
        self.used = time.monotonic()
        self.closed = False
        self.timeouts = 0  # calls in a row that were not answered in time
        self.answered = False  # whether the server has answered a call: a full server takes a stream, then closes it
        self.slots = asyncio.Semaphore(MAX_PENDING)
        self.write_lock = asyncio.Lock()
        self.reading = asyncio.create_task(self._read())

    async def call(self, method: int, request, timeout: Optional[float]):
        async with self.slots:
            if self.closed:
                raise ChannelBroken(f"the channel to {self.peer} is closed")
            self.used = time.monotonic()
            call_id, self.next_id = self.next_id, (self.next_id + 1) % 2**32
            body = request.SerializeToString()
            answer = asyncio.get_running_loop().create_future()
            self.pending[call_id] = answer
            began = time.monotonic()
            try:
                try:
                    await asyncio.wait_for(self._send(request_header(method, call_id, len(body)) + body), timeout)
                except asyncio.TimeoutError:  # a stream that takes no more: its frames may be cut, so it goes
                    self.close()
                    raise
                left = None if timeout is None else max(0.0, timeout - (time.monotonic() - began))
                try:
                    status, out = await asyncio.wait_for(asyncio.shield(answer), left)
                except asyncio.TimeoutError:
                    self.timeouts += 1
                    if self.timeouts >= TIMEOUTS_TO_CLOSE:  # a stream that may be dead: the next call opens another
                        self.close()
                    raise
                self.timeouts = 0
            except ChannelBroken:
                raise
            except (ConnectionError, RuntimeError) as e:
                self.close()
                raise ChannelBroken(f"writing to {self.peer}: {e!r}") from None
            finally:
                self.pending.pop(call_id, None)
            self.used = time.monotonic()
        if status != OK:
            raise ChannelError(f"{METHODS[method]} at {self.peer}: {out.decode('utf-8', 'replace')}")
        return RESPONSES[method].FromString(out)

    async def _send(self, frame: bytes) -> None:
        async with self.write_lock:
            if self.closed:
                raise ChannelBroken(f"the channel to {self.peer} is closed")
            self.writer.write(frame)
            await self.writer.drain()

    async def _read(self) -> None:
        try:
            while True:
                head = parse_header(await self.reader.readexactly(HEADER_BYTES), answer=True)
                out = await self.reader.readexactly(head.length)
                self.answered = True
                answer = self.pending.get(head.call_id)
                if answer is not None and not answer.done():
                    answer.set_result((head.kind, out))
        except ChannelFrameError as e:
            logger.debug(f"DHT channel to {self.peer}: {e}; closing it")
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for answer in self.pending.values():
            if not answer.done():
                answer.set_exception(ChannelBroken(f"the channel to {self.peer} closed"))
                answer.exception()  # marked as read: a caller that timed out will not read it (asyncio would log it)
        self.writer.close()
        if self.reading is not asyncio.current_task():
            self.reading.cancel()


class ChannelPool:
    """The channels this node keeps to its peers, opened on first use."""

    def __init__(self, p2p, authorizer=None):
        self.p2p, self.authorizer = p2p, authorizer
        self.channels: Dict[PeerID, _Channel] = {}
        self.opening: Dict[PeerID, asyncio.Lock] = {}
        # peer -> (called unary until, failed opens in a row); gone once a channel to it answers
        self.unserved: Dict[PeerID, Tuple[float, int]] = {}
        self.stats: Counter = Counter()
        self._swept = time.monotonic()

    async def call(self, peer: PeerID, method: int, request, timeout: Optional[float], unary: Callable,
                   no_channel: Optional[Callable] = None):
        """The call's response, over a channel where one opens, else unary (``no_channel`` in place of
        ``unary`` where no channel is open or opens); within ``timeout`` in all (a fall-back unary call
        gets at least a tenth of a second)."""
        began = time.monotonic()

        def left() -> Optional[float]:
            return None if timeout is None else max(0.1, timeout - (time.monotonic() - began))

        channel = await self._channel(peer, timeout)
        if channel is None:
            self.stats["unary"] += 1
            return await (no_channel or unary)(request, timeout=left())
        try:
            response = await channel.call(method, request, left())
        except ChannelBroken:
            self.stats["broken"] += 1
            if self.channels.get(peer) is channel:  # once a channel, whatever calls were in flight on it
                del self.channels[peer]
                if not channel.answered:  # taken and closed unanswered (a server at MAX_SERVED): as a failed open
                    self.stats["closed_unanswered"] += 1
                    self._no_channel(peer, "closed before its first answer")
            await self._sign_anew(request)
            self.stats["unary"] += 1
            return await unary(request, timeout=left())
        self.stats["channel"] += 1
        if peer in self.unserved:  # answered, so served: the back-off starts again from its first step
            del self.unserved[peer]
        return response

    async def _sign_anew(self, request) -> None:
        """A call made again after its channel broke may have reached the peer, whose authorizer would
        refuse its nonce a second time as a replay: sign it again, with a fresh nonce (the wrapper
        around this stub checks the answer against the request's nonce as it is then)."""
        if self.authorizer is not None and request.HasField("auth"):
            request.auth.signature = b""
            await self.authorizer.sign_request(request, None)

    async def _channel(self, peer: PeerID, timeout: Optional[float]) -> Optional[_Channel]:
        self._sweep()
        channel = self.channels.get(peer)
        if channel is not None and not channel.closed:
            return channel
        if time.monotonic() < self.unserved.get(peer, (0.0, 0))[0]:
            return None
        lock = self.opening.setdefault(peer, asyncio.Lock())
        async with lock:
            channel = self.channels.get(peer)
            if channel is not None and not channel.closed:
                return channel
            if time.monotonic() < self.unserved.get(peer, (0.0, 0))[0]:
                return None
            wait = OPEN_TIMEOUT_S if timeout is None else min(OPEN_TIMEOUT_S, timeout)
            try:
                _, reader, writer = await asyncio.wait_for(self.p2p.call_binary_stream_handler(peer, HANDLER), wait)
            except Exception as e:
                self.stats["open_failed"] += 1
                self._no_channel(peer, repr(e))
                return None
            if len(self.channels) >= MAX_CHANNELS:
                self._close_least_used()
            channel = self.channels[peer] = _Channel(peer, reader, writer)
            self.stats["opened"] += 1
            return channel

    def _no_channel(self, peer: PeerID, why: str) -> None:
        """Call ``peer`` unary for a while, twice as long as after its last failure in a row."""
        self._prune()
        failures = self.unserved.get(peer, (0.0, 0))[1] + 1
        unary_for = no_channel_for(failures)
        self.unserved[peer] = (time.monotonic() + unary_for, failures)
        logger.debug(f"no DHT channel to {peer} ({why}): unary calls for {unary_for:.0f} s")

    def _prune(self) -> None:
        """Drop what the pool remembers of peers past their use, once it grows large."""
        if len(self.unserved) > 4 * MAX_CHANNELS:  # a bound, not a policy
            now = time.monotonic()
            self.unserved = {p: (until, n) for p, (until, n) in self.unserved.items() if until > now}
        if len(self.opening) > 4 * MAX_CHANNELS:
            self.opening = {p: lock for p, lock in self.opening.items() if lock.locked()}

    def _sweep(self) -> None:
        now = time.monotonic()
        if now - self._swept < SWEEP_S:
            return
        self._swept = now
        for peer, channel in list(self.channels.items()):
            if channel.closed or (not channel.pending and now - channel.used > IDLE_S):
                channel.close()
                del self.channels[peer]

    def _close_least_used(self) -> None:
        peer = min(self.channels, key=lambda p: self.channels[p].used)
        self.channels.pop(peer).close()

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()
        self.channels.clear()


def no_channel_for(failures: int) -> float:
    """Seconds of unary calls to a peer after its ``failures``-th failed open in a row."""
    return min(NO_CHANNEL_S, NO_CHANNEL_FIRST_S * 2.0 ** min(max(failures, 1) - 1, 16))


class ChannelStub:
    """What the protocol's ``get_stub`` wraps: hivemind's stub methods, over a channel where one opens."""

    def __init__(self, pool: ChannelPool, peer: PeerID, unary: Any):
        self._pool, self._peer, self._unary = pool, peer, unary

    async def rpc_ping(self, request, timeout: Optional[float] = None):
        return await self._pool.call(self._peer, PING, request, timeout, self._unary.rpc_ping)

    async def rpc_store(self, request, timeout: Optional[float] = None):
        return await self._pool.call(self._peer, STORE, request, timeout, self._unary.rpc_store)

    async def rpc_find(self, request, timeout: Optional[float] = None):
        return await self._pool.call(self._peer, FIND, request, timeout, self._unary.rpc_find)

    async def rpc_find_newer(self, request, timeout: Optional[float] = None):
        """A lean read's call (swarm/dht/lean_read.py): over a channel only, no unary handler serves it."""
        return await self._pool.call(self._peer, FIND_NEWER, request, timeout, not_served, no_channel=no_channel_now)


async def install_channels(_dht, node) -> None:
    """In the DHT's process: serve channels, and make the node's DHT calls over them."""
    protocol: DHTProtocol = node.protocol
    server = ChannelServer(protocol)
    await protocol.p2p.add_binary_stream_handler(HANDLER, server.handle)
    pool = ChannelPool(protocol.p2p, protocol.authorizer)

    def get_stub(peer: PeerID) -> AuthRPCWrapper:
        unary = super(DHTProtocol, protocol).get_stub(protocol.p2p, peer)
        return AuthRPCWrapper(ChannelStub(pool, peer, unary), AuthRole.CLIENT, protocol.authorizer,
                              service_public_key=None)

    protocol.get_stub = get_stub
    protocol._voloco_channels = (server, pool)


async def channel_stats(_dht, node) -> Dict[str, int]:
    """In the DHT's process: what its channels carried (calls made and served, by kind)."""
    server, pool = getattr(node.protocol, "_voloco_channels", (None, None))
    if server is None:
        return {}
    out = {f"calls_{k}": v for k, v in pool.stats.items()}
    out.update({f"served_{k}": v for k, v in server.stats.items()})
    out["open"] = sum(1 for c in pool.channels.values() if not c.closed)
    return out

