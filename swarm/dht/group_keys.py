"""hivemind's matchmaking keys, declared and polled at a fraction of the bytes.

hivemind's ``Matchmaking`` finds a group through a DHT key per round (``<prefix>.0b<bits>``): every
peer looking for a group declares itself under it (a subkey per peer, expiring when its search
window ends) and polls it for leaders to join. Through hivemind's ``DHT.store`` and ``DHT.get``
every declaration first fetched the key's value from every node of its search, and every poll read
it from every node of the beam: at 10 Mbit/s a third of a peer's control-plane bytes.

``LeanGroupKeyManager`` keeps hivemind's ``GroupKeyManager`` (the keys, the group bits, how a key
moves on after a group) and changes only how the two calls reach the DHT:

- ``declare_averager`` is a lean store (swarm/dht/lean_store.py): the search toward the key's shadow
  carries node lists, not every declaration;
- ``get_averagers`` is a replica read (swarm/dht/replica_reads.py): a node among the key's nearest,
  which every declaration reaches at once, reads its own storage, and the network at most every
  ``REPLICA_NETWORK_READ_S`` to check that it still is one. Declarations live only for a search
  window, so a replica's storage is never trusted past that interval (no TTL is given).

A storage read returns at once where a network read took a round trip per hop, and hivemind polls
again whenever its leader queue runs dry: polls of one key are spaced ``MIN_POLL_S`` apart, or a
peer waiting for others would spin.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import List, Tuple

import numpy as np
from hivemind.averaging.key_manager import GroupKey, GroupKeyManager, is_valid_group
from hivemind.p2p import PeerID
from hivemind.utils import DHTExpiration, get_dht_time, get_logger

from swarm.dht.lean_store import lean_store
from swarm.dht.replica_reads import NEAREST_BEAM, replica_get_async

logger = get_logger(__name__)

MIN_POLL_S = 0.1


class LeanGroupKeyManager(GroupKeyManager):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._last_poll = float("-inf")

    @classmethod
    def replacing(cls, old: GroupKeyManager) -> "LeanGroupKeyManager":
        """The lean manager of ``old``'s DHT, prefix, group bits and group size."""
        return cls(old.dht, old.prefix, old.group_bits, old.target_group_size)

    async def declare_averager(self, group_key: GroupKey, peer_id: PeerID, expiration_time: float,
                               looking_for_group: bool = True) -> bool:
        # as hivemind's: leaving re-declares with the same expiration, a hair later, so it replaces the entry
        if not looking_for_group:
            expiration_time = float(np.nextafter(expiration_time, float("inf")))
            if expiration_time <= get_dht_time():  # every node refuses an expired record: the store is bytes for nothing
                return False
        store = partial(lean_store, group_key, peer_id.to_bytes(), looking_for_group, expiration_time, NEAREST_BEAM)
        return bool(await self.dht.run_coroutine(store, return_future=True))

    async def get_averagers(self, group_key: GroupKey, only_active: bool) -> List[Tuple[PeerID, DHTExpiration]]:
        assert is_valid_group(group_key), f"group key {group_key} is invalid"
        wait = self._last_poll + MIN_POLL_S - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        self._last_poll = time.monotonic()
        result = await replica_get_async(self.dht, group_key, ttl=float("inf"), beam_size=NEAREST_BEAM)
        if result is None or not isinstance(result.value, dict):
            return []
        averagers = []
        for key, entry in result.value.items():
            if only_active and not entry.value:
                continue
            try:
                averagers.append((PeerID(key), entry.expiration_time))
            except Exception as e:  # a subkey no averager wrote: skipped, as hivemind does
                logger.debug(f"skipping a malformed declaration under {group_key}: {key!r} ({e!r})")
        return averagers
