"""Find the swarm again when the DHT has lost it.

hivemind's DHT drops a node from its routing table after one failed request and suspends
(blacklists) it for a time that doubles with every failure; a dropped node comes back only when
one of the two sends the other a request. A restarted coordinator (the run's join node) therefore
starts with an empty routing table, and once the peers have dropped its dead predecessor nobody
tells it about them: a peer that joins through it finds nobody and trains alone for ever
(bench/faults.py runs this case: ``late_joiner`` after ``coordinator``). ``keep_joined`` looks
at the routing table every ``CHECK_EVERY_S`` and acts only when it is empty, or holds none of the
join nodes and fewer than ``SMALL_TABLE`` nodes (a large swarm's tables need not hold the
coordinator, and pinging it from every peer would cost it N pings a period). A node on hivemind's
blacklist does not count: this node's lookups skip it, and after a link was down every node of a
table may be suspended for minutes, its reads answered from its own storage alone. It then pings the
join addresses (and, with an empty table, the nodes it knew); a node that answers goes back into the
table (and this node into its), the suspensions made while this node was cut off are lifted, and a
lookup of this node's own id from the nodes that answered fills the table again. Otherwise it costs
one look at a local table. tests/swarm/test_dht_rejoin.py checks both on real DHT nodes (a table whose
every node is suspended, an empty table filled again).

A table can also look whole while the join node has forgotten this node: a coordinator SIGKILLed and
restarted within a round or two, before any request to it failed, keeps its peer id in every peer's
table, starts with an empty table of its own, and nobody tells it about the swarm: a newcomer that
joins through it finds only the coordinator and trains alone. So every node also pings its join
nodes every ``JOIN_REFRESH_S`` (its first at a random point of the period, so that a swarm's pings
spread out): a ping puts the asker in the join node's table, which is all a newcomer's lookup
through it needs. At N peers that is N / ``JOIN_REFRESH_S`` pings a second at the coordinator
(tests/swarm/test_dht_rejoin.py: ``test_a_restarted_join_node_learns_the_swarm_and_a_newcomer_finds_it``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import threading
import time
from typing import Collection, Dict, Optional, Sequence, Set

from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID
from multiaddr import Multiaddr

logger = logging.getLogger("voloco.swarm")

CHECK_EVERY_S = 5.0
CONNECT_TIMEOUT_S = 10.0  # a dial to a join node that hangs (a link down, a black-holed route) is given up
CHECK_TIMEOUT_S = 60.0  # a check the DHT has not answered by then is abandoned and tried again
LOST_LOG_EVERY_S = 60.0  # a node that cannot find the swarm again says so this often
SMALL_TABLE = 5  # a table this small without a join node: this node may be in a swarm of its own
KNOWN_MAX = 64  # nodes remembered to ask again once the table is empty

JOIN_REFRESH_S = 30.0

_KNOWN: Set[PeerID] = set()  # in the DHT's process: the nodes its routing table held


def refresh_due(now: float, period: float, schedule: Dict[str, float]) -> bool:
    """Whether the periodic ping of the join nodes is due at ``now`` (``schedule`` holds the next
    time; the first is drawn at random within one period)."""
    if "next" not in schedule:
        schedule["next"] = now + random.uniform(0.0, period)
    if now < schedule["next"]:
        return False
    schedule["next"] = now + period
    return True


def needs_rejoin(present: Collection[PeerID], joins: Collection[PeerID]) -> bool:
    """Whether a routing table holding ``present`` has lost the swarm that ``joins`` lead to."""
    return not present or (not set(joins) & set(present) and len(present) < SMALL_TABLE)


async def check(_dht, node, joins: Sequence[str], refresh_joins: bool = False) -> int:
    """In the DHT's process: ping the join nodes (and, with an empty table, the nodes known before)
    if the routing table needs it, and the join nodes anyway with ``refresh_joins``; how many answered
    (-1: the table needed no one)."""
    table = set(node.protocol.routing_table.uid_to_peer_id.values())
    if len(_KNOWN) < KNOWN_MAX:
        _KNOWN.update(list(table)[: KNOWN_MAX - len(_KNOWN)])
    # a suspended node is not asked by this node's lookups: a table of suspended nodes reads nobody
    present = {p for p in table if p not in node.blacklist}
    addrs: Dict[PeerID, Multiaddr] = {PeerID.from_base58(Multiaddr(m).value_for_protocol("p2p")): Multiaddr(m)
                                      for m in joins}
    if not needs_rejoin(present, addrs):
        if refresh_joins:  # the table looks whole; make sure the join nodes still know this node
            for peer in addrs:
                if await node.protocol.call_ping(peer, validate=False) is not None:
                    _lift_suspension(node, peer)
        return -1
    ask = [p for p in addrs if p not in present] + ([p for p in _KNOWN if p not in addrs] if not present else [])
    if not ask:  # a join node itself with a small table (the coordinator): nobody to ask, nothing lost
        return -1
    answered: Dict[DHTID, PeerID] = {}
    for peer in ask:
        if peer in addrs:  # the daemon may have forgotten the address of a node it lost; hivemind has no
            try:  # public call for this (P2P keeps its daemon client private)
                await asyncio.wait_for(node.protocol.p2p._client.connect(peer, [addrs[peer].decapsulate("p2p")]),
                                       CONNECT_TIMEOUT_S)
            except Exception as e:
                logger.debug(f"rejoin: cannot connect to {peer}: {e!r}")
        node_id = await node.protocol.call_ping(peer, validate=False)  # puts it in our table, and us in its
        if node_id is not None:
            answered[node_id] = peer
    if answered:  # the suspensions made while this node was cut off say nothing of the nodes suspended:
        node.blacklist.clear()  # kept, the lookup below would leave them out
        # the lookup starts from the nodes that answered: hivemind adds them to the table in tasks of their
        # own, and a lookup from the table alone found nobody ("1 in the routing table" after a link was down)
        found = await node.find_nearest_nodes([node.node_id], node_to_peer_id=dict(answered))
        reached = {p for nearest in found.values() for p in nearest.values()} - {node.peer_id}
        logger.info(f"found the swarm again: {len(answered)} node(s) answered, {len(reached)} found through them")
    return len(answered)


def _lift_suspension(node, peer: PeerID) -> None:
    """A node that answered comes off the blacklist, its back-off reset (hivemind does the same when a
    lookup's request succeeds; a ping's success does not)."""
    try:
        node.blacklist.register_success(peer)
    except KeyError:  # it was not on it
        pass


class LostSwarm:
    """Says in the log, at most once a ``LOST_LOG_EVERY_S``, that this node keeps failing to find the
    swarm again. ``note`` takes a check's result: -1 none needed, 0 nobody answered, n > 0 found."""

    def __init__(self, clock=time.monotonic):
        self.clock, self.since, self.logged = clock, None, None

    def note(self, answered: int) -> None:
        now = self.clock()
        if answered != 0:
            self.since = self.logged = None
            return
        if self.since is None:
            self.since = now
        due = self.logged is None or now - self.logged >= LOST_LOG_EVERY_S
        if due and now - self.since >= LOST_LOG_EVERY_S / 4:  # a miss or two is a moment, not a lost swarm
            self.logged = now
            logger.warning(f"this peer has lost the swarm for {now - self.since:.0f} s: neither the join nodes nor "
                           f"the nodes it knew answer; still trying (is its network link up?)")


def keep_joined(dht, initial_peers: Sequence[Multiaddr], every: Optional[float] = None,
                refresh: Optional[float] = None) -> threading.Thread:
    """A daemon thread that reconnects ``dht`` to the swarm whenever ``needs_rejoin`` says so (a look
    every ``every`` s, default ``CHECK_EVERY_S``), and pings the join nodes every ``refresh`` s
    (default ``JOIN_REFRESH_S``)."""
    every = CHECK_EVERY_S if every is None else every
    refresh = JOIN_REFRESH_S if refresh is None else refresh
    joins = [str(m) for m in initial_peers]

    def loop() -> None:
        stop = threading.Event()
        schedule: Dict[str, float] = {}
        lost = LostSwarm()
        while not stop.wait(every):
            if not dht.is_alive():
                return
            due = bool(joins) and refresh_due(time.monotonic(), refresh, schedule)
            future = None
            try:
                future = dht.run_coroutine(functools.partial(check, joins=joins, refresh_joins=due), return_future=True)
                lost.note(future.result(timeout=CHECK_TIMEOUT_S))
            except BaseException as e:  # a DHT shutting down (a cancelled future), a failed ping, or a check
                logger.debug(f"rejoin: {e!r}")  # that hangs (abandoned, not this thread's end): try again later
                if future is not None and not future.done():
                    future.cancel()
                if not dht.is_alive():
                    return

    thread = threading.Thread(target=loop, daemon=True, name="dht-rejoin")
    thread.start()
    return thread
