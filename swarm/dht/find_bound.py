"""A DHT node's answer to a find, bounded in work and bytes whatever the request.

hivemind's ``rpc_find`` answers every key of a request, in one pass of the event loop: for each it
serializes the value it holds (a dictionary key, such as the run's progress records, whole each
time) and lists the nearest nodes it knows. Nothing bounds the keys or dedupes them, so one request
that names the progress key of a 1,000-peer run 2,000 times (44 KB) held a node's loop for 3.2 s and
built an 812 MB answer before the channel refused to send it; a request at the channel's 4 MiB
bound would exhaust any node's memory, the coordinator's included.

``bounded_rpc_find`` asks hivemind's handler only for the distinct keys, at most ``MAX_FIND_KEYS``
of them, while the values it would return stay within ``MAX_FIND_VALUE_BYTES`` (sized from storage,
before anything is serialized); the answer stays aligned with the request, as hivemind's caller
checks: a repeated key, or one past the byte bound, is answered "not found" (its asker goes on to
other nodes). A request of more keys than any honest caller sends is answered with no results, which
the caller reads as no answer. Guarded by tests/swarm/test_find_bound.py.
"""

from __future__ import annotations

import functools

import hivemind.dht.protocol as dht_protocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.proto import dht_pb2

__all__ = ["MAX_FIND_KEYS", "MAX_FIND_VALUE_BYTES", "bounded_rpc_find", "install_find_bound"]

# hivemind's traversal asks a node for the keys of one get_many (voloco reads one key a call); a
# request of more is no honest caller's
MAX_FIND_KEYS = 256
# the values one answer carries, below the DHT channel's 4 MiB bound (swarm/dht/channels.py): a
# 1,000-peer run's progress key is about 400 KB
MAX_FIND_VALUE_BYTES = 3 << 20
SUBKEY_OVERHEAD = 32  # a dictionary entry's serialized framing beyond its value and subkey, at most

_original_rpc_find = dht_protocol.DHTProtocol.rpc_find


def _held_bytes(protocol, key_id: DHTID) -> int:
    """About the bytes ``rpc_find`` would return for ``key_id`` from storage or cache (0: nothing)."""
    sizes = []
    for place in (protocol.storage, protocol.cache):
        item = place.get(key_id)
        if item is None:
            continue
        value = item.value
        if isinstance(value, DictionaryDHTValue):
            sizes.append(sum(len(v.value) + len(k if isinstance(k, (bytes, str)) else b"") + SUBKEY_OVERHEAD
                             for k, v in value.data.items()))
        else:
            sizes.append(len(value))
    return max(sizes, default=0)


@functools.wraps(_original_rpc_find)  # (hivemind registers handlers by their annotations)
async def bounded_rpc_find(self, request, context):
    """hivemind's ``rpc_find`` over the request's distinct keys within the bounds above; an answer
    aligned with the request's keys."""
    keys = list(request.keys)
    if len(keys) > MAX_FIND_KEYS:
        return dht_pb2.FindResponse(results=[], peer=self.node_info)
    asked, budget = [], MAX_FIND_VALUE_BYTES
    for key in dict.fromkeys(keys):
        try:
            size = _held_bytes(self, DHTID.from_bytes(key))
        except Exception:  # not a key id: hivemind's handler raises for it, as before
            size = 0
        if size > budget:
            continue
        budget -= size
        asked.append(key)
    if len(asked) == len(keys):
        return await _original_rpc_find(self, request, context)
    inner = dht_pb2.FindRequest(keys=asked, peer=request.peer)
    found = dict(zip(asked, (await _original_rpc_find(self, inner, context)).results))
    response = dht_pb2.FindResponse(results=[], peer=self.node_info)
    for key in keys:
        result = found.pop(key, None)  # a repeat finds its key's answer taken
        response.results.append(result if result is not None else dht_pb2.FindResult(type=dht_pb2.NOT_FOUND))
    return response


def install_find_bound() -> None:
    """Every DHTProtocol made in this process from now on (and a DHT process forked from it) answers
    finds within the bounds above."""
    dht_protocol.DHTProtocol.rpc_find = bounded_rpc_find
