"""What the round barrier found (peer/round/membership.py's ``wait_for_round``): whom the round's
exchange can meet, and the group size its gather aims for. peer/round/loop.py decides the exchange's
next step from it (protocol/round/round_policy.py); guarded by tests/round/test_liveness.py and
tests/round/test_rejoin.py."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional, Set, Tuple


@dataclass
class Barrier:
    """What the wait before a round's exchange found."""

    expected: int  # group size to expect: this peer and every peer of its round that is ready
    alone: bool  # no other live peer at all
    behind: bool  # the swarm is at a later round
    only_syncing: bool = False  # every other live peer is downloading the state of an earlier round
    ready: frozenset = frozenset()  # the other peers of the round that were ready (they may gather in other groups)
    gave_up: frozenset = frozenset()  # the peers of the round it stopped waiting for (still training, or stalled)
    unawaited: frozenset = frozenset()  # peers of the round still coming that it did not wait for (they may not send)
    # it ended with strangers still coming: its "exchanging" is stored at once, so that a peer still
    # waiting for them alone sees it has moved on (peer/round/membership.py ``_barrier``)
    left_strangers: bool = False

    @property
    def nobody_to_meet(self) -> bool:
        return self.alone or (self.behind and self.expected == 1)

    @property
    def gather_size(self) -> int:
        """The group size the gather aims for: the ready peers and us, and at least a pair while
        peers of the round are still coming (nobody ready yet is no reason to train alone: the gather
        waits for one of them, until the round's wait ends or every other peer has gathered)."""
        return max(self.expected, min(2, 1 + len(self.gave_up | self.unawaited)))

    def without(self, refused: frozenset) -> "Barrier":
        """This barrier with ``refused`` (whom this round's matchmaking refuses) not among the ready: a
        group's target keeps no seat for a peer that may not take it (the leader would wait out its
        matchmaking for it). tests/round/test_rejoin.py::test_a_silent_groupmate_the_barrier_does_not_wait_for_takes_no_seat"""
        out = self.ready & refused
        return replace(self, expected=self.expected - len(out), ready=self.ready - out) if out else self


def meet_round(peer, awaited: Optional[Callable]) -> Tuple[Barrier, Set[str]]:
    """``peer``'s barrier of its engine's round, and last round's groupmates (peer/round/loop.py): the
    members last round judged (``RoundRecord.judged``) are neither mates nor peers still exchanging the
    round before. ``awaited``: with K a part, only peers that may send are waited for (here and in the merge)."""
    engine = peer.engine
    last = peer.totals.history[-1] if peer.totals.history else None
    mates, judged, refused = (last.mates(peer.peer_id), last.judged(peer.peer_id), last.refused()) \
        if last is not None and last.round == engine.round else (set(), set(), set())
    barrier = peer.membership.wait_for_round(engine.round, mates, first_round=peer.totals.rounds == 0, known=engine.standing,
                                             awaited=awaited, notices=peer.gatherer, judged=judged, refused=refused)
    return barrier, mates
