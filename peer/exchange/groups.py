"""One group of ours, as the gatherer (peer/exchange/gatherer.py) holds it while it agrees and after:
its agreement (protocol/round/reconcile.py), one event per agreement round, the set it agreed and
the group as matchmaking assembled it, which the set, list and late-join servers serve from."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import List, Optional, Set

from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import PeerID

from protocol.round import reconcile


@dataclass
class Group:
    group_id: bytes
    agreement: reconcile.Agreement
    members: frozenset
    done: List[asyncio.Event] = field(default_factory=list)  # done[k]: round k over here (0: own payload sealed)
    set_digest: Optional[str] = None  # the agreed set's name, once agreed (peer/exchange/set_server.py serves it)
    info: Optional[GroupInfo] = None  # hivemind's group, as matchmaking assembled it (peer/exchange/late_join.py serves it)
    round_no: int = -1
    # members that held this peer's requests, its own judgement, not agreed: they sent none of their
    # payload within the grace after the others' came (cut by its FetchClock: protocol/round/fetch_clock.py),
    # or no later agreement round's answer by the round's deadline
    held: Set[PeerID] = field(default_factory=set)
    # strangers no longer waited for in a later agreement round, a grace after the members we know answered
    # (peer/exchange/agreement_rounds.py): no strike, but what they cost is charged to the strangers' budget
    lagged: Set[PeerID] = field(default_factory=set)

    @classmethod
    def opened(cls, group_id: bytes, agreement: reconcile.Agreement, info: Optional[GroupInfo], round_no: int) -> "Group":
        """A group whose agreement starts now: one event for our sealing and one per agreement round."""
        return cls(group_id, agreement, frozenset(agreement.members), [asyncio.Event() for _ in range(agreement.rounds + 1)],
                   info=info, round_no=round_no)
