"""DHT stores and reads that find a key's nearest nodes without fetching the key's value on the way.

hivemind's ``DHTNode.store_many`` first searches for the nodes nearest the key, and every node it
asks answers with the key's whole value, because a find request returns what the node holds. For
the progress key that is every peer's record, from every node of the search, on every write: the
largest share of a small swarm's control-plane bytes (bench/RESULTS.md, "Wire bytes").

A lean store searches toward the key's *shadow* instead: the key's DHT id with its lowest bit
flipped. The XOR distance keeps the order of nodes, since d(n, k ^ 1) = d(n, k) ^ 1, and two nodes
trade places only when their ids differ in the lowest bit alone; so the shadow's nearest nodes are
the key's. Nothing is stored under the shadow, so the answers carry node lists only. The store then
goes to those nodes as ``store_many`` sends it: the same record, signed by the node's record
validator, checked by each receiver's validators, kept in this node's own storage when it is among
the nearest (and not in client mode).

A lean read finds the nearest nodes the same way, then asks only ``READ_REPLICAS`` of them, chosen
at random, for the value (hivemind's ``get`` takes it from every node of its search), and merges
their dictionaries as ``get`` does, each record checked by this node's validators on arrival. A
node among the nearest adds its own storage. One replica that withholds records hides nothing: the
other one asked, or this node's own storage, still holds them.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from functools import partial
from typing import Dict, List, Optional, Tuple

from hivemind.dht.node import _SearchState
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import ValueWithExpiration

logger = logging.getLogger("voloco.swarm")

# Nodes asked beyond num_replicas, in the order of nearness, if some of the nearest do not answer.
SPARE_CANDIDATES = 3

# Replicas a lean read asks for the value: two, so that a replica that missed a store does not hide
# that record; one when this node is a replica itself (its own storage is the other).
READ_REPLICAS = 2

# A key's nearest nodes, once searched, are reused this long: every write and read of a busy key
# would otherwise search again (a find call to each node of the beam) for the same answer. A store
# that a cached node does not take drops the entry, so the next call searches again.
NEAREST_TTL_S = 15.0

_nearest_cache: Dict[Tuple[DHTID, DHTID, int], Tuple[float, List[PeerID]]] = {}  # (node, key, count) -> (when, nodes)


def shadow_of(key_id: DHTID) -> DHTID:
    """The id whose nearest nodes are ``key_id``'s and under which nothing is stored."""
    return DHTID(int(key_id) ^ 1)


async def _store_on(node, peer_id: PeerID, key_id: DHTID, subkey, value: bytes, expiration: float) -> bool:
    """One replica's store: True if it kept the record."""
    if peer_id == node.peer_id:
        record = DHTRecord(key_id.to_bytes(), node.protocol.serializer.dumps(subkey), value, expiration)
        validator = node.protocol.record_validator
        if validator is not None and not validator.validate(record):
            return False
        return bool(node.protocol.storage.store(key_id, value, expiration, subkey=subkey))
    answer = await node.protocol.call_store(peer_id, keys=[key_id], values=[value], expiration_time=[expiration],
                                            subkeys=[subkey])
    return bool(answer and answer[0])


async def lean_store(key: str, subkey, value, expiration: float, beam_size: Optional[int], _dht, node) -> bool:
    """In the DHT's process: store ``value`` under ``key``/``subkey`` on the key's nearest nodes (as
    many as the node's ``num_replicas``); True if at least one kept it."""
    key_id = DHTID.generate(source=key)
    wanted = node.num_replicas
    candidates = await _nearest(node, key_id, wanted + SPARE_CANDIDATES, beam_size)

    serializer = node.protocol.serializer
    value_bytes = serializer.dumps(value)
    validator = node.protocol.record_validator
    if validator is not None:
        record = DHTRecord(key_id.to_bytes(), serializer.dumps(subkey), value_bytes, expiration)
        value_bytes = validator.sign_value(record)

    stored = 0
    tried = 0
    while stored < wanted and tried < len(candidates):
        batch = candidates[tried:tried + wanted - stored]
        tried += len(batch)
        results = await asyncio.gather(*(_store_on(node, p, key_id, subkey, value_bytes, expiration) for p in batch),
                                       return_exceptions=True)
        for peer_id, ok in zip(batch, results):
            if ok is True:
                stored += 1
            else:
                logger.debug(f"storing {key!r} on {peer_id} failed: {ok!r}")
                _forget_nearest(node, key_id)
    if stored == 0:
        logger.debug(f"no node kept {key!r} ({len(candidates)} asked)")
    return stored > 0


async def _nearest(node, key_id: DHTID, count: int, beam_size: Optional[int]) -> List[PeerID]:
    """Up to ``count`` nodes nearest ``key_id`` (this node among them, unless in client mode),
    nearest first, found by a search toward its shadow (or remembered, see ``NEAREST_TTL_S``)."""
    memo = (node.node_id, key_id, count)
    cached = _nearest_cache.get(memo)
    if cached is not None and time.monotonic() - cached[0] < NEAREST_TTL_S:
        return list(cached[1])
    shadow = shadow_of(key_id)
    search = {"beam_size": max(beam_size, count)} if beam_size else {}
    found = await node.find_nearest_nodes([shadow], k_nearest=count, exclude_self=node.protocol.client_mode, **search)
    nearest = list(found.get(shadow, {}).values())
    if len(_nearest_cache) > 256:  # keys come and go (chain ids, runs): a bound, not a policy
        _nearest_cache.clear()
    _nearest_cache[memo] = (time.monotonic(), nearest)
    return list(nearest)


def _forget_nearest(node, key_id: DHTID) -> None:
    for memo in [m for m in _nearest_cache if m[:2] == (node.node_id, key_id)]:
        del _nearest_cache[memo]


async def lean_get(key: str, beam_size: Optional[int], _dht, node) -> Optional[ValueWithExpiration]:
    """In the DHT's process: ``key``'s value as ``DHTNode.get(key, latest=True)`` returns it, merged from
    ``READ_REPLICAS`` of the key's nearest nodes (and this node's storage if it is one of them)."""
    key_id = DHTID.generate(source=key)
    nearest = await _nearest(node, key_id, node.num_replicas, beam_size)
    merged = _SearchState(key_id, sufficient_expiration_time=float("inf"), serializer=node.protocol.serializer,
                          record_validator=node.protocol.record_validator)
    wanted = READ_REPLICAS
    if node.peer_id in nearest:
        nearest.remove(node.peer_id)
        merged.add_candidate(node.protocol.storage.get(key_id), node.node_id)
        wanted -= 1
    random.shuffle(nearest)  # every replica holds every store: spread the readers over them, not on the nearest
    answered = asked = 0
    while answered < wanted and asked < len(nearest):
        batch = nearest[asked:asked + wanted - answered]
        asked += len(batch)
        answers = await asyncio.gather(*(node.protocol.call_find(p, [key_id]) for p in batch), return_exceptions=True)
        for peer_id, answer in zip(batch, answers):
            if isinstance(answer, BaseException) or not answer or key_id not in answer:
                logger.debug(f"reading {key!r} from {peer_id} failed: {answer!r}")
                _forget_nearest(node, key_id)
                continue
            answered += 1
            merged.add_candidate(answer[key_id][0], None)
    merged.finish_search()
    return await merged.future


def store_lean(dht, key: str, subkey, value, expiration: float, beam_size: Optional[int] = None,
               wait: bool = False):
    """``hivemind.DHT.store``'s counterpart: the future of :func:`lean_store` (or its result, ``wait``)."""
    return dht.run_coroutine(partial(lean_store, key, subkey, value, expiration, beam_size), return_future=not wait)
