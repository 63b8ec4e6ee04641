"""A record stored on the nodes that hold its key, found once and remembered, not searched for at
every write.

hivemind's ``DHTNode.store`` first searches the DHT for the key's ``num_replicas`` nearest nodes,
and every node that search asks answers with its whole value under the key: for the progress key,
every peer's record (about 1.1 KB each, signed). A peer rewrites its record at every state change
and every keep-alive period, so in a 10 Mbit/s run of 4 peers (bench/wan.py) those searches were
about two thirds of all the DHT's bytes. The nearest nodes of a key change only when nodes join or
leave, so ``store_on_replicas`` searches for them (hivemind's ``find_nearest_nodes``) at most every
``REPLICAS_FRESH_S``, and in between stores straight on the ones it found (``DHTProtocol.call_store``),
signed by the node's record validator as hivemind's store signs it. A replica that does not answer,
or refuses the record, is forgotten, and the next nearest found takes its place; once fewer than
``num_replicas`` are left, the next write searches again within ``_SMALL_FRESH_S``.

A node that joins near the key meanwhile gets the record at the next search; until then its own
storage lacks records and swarm/records.py's replica check has it read over the network.
"""

from __future__ import annotations

import asyncio
import time
from typing import Dict, List, Optional, Tuple

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID

SPARE = 2  # nearest nodes found beyond num_replicas, stored on in order when a nearer one fails
REPLICAS_FRESH_S = 30.0  # how long a search's nearest nodes are used before the next write searches again
_SMALL_FRESH_S = 5.0  # ... when it found fewer than num_replicas: the swarm is small, and a joiner is one of them

# (this node's id, key) -> (when found, the key's nearest nodes, nearest first); in the DHT's process
_replicas: Dict[Tuple[bytes, bytes], Tuple[float, List[Tuple[DHTID, Optional[PeerID]]]]] = {}


async def _nearest(node, key_id: DHTID, beam_size: Optional[int]) -> List[Tuple[DHTID, Optional[PeerID]]]:
    """The key's nearest nodes, this one included (as hivemind's store includes it; its peer id is
    None), nearest first: ``num_replicas`` of them and ``SPARE`` more, for replicas that do not answer."""
    found = await node.find_nearest_nodes([key_id], k_nearest=node.num_replicas + SPARE, beam_size=beam_size,
                                          exclude_self=True)
    candidates = [(nid, pid) for nid, pid in found.get(key_id, {}).items()] + [(node.node_id, None)]
    candidates.sort(key=lambda c: key_id.xor_distance(c[0]))
    return candidates[: node.num_replicas + SPARE]


async def store_on_replicas(_dht, node, key: str, subkey, value, expiration: float,
                            beam_size: Optional[int] = None) -> bool:
    """In the DHT's process: store ``value`` under ``key``/``subkey`` on the key's ``num_replicas``
    nearest nodes that take it, as ``DHTNode.store`` would; True if at least one of them stored it."""
    key_id = DHTID.generate(source=key)
    memo = (node.node_id.to_bytes(), key_id.to_bytes())
    now = time.monotonic()
    cached = _replicas.get(memo)
    if cached is not None:
        fresh = REPLICAS_FRESH_S if len(cached[1]) >= node.num_replicas else _SMALL_FRESH_S
        if now - cached[0] > fresh:
            cached = None
    if cached is None:
        cached = (now, await _nearest(node, key_id, beam_size))

    protocol = node.protocol
    record = DHTRecord(key_id.to_bytes(), protocol.serializer.dumps(subkey), protocol.serializer.dumps(value), expiration)
    if protocol.record_validator is not None:
        record = DHTRecord(record.key, record.subkey, protocol.record_validator.sign_value(record), expiration)

    async def one(peer_id: Optional[PeerID]) -> bool:
        if peer_id is None:  # this node itself
            if protocol.record_validator is not None and not protocol.record_validator.validate(record):
                return False
            return bool(protocol.storage.store(key_id, record.value, expiration, subkey=subkey))
        done = await protocol.call_store(peer_id, keys=[key_id], values=[record.value], expiration_time=[expiration],
                                         subkeys=[subkey])
        return bool(done and done[0])

    stored, failed, untried = 0, set(), list(cached[1])
    while stored < node.num_replicas and untried:  # the nearest first; a failure's place goes to the next
        batch, untried = untried[: node.num_replicas - stored], untried[node.num_replicas - stored:]
        results = await asyncio.gather(*(one(pid) for _, pid in batch), return_exceptions=True)
        stored += sum(r is True for r in results)
        failed.update(nid for (nid, _), r in zip(batch, results) if r is not True)
    # a replica that did not answer or refused is dropped; fewer than num_replicas left: a search soon
    _replicas[memo] = (cached[0], [c for c in cached[1] if c[0] not in failed])
    return stored > 0
