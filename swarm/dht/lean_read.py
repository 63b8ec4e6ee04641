"""Network reads of a dictionary key in which each record comes about once, not once from every replica.

hivemind's ``get`` searches toward the key and every node of its beam that holds the key answers with
the whole dictionary, with 20 nearest nodes besides. For the progress key, which holds every peer's
record, that was 5 copies of the swarm's records a read, each parsed and checked: 65.7 KiB on the
wire for one read of a 32-peer swarm's records (bench/wire_bytes.py --ops 32; bench/RESULTS.md,
"Ninety-first session").

A lean read (``lean_get``, in the DHT's process) takes the key's nearest nodes as a lean store finds
them (swarm/dht/lean_store.py: searched once, remembered), asks one replica (its own pick,
protocol/dht/newer_reads.py ``ask_order``) for the records newer than the reader's last view of the
key, then the other replicas, at once, for the records newer than that (``FIND_NEWER``,
protocol/dht/newer_reads.py). Each answer is checked by this node's record validators as hivemind
checks a find's (a record that fails drops the whole answer), and the result
is hivemind's: every subkey's newest record, its value stripped of its signature, read from as many
replicas as a read over the whole beam. A record from the last view that no answer replaced is kept
until it expires, as hivemind's own storage keeps it. A replica's word on when its dictionary expires
is not believed (hivemind's search ends at an answer said to expire late enough): the result expires
with its newest record.

A replica that does not serve ``FIND_NEWER`` (an older voloco that closes the channel) is asked with
hivemind's find instead, for ``NOT_SERVED_S``; one to which no channel is open just now (plain hivemind,
a node still starting, a server at its channel bound), with hivemind's find that once (``NoChannelNow``:
a channel's back-off is seconds, not ``NOT_SERVED_S``); a key whose value is not a dictionary, or a read no
replica answered, is hivemind's ``get``. Served by ``NewerRecords`` on every node's DHT channels
(swarm/dht/channels.py). Guarded by tests/swarm/test_lean_read.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Awaitable, Callable, Dict, Optional, Tuple

from hivemind.dht.node import _SearchState
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.p2p import PeerID
from hivemind.proto import dht_pb2
from hivemind.utils import ValueWithExpiration

from protocol.dht.newer_reads import HeldListError, ask_order, newer, pack_held, parse_held
from swarm.dht.lean_store import SPARE_CANDIDATES, forget_nearest, nearest_nodes

logger = logging.getLogger("voloco.swarm")

# a replica that did not serve FIND_NEWER (an older build closes the channel) is asked with hivemind's find this long
NOT_SERVED_S = 600.0
MAX_VIEWS = 256  # keys whose last view a node keeps (a new matchmaking key every round: a bound, not a policy)

# (node id, key id) -> the key's records as the last lean read found them (signed, serialized)
_views: Dict[Tuple[DHTID, DHTID], DictionaryDHTValue] = {}
# (node id, peer) -> until when that peer is asked with hivemind's find
_not_served: Dict[Tuple[DHTID, PeerID], float] = {}
# node id -> its lean reads, the records their answers carried, the replicas asked with hivemind's find,
# and the reads that were hivemind's get (``lean_read_stats``)
_stats: Dict[DHTID, Counter] = {}


class NotServed(ConnectionError):
    """The peer's channel broke on this call (an older voloco does not know it): ask it with hivemind's
    find, for ``NOT_SERVED_S``."""


class NoChannelNow(ConnectionError):
    """No channel to the peer is open, nor opens, just now (it still starts, or its server is at its
    bound): ask it with hivemind's find this once, and over a channel again next time."""


class NewerRecords:
    """Serves ``rpc_find_newer``: what this node's storage holds under a key, less what the caller holds."""

    def __init__(self, protocol):
        self.protocol = protocol

    async def rpc_find_newer(self, request: dht_pb2.FindRequest, context=None) -> dht_pb2.FindResponse:
        if len(request.keys) != 2:
            raise HeldListError(f"a find-newer request names a key and a held list, got {len(request.keys)} fields")
        key_id = DHTID.from_bytes(request.keys[0])
        held = parse_held(request.keys[1])
        found = self.protocol.storage.get(key_id)
        if found is None:
            return dht_pb2.FindResponse(results=[dht_pb2.FindResult(type=dht_pb2.NOT_FOUND)])
        if not isinstance(found.value, DictionaryDHTValue):
            return dht_pb2.FindResponse(results=[dht_pb2.FindResult(
                type=dht_pb2.FOUND_REGULAR, value=found.value, expiration_time=found.expiration_time)])
        dumps = self.protocol.serializer.dumps
        entries = list(found.value.items())
        out = DictionaryDHTValue()
        for i in newer(((dumps(subkey), item.expiration_time) for subkey, item in entries), held):
            subkey, item = entries[i]
            out.store(subkey, item.value, item.expiration_time)
        return dht_pb2.FindResponse(results=[dht_pb2.FindResult(
            type=dht_pb2.FOUND_DICTIONARY, value=dumps(out), expiration_time=found.expiration_time)])


async def lean_get(node, key: str, beam_size: Optional[int],
                   whole: Callable[[], Awaitable[Optional[ValueWithExpiration]]]) -> Optional[ValueWithExpiration]:
    """In the DHT's process: ``node.get(key, latest=True)``'s result, read as the module doc says;
    ``whole()``: hivemind's get, for a key whose value is not a dictionary or a read nobody answered."""
    protocol = node.protocol
    key_id = DHTID.generate(source=key)
    stats = _stats.setdefault(node.node_id, Counter())
    stats["reads"] += 1
    memo = (node.node_id, key_id)
    # a dictionary of the read's own: hivemind's get merges into its first candidate's, which is the
    # node's storage where it holds the key (tests/swarm/test_lean_read.py)
    merged = DictionaryDHTValue()
    _merge(merged, _views.pop(memo, None))
    nearest = await nearest_nodes(node, key_id, node.num_replicas + SPARE_CANDIDATES, beam_size)
    wanted = node.num_replicas
    if node.peer_id in nearest[:wanted]:
        own = protocol.storage.get(key_id)
        if own is not None and not isinstance(own.value, DictionaryDHTValue):
            stats["whole"] += 1
            return await whole()
        _merge(merged, own.value if own is not None else None)
        wanted -= 1
    # one replica alone first (this reader's own pick: ``ask_order``), then as many more as are wanted at
    # once: they send only what it did not (a dead first costs one wait: the others are asked together,
    # spares in place of those that fail)
    others = ask_order([p for p in nearest if p != node.peer_id], wanted, node.node_id.to_bytes())
    answered, size = 0, 1
    dumps = protocol.serializer.dumps
    while answered < wanted and others:
        batch, others = others[:size], others[size:]
        held = pack_held((dumps(subkey), item.expiration_time) for subkey, item in merged.items())  # once a batch
        answers = await asyncio.gather(*(_ask(node, p, key_id, held) for p in batch))
        for answer in answers:
            if answer is None:
                forget_nearest(node, key_id)  # the next read searches the nearest nodes again
                continue
            if answer is _REGULAR:
                stats["whole"] += 1
                return await whole()
            answered += 1
            stats["records"] += len(answer)
            _merge(merged, answer)
        size = wanted - answered
    if answered == 0 and wanted > 0:
        stats["whole"] += 1
        return await whole()
    if len(_views) >= MAX_VIEWS:
        _views.clear()
    _views[memo] = merged
    return _result(protocol, key_id, merged)


def _merge(into: DictionaryDHTValue, found: Optional[DictionaryDHTValue]) -> None:
    """Each record of ``found`` that is newer than ``into``'s of its subkey, into ``into``. Only newer ones:
    hivemind's timed storage, given an older record after a newer one, keeps the newer but expires it
    at the older one's time."""
    for subkey, item in (found.items() if found is not None else ()):
        have = into.get(subkey)
        if have is None or item.expiration_time > have.expiration_time:
            into.store(subkey, item.value, item.expiration_time)


def _result(protocol, key_id: DHTID, merged: DictionaryDHTValue) -> Optional[ValueWithExpiration]:
    """hivemind's get result of ``merged`` (values stripped of their signatures and deserialized), None if
    it is empty; its expiration is the latest of its records', never a replica's unsigned word."""
    items = list(merged.items())
    if not items:
        return None
    state = _SearchState(key_id, float("inf"), serializer=protocol.serializer, record_validator=protocol.record_validator)
    state.binary_value, state.expiration_time = merged, max(item.expiration_time for _, item in items)
    state.finish_search()
    return state.future.result()


_REGULAR = object()  # a replica that holds a value, not a dictionary, under the key: read with hivemind's get


async def _ask(node, peer: PeerID, key_id: DHTID, held: bytes):
    """One replica's checked records newer than those of ``held`` (``pack_held``'s list; an empty
    dictionary where it holds none of them), ``_REGULAR``, or None where it gave no answer that passed."""
    protocol = node.protocol
    memo = (node.node_id, peer)
    if time.monotonic() < _not_served.get(memo, 0.0):
        return await _ask_whole(protocol, peer, key_id)
    request = dht_pb2.FindRequest(keys=[key_id.to_bytes(), held])
    try:
        async with protocol.rpc_semaphore:
            response = await protocol.get_stub(peer).rpc_find_newer(request, timeout=protocol.wait_timeout)
    except NoChannelNow:
        return await _ask_whole(protocol, peer, key_id)
    except (NotServed, AttributeError):  # AttributeError: a stub without channels has no such call
        if len(_not_served) > 4096:  # a bound, not a policy
            _not_served.clear()
        _not_served[memo] = time.monotonic() + NOT_SERVED_S
        return await _ask_whole(protocol, peer, key_id)
    except Exception as e:
        logger.debug(f"a lean read at {peer} failed: {e!r}")
        asyncio.create_task(protocol.update_routing_table(protocol.routing_table.get(peer_id=peer), peer, responded=False))
        return None
    if response is None or len(response.results) != 1:
        return None
    result = response.results[0]
    if result.type == dht_pb2.NOT_FOUND:
        found = DictionaryDHTValue()
    elif result.type == dht_pb2.FOUND_REGULAR:
        return _REGULAR
    else:
        try:  # anything a replica sends is checked as hivemind checks a find's answer, and may not raise here
            found = protocol.serializer.loads(result.value)
            if not isinstance(found, DictionaryDHTValue) or not protocol._validate_dictionary(key_id.to_bytes(), found):
                return None
        except Exception as e:
            logger.debug(f"a lean read at {peer} was answered with what is not a dictionary of valid records: {e!r}")
            return None
    node_id = protocol.routing_table.get(peer_id=peer)
    if node_id is not None:  # as hivemind's find does: a node that answers stays in the routing table
        asyncio.create_task(protocol.update_routing_table(node_id, peer, responded=True))
    return found


async def _ask_whole(protocol, peer: PeerID, key_id: DHTID):
    """hivemind's find at one replica (its answer checked by its protocol), as ``_ask`` answers. A
    replica that holds nothing, or nothing valid, is no answer (hivemind's find tells them not apart)."""
    _stats.setdefault(protocol.node_id, Counter())["asked_whole"] += 1
    found = await protocol.call_find(peer, [key_id])
    value = None if found is None or key_id not in found else found[key_id][0]
    if value is None:
        return None
    return value.value if isinstance(value.value, DictionaryDHTValue) else _REGULAR


async def forget_views(_dht, node) -> None:
    """In the DHT's process: forget this node's last views, so its next lean reads start from nothing
    (bench/wire_bytes.py's first reads)."""
    for memo in [m for m in _views if m[0] == node.node_id]:
        del _views[memo]


async def lean_read_stats(_dht, node) -> Dict[str, int]:
    """In the DHT's process: what this node's lean reads did (``_stats``)."""
    return dict(_stats.get(node.node_id, Counter()))


def not_served(*_args, **_kwargs):
    """The unary stand-in for ``FIND_NEWER`` after its channel broke: no hivemind handler serves it."""
    raise NotServed("no DHT channel to ask for newer records")


async def no_channel_now(*_args, **_kwargs):
    """... and where no channel to the peer is open or opens just now."""
    raise NoChannelNow("no DHT channel to the peer just now")
