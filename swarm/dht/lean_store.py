"""DHT stores that find a key's nearest nodes without fetching the key's value on the way.

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

Reads of the nearest nodes found here are swarm/dht/lean_read.py's, from as many replicas as a store
reaches (each sends what the others did not): a first version here read from 2 replicas only, and its readers' views lagged the swarm's (a newcomer in
Docker refused every honest peer's state and trained alone), so it was taken out (bench/RESULTS.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial
from typing import Dict, List, Optional, Tuple

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID

logger = logging.getLogger("voloco.swarm")

# Nodes asked beyond num_replicas, in the order of nearness, if some of the nearest do not answer.
SPARE_CANDIDATES = 3

# A key's nearest nodes, once searched, are reused this long: every write and read of a busy key
# would otherwise search again (a find call to each node of the beam) for the same answer. A store
# that a cached node does not take drops the entry, and so does any change to the nodes this node
# knows (a newcomer may be nearer than the nodes remembered), so the next call searches again.
NEAREST_TTL_S = 15.0

# (node, key, count) -> (when, the nodes this node knew then, the nearest nodes)
_nearest_cache: Dict[Tuple[DHTID, DHTID, int], Tuple[float, int, List[PeerID]]] = {}


def _known(node) -> int:
    """A fingerprint of the nodes in this node's routing table: it changes when one joins or leaves it."""
    return hash(frozenset(node.protocol.routing_table.uid_to_peer_id))


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
    candidates = await nearest_nodes(node, key_id, wanted + SPARE_CANDIDATES, beam_size)

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
                forget_nearest(node, key_id)
    if stored == 0:
        logger.debug(f"no node kept {key!r} ({len(candidates)} asked)")
    return stored > 0


async def nearest_nodes(node, key_id: DHTID, count: int, beam_size: Optional[int]) -> List[PeerID]:
    """Up to ``count`` nodes nearest ``key_id`` (this node among them, unless in client mode),
    nearest first, found by a search toward its shadow (or remembered, see ``NEAREST_TTL_S``)."""
    memo = (node.node_id, key_id, count)
    cached, known = _nearest_cache.get(memo), _known(node)
    if cached is not None and time.monotonic() - cached[0] < NEAREST_TTL_S and cached[1] == known:
        return list(cached[2])
    shadow = shadow_of(key_id)
    search = {"beam_size": max(beam_size, count)} if beam_size else {}
    found = await node.find_nearest_nodes([shadow], k_nearest=count, exclude_self=node.protocol.client_mode, **search)
    nearest = list(found.get(shadow, {}).values())
    if len(_nearest_cache) > 256:  # keys come and go (chain ids, runs): a bound, not a policy
        _nearest_cache.clear()
    _nearest_cache[memo] = (time.monotonic(), known, nearest)
    return list(nearest)


def forget_nearest(node, key_id: DHTID) -> None:
    for memo in [m for m in _nearest_cache if m[:2] == (node.node_id, key_id)]:
        del _nearest_cache[memo]


def store_lean(dht, key: str, subkey, value, expiration: float, beam_size: Optional[int] = None,
               wait: bool = False):
    """``hivemind.DHT.store``'s counterpart: the future of :func:`lean_store` (or its result, ``wait``)."""
    return dht.run_coroutine(partial(lean_store, key, subkey, value, expiration, beam_size), return_future=not wait)
