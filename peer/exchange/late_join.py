"""A member that missed the message naming its group joins that group's gather anyway.

hivemind's matchmaking tells a follower its group in two messages on one stream: ACCEPTED, then,
when the leader assembles the group, BEGIN_ALLREDUCE with the members. A follower waits for each
only ``request_timeout`` (plus the leader's expiration, for the second), then closes the stream and
looks for another leader. On a loaded host the leader can assemble the group before it has seen that
close: the group names the follower, the others gather with it, and the follower, still looking,
never opens the group. Its payload is then lost for the round (the others wait a gather slot for it,
then exclude it) and it takes their set afterwards.

This mixin of peer/exchange/gatherer.py's ``PayloadGatherer`` closes that gap at the gather:

- every leader this peer asked to join in the current round is remembered (``_note_leader``);
- a member's request for a group this peer does not know (``_member_group``) makes it ask those
  leaders for that group (``rpc_group_of``, answered only to a member of the group, only from the
  groups the answering peer gathers in). A group that names this peer with the very matchmaking data
  it sent for this round is handed to its matchmaking as if BEGIN_ALLREDUCE had arrived, and the
  gather goes on as for any follower;
- a peer already gathering in another group of the round asks nobody and answers ``GROUP_DISBANDED``
  as soon as its own group is open: the group stops asking it (its payload reaches the round through
  the other group's set). Held until the wait for the group was over, the question cost the asking
  group a gather slot and a half at 32 peers on one host, and every peer's merge waited for that group.

Guarded by tests/exchange/test_late_join.py.
"""

from __future__ import annotations

import asyncio
from typing import Dict, List, Optional

from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_logger

logger = get_logger(__name__)

MAX_LEADERS = 16  # leaders asked in one round that are remembered (bounded whatever the DHT offers)
JOINS_PER_CALLER = 2  # unknown groups one caller can have us look up per round (fake ids cost it, not others)
STRANGER_JOINS = 2  # ... and all callers that are strangers to us together (new identities cost nothing)
ASK_TRIES = 3  # passes over those leaders before giving the group up (a leader opens it just after assembly)


def _name(peer) -> str:
    """A caller's base58 name (``_known`` holds names), whatever form it comes in."""
    return peer.to_base58() if isinstance(peer, PeerID) else str(peer)


class LateJoin:
    """Needs of its host class: ``_groups`` (group id -> group with ``members``, ``info`` and
    ``round_no``), ``_matchmaking``, ``_p2p``, ``prefix``, ``peer_id``, ``_round_no``,
    ``_max_group_size``, ``_calls``, ``gather_timeout``, ``timing``, ``get_stub`` and ``_known`` (the
    peers, base58, no strangers to us this round; None: nobody is one)."""

    def _begin_round_search(self, mm) -> None:
        """Called as a round's matchmaking is prepared: forget the leaders of earlier rounds and
        remember every leader this round's matchmaking asks (hivemind's ``_request_join_group``, a
        suggested leader's recursion included)."""
        self._asked_leaders: List[PeerID] = []
        self._late_joins = {}
        self._late_join_callers: Dict[Optional[PeerID], int] = {}  # None: the strangers' share
        if getattr(mm, "_voloco_noting", None) is not mm:
            ask = mm._request_join_group

            async def noting(leader: PeerID, _ask=ask):
                self._note_leader(leader)
                return await _ask(leader)

            mm._request_join_group = noting
            mm._voloco_noting = mm

    def _note_leader(self, leader: PeerID) -> None:
        leaders = getattr(self, "_asked_leaders", None)
        if leaders is not None and leader not in leaders and len(leaders) < MAX_LEADERS:
            leaders.append(leader)

    def _gathers_elsewhere(self, group_id: bytes) -> bool:
        """Whether this peer already gathers the current round in a group other than ``group_id``."""
        return any(g.round_no == self._round_no and gid != group_id for gid, g in self._groups.items())

    def _start_late_join(self, group_id: bytes, caller: Optional[PeerID] = None) -> bool:
        """Ask this round's leaders for ``group_id``, once per group id (a task of its own), at most
        ``MAX_LEADERS`` group ids a round and ``JOINS_PER_CALLER`` of them for one ``caller``: a
        member asking about made-up group ids uses up its own share, not the round's; callers that
        are strangers to us (outside ``_known``) share ``STRANGER_JOINS``, or eight new identities
        would use up the round's. Whether a lookup started (tests/exchange/test_late_join.py)."""
        joins = getattr(self, "_late_joins", None)
        callers = getattr(self, "_late_join_callers", None)
        if joins is None or group_id in joins or len(joins) >= MAX_LEADERS:
            return False
        if caller is not None and callers is not None:
            known = getattr(self, "_known", None)  # None: nobody is a stranger yet
            share, most = (caller, JOINS_PER_CALLER) if known is None or _name(caller) in known else (None, STRANGER_JOINS)
            if callers.get(share, 0) >= most:
                return False
            callers[share] = callers.get(share, 0) + 1
        joins[group_id] = asyncio.ensure_future(self._join_late(group_id))
        return True

    async def _join_late(self, group_id: bytes) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.gather_timeout
        for _ in range(ASK_TRIES):
            # every leader at once, the first answer naming us taken: one that never answers does not hold
            # up the one that assembled the group (the others fetch our payload meanwhile and wait for it
            # only a grace after theirs came: protocol/round/fetch_clock.py)
            async def ask(leader: PeerID):
                return leader, await self._ask_group(leader, group_id, max(0.1, deadline - loop.time()))

            asks = [asyncio.ensure_future(ask(leader)) for leader in self._asked_leaders]
            try:
                for answer in asyncio.as_completed(asks):
                    leader, info = await answer
                    if info is not None and await self._adopt(info, leader):
                        return
            finally:
                for pending in asks:
                    pending.cancel()
            if group_id in self._groups or loop.time() >= deadline:
                return
            await asyncio.sleep(min(self.timing.late_join_pause_s, max(0.0, deadline - loop.time())))

    async def _ask_group(self, leader: PeerID, group_id: bytes, timeout: float) -> Optional[GroupInfo]:
        try:
            stub = self.get_stub(self._p2p, leader, namespace=self.prefix)
            msg = await asyncio.wait_for(stub.rpc_group_of(averaging_pb2.AveragingData(group_id=group_id)), timeout)
        except Exception as e:
            logger.debug(f"round {self._round_no}: {leader} did not say whether it gathers in a group with us: {e!r}")
            return None
        ids = list(msg.ordered_peer_ids)
        if (msg.code != averaging_pb2.BEGIN_ALLREDUCE or msg.group_id != group_id or len(ids) != len(msg.gathered)
                or not 2 <= len(ids) <= self._max_group_size or len(set(ids)) != len(ids)):
            return None
        try:
            return GroupInfo(group_id, tuple(PeerID(i) for i in ids), tuple(msg.gathered))
        except Exception:
            return None

    async def _adopt(self, info: GroupInfo, leader: PeerID) -> bool:
        """Hand ``info`` to our matchmaking if it still looks for this round's group and the group
        names us with the matchmaking data we sent (what the leader got in our join request)."""
        mm = self._matchmaking
        if self.peer_id not in info.peer_ids:
            return False
        step = mm.step_control
        mine = info.gathered[info.peer_ids.index(self.peer_id)]
        if step is None or mine != step.data_for_gather:
            return False
        async with mm.lock_request_join_group:
            if not mm.is_looking_for_group or mm.assembled_group.done() or mm.step_control is not step:
                return False
            if mm.current_followers:
                await mm.leader_disband_group()  # our own followers look elsewhere
            await mm.group_key_manager.update_key_on_group_assembled(info)
            mm.assembled_group.set_result(info)
        logger.info(f"round {self._round_no}: joined the group {info.group_id.hex()[:12]} of {len(info.peer_ids)} "
                    f"that {leader} assembled with us (its message naming the group had missed us)")
        return True

    async def rpc_group_of(self, request: averaging_pb2.AveragingData, context: P2PContext) -> averaging_pb2.MessageFromLeader:
        """The members and matchmaking data of one of our groups, to a member of it."""
        with self._calls.admit(context.remote_id) as admitted:
            group = self._groups.get(request.group_id) if admitted else None
            if group is None or group.info is None or context.remote_id.to_bytes() not in group.members:
                return averaging_pb2.MessageFromLeader(code=averaging_pb2.BAD_GROUP_ID)
            info = group.info
            return averaging_pb2.MessageFromLeader(
                code=averaging_pb2.BEGIN_ALLREDUCE, group_id=info.group_id,
                ordered_peer_ids=[p.to_bytes() for p in info.peer_ids], gathered=list(info.gathered),
            )
