"""A follower that misses the message naming its group still gathers in it (peer/exchange/late_join.py).

Three real gatherers on loopback. Each drops the first BEGIN_ALLREDUCE it receives, as a follower
does whose wait for it ran out on a loaded host: hivemind's matchmaking then goes on looking while
its leader has already assembled the group with it. Every member must still end the round in one
group holding every member's payload (before peer/exchange/late_join.py, the leader excluded the followers
after a gather slot and they gathered apart). A member asking about made-up group ids uses up only
its own share of the round's lookups."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from peer.exchange import late_join
from peer.exchange.gatherer import PayloadGatherer
from tests.support.dht_nodes import loopback_gatherers


class MissesItsGroup(PayloadGatherer):
    """Drops the first group its leader names to it, as if the message came after its wait."""

    async def _prepare_round(self, *args, **kwargs):
        mm = self._matchmaking
        if not getattr(mm, "_missed", None):
            mm._missed = []
            assemble = mm.follower_assemble_group

            async def late(leader, msg):
                if not mm._missed:
                    mm._missed.append(msg.group_id)
                    raise asyncio.TimeoutError()  # hivemind's follower gives the leader up here
                return await assemble(leader, msg)

            mm.follower_assemble_group = late
        return await super()._prepare_round(*args, **kwargs)


MissesItsGroup.__name__ = MissesItsGroup.__qualname__ = "PayloadGatherer"  # hivemind names handlers after the class


@pytest.fixture
def gatherers():
    yield from loopback_gatherers(MissesItsGroup, 3, prefix="late-join-test", schema=b"late-join", min_group_size=2,
                                  max_group_size=3, matchmaking_time=3.0, gather_timeout=20.0)


def test_a_follower_that_missed_its_group_gathers_in_it(gatherers):
    def gather(i):
        g = gatherers[i]
        return g.gather(7, f"payload of member {i}".encode(), start_hash="0123456789abcdef", expected_size=3, timeout=60)

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(gather, range(3)))
    assert all(r is not None for r in results), "a member found no group"
    assert {len(r.payloads) for r in results} == {3}, [sorted(r.excluded.values()) for r in results]
    assert len({r.set_digest for r in results}) == 1


class _LookupHost(late_join.LateJoin):
    """Only the lookups' bookkeeping: a lookup started does nothing."""

    async def _join_late(self, group_id):
        return None


def _lookups() -> _LookupHost:
    host = _LookupHost()
    host._asked_leaders, host._late_joins, host._late_join_callers = [], {}, {}
    return host


def test_a_member_asking_about_made_up_groups_uses_up_its_own_share_not_the_rounds():
    async def run():
        host = _lookups()
        liar, honest = b"liar", b"honest"
        started = [host._start_late_join(bytes([i]) * 8, liar) for i in range(late_join.MAX_LEADERS)]
        assert started == [True] * late_join.JOINS_PER_CALLER + [False] * (late_join.MAX_LEADERS - late_join.JOINS_PER_CALLER)
        assert host._start_late_join(b"real-grp", honest)  # the round's lookups are not used up
        assert not host._start_late_join(b"real-grp", honest)  # once per group id
        await asyncio.gather(*host._late_joins.values())

    asyncio.run(run())


def test_a_member_gathering_elsewhere_is_refused_at_once():
    """A peer asked about a group it is not in waits for that group only until a group of its own
    for the round opens; then it refuses (GROUP_DISBANDED), so the asking group stops waiting for it.
    In a 32-peer run a peer named by two leaders held one group a gather slot and a half, and every
    peer's merge with it (bench/RESULTS.md, 2026-12-01, fifty-second session)."""
    from types import SimpleNamespace

    from hivemind.proto import averaging_pb2

    from peer.exchange import late_join

    class Host(late_join.LateJoin):
        _member_group = PayloadGatherer._member_group
        _refusal = PayloadGatherer._refusal

        async def _join_late(self, group_id):
            await asyncio.sleep(3600)  # the leaders asked never answer

    async def run():
        host = Host()
        host._asked_leaders, host._late_joins, host._late_join_callers = [], {}, {}
        host._groups, host._group_opened, host._round_no, host.gather_timeout = {}, None, 7, 30.0
        loop = asyncio.get_running_loop()
        began = loop.time()
        asked = asyncio.ensure_future(host._member_group(b"their-group", b"caller"))
        await asyncio.sleep(0.2)
        assert not asked.done()  # the group may still be ours: wait for it
        host._groups[b"our-group"] = SimpleNamespace(round_no=7, members=frozenset())
        host._group_opened.set()
        assert await asyncio.wait_for(asked, timeout=5) is None
        assert loop.time() - began < 5
        assert host._refusal(b"their-group") == averaging_pb2.GROUP_DISBANDED
        # and at once once ours is open
        assert await asyncio.wait_for(host._member_group(b"another-group", b"caller"), timeout=1) is None
        for task in host._late_joins.values():
            task.cancel()

    asyncio.run(run())


def test_strangers_share_one_small_budget_of_lookups_and_leave_the_round_its_own():
    """Eight new identities asking about two made-up groups each spent the round's 16 lookups, and a
    member we know that missed its group message could not be pulled in."""
    from hivemind.p2p import PeerID

    from protocol.wire.signed import Signer

    async def run():
        host = _lookups()
        mate = PeerID(Signer.generate().peer_id)
        host._known = frozenset({mate.to_base58()})
        strangers = [PeerID(Signer.generate().peer_id) for _ in range(8)]
        started = [host._start_late_join(bytes([i, j]) * 4, s) for i, s in enumerate(strangers) for j in range(2)]
        assert sum(started) == late_join.STRANGER_JOINS
        assert host._start_late_join(b"real-grp", mate) and host._start_late_join(b"real-gr2", mate)
        assert not host._start_late_join(b"real-gr3", mate)  # a known caller's own share is still 2
        await asyncio.gather(*host._late_joins.values())

    asyncio.run(run())
