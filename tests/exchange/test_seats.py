"""peer/exchange/matchmaking.py ``count_seats``: a leader's group target counts the peers its barrier
found ready; a member nobody waited for (a new identity, a peer given up on) adds a seat instead of
filling a ready peer's. Before, hivemind's leader closed the group as soon as it had as many members
as ready peers, whoever they were, and the ready peer left over gathered without it."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.mpfuture import MPFuture

from peer.exchange.gatherer import PayloadGatherer
from peer.exchange.matchmaking import count_seats, refuse_peers
from protocol.wire.signed import Signer
from tests.support.dht_nodes import loopback_gatherers

JOIN = averaging_pb2.JoinRequest(gather=b"\x93\x00\x00\xc4\x00")  # an honest-sized request


def peer_id() -> PeerID:
    return PeerID(Signer.generate().peer_id)


class FakeMatchmaking:
    """hivemind's leader as far as seats go: a join request is checked (full at its target: ``len(followers)
    + 1 >= target``), then kept among the followers; a follower may leave (its stream ended)."""

    def __init__(self, target: int):
        self.target_group_size, self.current_followers = target, {}

    def _check_reasons_to_reject(self, request, context):
        if len(self.current_followers) + 1 >= self.target_group_size:
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.GROUP_IS_FULL)
        return None

    async def _request_join_group(self, leader):
        return "group"

    def join(self, peer) -> bool:
        """A join request as hivemind's rpc_join_group makes it; True if the group is now assembled."""
        if self._check_reasons_to_reject(JOIN, SimpleNamespace(remote_id=peer)) is not None:
            raise AssertionError(f"{peer} refused")
        self.current_followers[peer] = "request"
        return len(self.current_followers) + 1 >= self.target_group_size

    def refused(self, peer) -> bool:
        return self._check_reasons_to_reject(JOIN, SimpleNamespace(remote_id=peer)) is not None


def test_a_member_nobody_awaited_adds_a_seat_up_to_the_largest_group():
    mm, ready, stranger, late = FakeMatchmaking(target=3), [peer_id(), peer_id()], peer_id(), peer_id()
    count_seats(mm, frozenset(ready), spare=0, largest=4)
    assert not mm.join(stranger) and mm.target_group_size == 4  # a seat for it: the ready peers keep theirs
    assert not mm.join(ready[0])
    assert mm.join(ready[1])  # hivemind assembles now, with every ready peer
    assert mm.refused(late) and mm.target_group_size == 4  # the largest group: full, not grown


def test_a_member_that_joined_and_left_holds_no_seat():
    mm, ready, stranger = FakeMatchmaking(target=3), [peer_id(), peer_id()], peer_id()
    count_seats(mm, frozenset(ready), spare=0, largest=4)
    assert not mm.join(stranger) and not mm.join(ready[0])
    del mm.current_followers[stranger]  # its stream ended: hivemind pops it, the target stays until the next join
    assert mm.join(ready[1]) and mm.target_group_size == 3  # closes with the ready peers, not at the matchmaking's end
    # one that joins twice (after leaving) is one seat, not two
    mm, stranger = FakeMatchmaking(target=3), peer_id()
    count_seats(mm, frozenset(ready), spare=0, largest=8)
    mm.join(stranger)
    del mm.current_followers[stranger]
    mm.join(stranger)
    assert mm.target_group_size == 4


def test_the_spare_seat_of_a_pair_and_a_new_round():
    mm, someone, other = FakeMatchmaking(target=2), peer_id(), peer_id()
    # nobody ready yet: the gather's pair is for whoever comes first (peer/round/barrier.py gather_size)
    count_seats(mm, frozenset(), spare=1, largest=4)
    assert mm.join(someone) and mm.target_group_size == 2
    # the next round sets a new target and counts again from none
    mm.current_followers, mm.target_group_size = {}, 2  # this peer and the one it found ready
    count_seats(mm, frozenset({someone}), spare=0, largest=4)
    assert not mm.join(other) and mm.target_group_size == 3 and mm.join(someone)


def test_a_refused_peer_takes_no_seat_and_adds_none():
    mm, silent = FakeMatchmaking(target=3), peer_id()
    refuse_peers(mm, frozenset({silent}))
    count_seats(mm, frozenset(), spare=0, largest=4)
    assert mm.refused(silent) and mm.target_group_size == 3


class Watched(PayloadGatherer):
    """A gatherer whose matchmaking followers a test can read (from the averager process)."""

    async def _followers(self, future: MPFuture):
        future.set_result([p.to_base58() for p in self._matchmaking.current_followers])

    def followers(self):
        future = MPFuture()
        self._outer_pipe.send(("_followers", [], dict(future=future)))
        return future.result(timeout=10)


Watched.__name__ = Watched.__qualname__ = "PayloadGatherer"  # hivemind names handlers after the class


@pytest.fixture
def swarm():
    """Three server peers and a client-mode one (it can follow, never lead), with real gatherers."""
    yield from loopback_gatherers(Watched, 3, clients=1, prefix="seats-test", schema=b"seats", min_group_size=2,
                                  max_group_size=4, matchmaking_time=15.0, gather_timeout=20.0)


def test_a_member_nobody_awaited_leaves_every_ready_peer_its_seat(swarm):
    """The client joins the first leader before the two other ready peers come: the group must still
    hold all three ready peers (it grows to 4), where the target of 3 closed it with one left out."""
    ids = [g.peer_id.to_base58() for g in swarm]
    honest, stranger = ids[:3], ids[3]

    def gather(i):
        ready = [p for p in honest if p != ids[i]] if i < 3 else None
        return swarm[i].gather(7, f"payload of member {i}".encode(), start_hash="0123456789abcdef",
                               expected_size=3 if i < 3 else 4, ready=ready, timeout=40)

    with ThreadPoolExecutor(4) as pool:
        first = [pool.submit(gather, 0), pool.submit(gather, 3)]
        deadline = time.monotonic() + 15
        while stranger not in swarm[0].followers():  # the leader has taken the stranger first
            assert time.monotonic() < deadline, "the stranger never joined the first peer's group"
            time.sleep(0.1)
        rest = [pool.submit(gather, 1), pool.submit(gather, 2)]
        results = [f.result() for f in [first[0], *rest, first[1]]]
    assert all(r is not None for r in results), f"a member found no group: {[r and r.group for r in results]}"
    assert stranger in results[0].group, [r.group for r in results]
    for r in results[:3]:
        assert set(honest) <= set(r.group), f"a ready peer was left out: {r.group} (the stranger is {stranger})"
