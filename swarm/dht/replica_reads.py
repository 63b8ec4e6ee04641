"""Reads of a DHT key that a replica of it serves from its own storage.

Progress records are read often (the round barrier, early close, the dashboard), and so are chain
candidates and assignments (the coordinator's chain former, every 2 s). A record is stored on the
num_replicas nearest nodes (in a swarm of up to 5 DHT nodes: every node), and each store reaches
their storage at once. A node whose own storage held every record of its last network read
(a lean read of the key's replicas: swarm/dht/lean_read.py), at the same version, is such a replica (so is one
whose storage and read both found the key empty): it reads its storage until REPLICA_NETWORK_READ_S
after that read, then reads over the network again and checks again. While every record its storage
holds was refreshed lately (none expires within a third of its TTL: its writer's keep-alives come every
third), and it holds as many records as that network read found (none has expired here since), its
storage still gets every store, and it keeps reading there up to REPLICA_TRUST_S after the
last network read: a network read moves every peer's record from every node of the beam, and at 10
Mbit/s these reads were half of a peer's control-plane bytes. A record near its expiry (a writer
that is late, gone, or whose stores stopped reaching this node) sends the next read to the network.
An empty storage is trusted as long by a node among the key's nearest in its routing table (a chain
key nobody has written yet, a round's matchmaking key), since any store would come to it.
Any other node (a client-mode node, which no store reaches; a node of a large swarm that is not among
the key's nearest) reads over the network.

The same holds for the keys hivemind's matchmaking declares averagers under (``LeanGroupKeyManager``):
every peer looking for a group polls its round's key, and each poll was a network read.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any, Dict, Optional, Tuple

import hivemind
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.utils import get_dht_time

from swarm.dht.lean_read import lean_get

logger = logging.getLogger("voloco.swarm")

REPLICA_NETWORK_READ_S = 5.0
REPLICA_TRUST_S = 30.0
MAX_KEYS_REMEMBERED = 256

# A read or write of a record, a matchmaking poll or declaration, visits about this many DHT nodes
# (hivemind stores a record on its 5 nearest nodes, num_replicas), not hivemind's default beam of
# bucket_size (20): every node of a default beam that had cached the key answered with all of it (at 32
# peers a read of the progress key moved 20 copies of 32 records, and polls were half a peer's finds).
NEAREST_BEAM = 5


def search_args(beam_size: Optional[int]) -> Dict[str, int]:
    """A DHT call's search arguments: ``beam_size`` if given, else hivemind's default."""
    return {"beam_size": beam_size} if beam_size else {}


# (node's peer id, key) -> when its last network read that found it a replica began, and how many
# records that read found
_confirmed: Dict[Tuple[str, str], Tuple[float, int]] = {}


def _stored_items(node, key: str) -> Dict[Any, float]:
    """subkey -> expiration of what this node's own storage holds under ``key`` (expired items dropped)."""
    stored = node.protocol.storage.get(DHTID.generate(source=key))
    if stored is None or not isinstance(stored.value, DictionaryDHTValue):
        return {}
    now = get_dht_time()
    return {subkey: item.expiration_time for subkey, item in stored.value.items() if item.expiration_time > now}


def _among_nearest(node, key: str) -> bool:
    """Whether this node is one of the ``num_replicas`` nodes nearest ``key`` that it knows of."""
    key_id = DHTID.generate(source=key)
    mine = node.node_id.xor_distance(key_id)
    nearer = [n for n, _ in node.protocol.routing_table.get_nearest_neighbors(key_id, k=node.num_replicas)
              if n.xor_distance(key_id) < mine]
    return len(nearer) < node.num_replicas


async def _replica_read(key: str, beam_size: Optional[int], since: float, ttl: float, limits: Tuple[float, float],
                        expected: int, _dht, node) -> Tuple[Any, str]:
    """In the DHT's process: (the key's value, where it came from). "storage": this node's own storage;
    "replica": the network, and the storage held all of it; "network": the network, and it did not.
    ``since``: seconds since the last network read that found this node a replica of ``key``;
    ``limits``: (REPLICA_NETWORK_READ_S, REPLICA_TRUST_S), as the caller's process has them;
    ``expected``: how many records that read found (one that has expired here since is a writer
    whose stores stopped coming: the storage is not trusted past the interval)."""
    network_s, trust_s = limits
    held = _stored_items(node, key)
    # every record refreshed lately, or none, where every store would come here
    if held:
        fresh = len(held) >= expected and min(held.values()) > get_dht_time() + ttl / 3
    else:
        fresh = expected == 0 and _among_nearest(node, key)
    if since < network_s or (since < trust_s and fresh):
        # stops at the storage, whose dictionary has not expired (an empty storage would send hivemind's get out)
        return (await node.get(key, latest=False) if held else None), "storage"
    found = await lean_get(node, key, beam_size, partial(node.get, key, latest=True, **search_args(beam_size)))
    if node.protocol.client_mode:
        replica = False
    elif found is None:
        replica = not held and _among_nearest(node, key)  # the key is empty there and here, and stores come here
    else:
        replica = isinstance(found.value, dict) and all(
            held.get(subkey, float("-inf")) >= item.expiration_time for subkey, item in found.value.items())
    return found, "replica" if replica else "network"


def _note(memo: Tuple[str, str], source: str, began: float, found: Any) -> None:
    if source == "replica":
        if len(_confirmed) >= MAX_KEYS_REMEMBERED and memo not in _confirmed:
            _confirmed.clear()  # a new matchmaking key every round: a bound, not a policy
        _confirmed[memo] = (began, len(found.value) if found is not None and isinstance(found.value, dict) else 0)
    elif source == "network":
        _confirmed.pop(memo, None)


def _call(dht: hivemind.DHT, key: str, ttl: float, beam_size: Optional[int]):
    memo = (dht.peer_id.to_base58(), key)
    at, expected = _confirmed.get(memo, (float("-inf"), 0))
    return memo, partial(_replica_read, key, beam_size, time.monotonic() - at, ttl,
                         (REPLICA_NETWORK_READ_S, REPLICA_TRUST_S), expected)


def replica_get(dht: hivemind.DHT, key: str, ttl: float, beam_size: Optional[int] = None) -> Any:
    """``dht.get(key, latest=True)``'s value, from this node's storage while it is a replica of ``key``
    (see above); ``ttl``: how long its writers' records live (``inf``: never trust past the interval)."""
    began = time.monotonic()
    memo, call = _call(dht, key, ttl, beam_size)
    try:
        found, source = dht.run_coroutine(call)
    except Exception as e:
        logger.debug(f"a read of {key!r} in the DHT's process failed ({e!r}); reading it as a client")
        return dht.get(key, latest=True, **search_args(beam_size))
    _note(memo, source, began, found)
    return found


async def replica_get_async(dht: hivemind.DHT, key: str, ttl: float, beam_size: Optional[int] = None) -> Any:
    """``replica_get`` from another process's event loop (hivemind's averager)."""
    began = time.monotonic()
    memo, call = _call(dht, key, ttl, beam_size)
    found, source = await dht.run_coroutine(call, return_future=True)
    _note(memo, source, began, found)
    return found
