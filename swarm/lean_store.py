"""A DHT store that finds a key's nearest nodes without fetching the key's value on the way.

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
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import List, Optional

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID

logger = logging.getLogger("voloco.swarm")

# Nodes asked beyond num_replicas, in the order of nearness, if some of the nearest do not answer.
SPARE_CANDIDATES = 3


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
    shadow = shadow_of(key_id)
    wanted = node.num_replicas
    search = {"beam_size": max(beam_size, wanted + SPARE_CANDIDATES)} if beam_size else {}
    found = await node.find_nearest_nodes([shadow], k_nearest=wanted + SPARE_CANDIDATES,
                                          exclude_self=node.protocol.client_mode, **search)
    candidates: List[PeerID] = list(found.get(shadow, {}).values())

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
            if isinstance(ok, BaseException):
                logger.debug(f"storing {key!r} on {peer_id} failed: {ok!r}")
            elif ok:
                stored += 1
    if stored == 0:
        logger.debug(f"no node kept {key!r} ({len(candidates)} asked)")
    return stored > 0


def store_lean(dht, key: str, subkey, value, expiration: float, beam_size: Optional[int] = None,
               wait: bool = False):
    """``hivemind.DHT.store``'s counterpart: the future of :func:`lean_store` (or its result, ``wait``)."""
    return dht.run_coroutine(partial(lean_store, key, subkey, value, expiration, beam_size), return_future=not wait)
