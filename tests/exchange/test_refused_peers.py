"""peer/exchange/matchmaking.py ``refuse_peers``: a matchmaking neither accepts nor follows the peers
this peer refuses (members that joined its groups and sent nothing), and asks hivemind's own checks
for everyone else. The swarm-level behaviour is tests/system/test_silent_member.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2

from peer.exchange import matchmaking
from peer.exchange.matchmaking import as_peer_ids, refuse_peers
from protocol.wire.signed import Signer

JOIN = averaging_pb2.JoinRequest(gather=b"\x93\x00\x00\xc4\x00")  # an honest-sized request


def peer_id() -> PeerID:
    return PeerID(Signer.generate().peer_id)


class FakeMatchmaking:
    """The two methods of hivemind's Matchmaking that refuse_peers wraps, recording their calls."""

    def __init__(self):
        self.checked, self.joined = [], []

    def _check_reasons_to_reject(self, request, context):
        self.checked.append(context.remote_id)
        return None  # hivemind accepts

    async def _request_join_group(self, leader):
        self.joined.append(leader)
        return "group"


def test_a_refused_peer_is_neither_accepted_nor_followed_and_the_set_is_replaced_each_round():
    mm, silent, honest = FakeMatchmaking(), peer_id(), peer_id()
    refuse_peers(mm, frozenset({silent}))
    answer = mm._check_reasons_to_reject(JOIN, SimpleNamespace(remote_id=silent))
    assert answer.code == averaging_pb2.NOT_LOOKING_FOR_GROUP and mm.checked == []
    assert mm._check_reasons_to_reject(JOIN, SimpleNamespace(remote_id=honest)) is None and mm.checked == [honest]
    assert asyncio.run(mm._request_join_group(silent)) is None and mm.joined == []
    assert asyncio.run(mm._request_join_group(honest)) == "group" and mm.joined == [honest]

    # the next round refuses nobody: installed once, the wrappers read the new set
    refuse_peers(mm, frozenset())
    assert mm._check_reasons_to_reject(JOIN, SimpleNamespace(remote_id=silent)) is None
    assert asyncio.run(mm._request_join_group(silent)) == "group"


def test_with_an_admitted_list_only_its_peers_are_accepted_or_followed():
    # while new identities cost our groups too much (peer/round/no_show_views.py ``admitted``)
    mm, known, stranger = FakeMatchmaking(), peer_id(), peer_id()
    refuse_peers(mm, frozenset(), frozenset({known}))
    assert mm._check_reasons_to_reject(JOIN, SimpleNamespace(remote_id=stranger)).code == averaging_pb2.NOT_LOOKING_FOR_GROUP
    assert asyncio.run(mm._request_join_group(stranger)) is None
    assert mm._check_reasons_to_reject(JOIN, SimpleNamespace(remote_id=known)) is None
    assert asyncio.run(mm._request_join_group(known)) == "group"
    refuse_peers(mm, frozenset({known}), frozenset({known}))  # refused wins over admitted
    assert asyncio.run(mm._request_join_group(known)) is None
    refuse_peers(mm, frozenset())  # the next round admits anyone again
    assert asyncio.run(mm._request_join_group(stranger)) == "group" and mm.joined == [known, stranger]


def test_names_that_are_no_peer_ids_are_skipped():
    known = peer_id()
    assert as_peer_ids([known.to_base58(), "chain:stage-1", ""]) == [known]


def test_a_leader_outside_the_leaders_is_passed_over_for_a_while_but_always_accepted_as_a_follower(monkeypatch):
    mm, known, stranger, now = FakeMatchmaking(), peer_id(), peer_id(), [100.0]
    monkeypatch.setattr(matchmaking, "time", SimpleNamespace(monotonic=lambda: now[0]))
    refuse_peers(mm, frozenset(), None, frozenset({known}), leaders_for=3.0)
    assert asyncio.run(mm._request_join_group(stranger)) is None
    assert asyncio.run(mm._request_join_group(known)) == "group" and mm.joined == [known]
    assert mm._check_reasons_to_reject(JOIN, SimpleNamespace(remote_id=stranger)) is None
    now[0] += 3.5  # its first matchmaking time over: a newcomer left over pairs with whoever leads
    assert asyncio.run(mm._request_join_group(stranger)) == "group"
    refuse_peers(mm, frozenset())
    assert asyncio.run(mm._request_join_group(stranger)) == "group"


def test_a_join_request_with_oversized_matchmaking_data_is_refused_before_hivemind_relays_it():
    """A leader relays every follower's matchmaking data to every member, who each decode it: a
    request past ``MAX_GATHER_BYTES`` is a protocol violation (an honest one is under 5 KB)."""
    from protocol.round.reconcile import MAX_GATHER_BYTES, MAX_LAST_SETS, announcement
    mm, joiner = FakeMatchmaking(), peer_id()
    refuse_peers(mm, frozenset())
    big = averaging_pb2.JoinRequest(gather=b"x" * (MAX_GATHER_BYTES + 1))
    assert mm._check_reasons_to_reject(big, SimpleNamespace(remote_id=joiner)).code == averaging_pb2.PROTOCOL_VIOLATION
    assert mm.checked == []
    import msgpack
    names = [f"{i:064x}" for i in range(MAX_LAST_SETS)]
    honest = msgpack.packb([1e9, 0, msgpack.packb(announcement(7, "a" * 64, "b" * 64, names, part=(0, 4), lineage="c" * 64))])
    assert len(honest) < MAX_GATHER_BYTES // 3
    assert mm._check_reasons_to_reject(averaging_pb2.JoinRequest(gather=honest), SimpleNamespace(remote_id=joiner)) is None
    assert mm.checked == [joiner]
