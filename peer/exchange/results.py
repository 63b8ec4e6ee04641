"""What a round's gather hands back to the round (peer/round/loop.py and merge.py): the group, the
agreed payloads, who was excluded and why, and the name of the agreed set."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Tuple

from hivemind.p2p import PeerID


@dataclass
class GatherResult:
    """What one member holds after a round's all-gather."""

    group: List[str]  # every member of the group, as base58 peer ids
    payloads: Dict[str, bytes]  # sender -> payload, own included
    excluded: Dict[str, str]  # sender -> why its payload is not in `payloads`
    start_hashes: Dict[str, str]  # member -> hash of the parameters it started the round from
    # member -> (hash of θ before its last round's outer step, the sets it concluded that round from)
    last_sets: Dict[str, Tuple[str, Tuple[str, ...]]] = field(default_factory=dict)
    lineages: Dict[str, str] = field(default_factory=dict)  # member -> the lineage it named (start_vote.py)
    set_digest: str = ""  # the name of the agreed set (protocol/round/group_sets.py), served to other groups
    unservable: FrozenSet[str] = frozenset()  # members in hivemind's client mode: they serve no state
    # members that held this member's requests (``Group.held``), their payload perhaps relayed by others:
    # its judgement alone, not agreed; its merge waits for their answer only briefly (peer/round/loop.py)
    held: FrozenSet[str] = frozenset()
    # strangers not waited for in a later agreement round (``Group.lagged``): their merge answer is waited for
    # briefly too (peer/round/loop.py), and what they cost is charged to the strangers' budget
    lagged: FrozenSet[str] = frozenset()
    bytes_sent: int = 0
    bytes_received: int = 0

    @property
    def present(self) -> List[str]:
        """The members the gather did not exclude: its senders and, in a round of at most K a part, the
        members that sent nothing by design (protocol/round/eligibility.py). The same on every member."""
        return [m for m in self.group if m not in self.excluded]


def base58(peer_id_bytes: bytes) -> str:
    """A peer id as hivemind's messages carry it (bytes), as the run's records name it."""
    return PeerID(peer_id_bytes).to_base58()
