"""The decisions of a round's exchange, pure: what a peer does next, from what it knows now.

No I/O and no clock: the round loop (peer/round/loop.py) and the merge of a round's sets
(peer/round/merge.py) gather the facts (the barrier's result, the gather's, the records of the
view, the times they measured) and carry out what these functions decide.

A round's exchange moves through ``Step``s:

    BARRIER ──stopping──────────────────────────────────────────────> STOP
       │ nobody of the round left to meet: a set of it named by peers
       │ gone on to later rounds, and a lineage to judge it by ─────> ADOPT_ROUND_SET
       │                      otherwise ────────────────────────────> NO_GROUP
       v
    GATHER ──a group's set──────────────────────────────────────────> CONCLUDE
       │ no group, and the gather gave up because every other peer
       │ gathered without us: with a lineage (last round's groupmates,
       │                      or a downloaded state's basis) ───────> ADOPT_ROUND_SET
       │                      with none (a fresh start) ────────────> NO_GROUP
       │ no group otherwise (our gather timed out) ─────────────────> ADOPT_OWN_SET
    ADOPT_* ──a set that holds us (or our lineage)──────────────────> CONCLUDE
       │ none ──────────────────────────────────────────────────────> NO_GROUP
    NO_GROUP ──no other peer in rounds (alone, or the swarm is empty)> ALONE
       │ otherwise ─────────────────────────────────────────────────> DEFER

and ends in one ``Outcome``: ``AGREED`` (CONCLUDE: a set of the round, merged with the round's
other groups' sets; ALONE: a set of our payload only), ``CAUGHT_UP`` (DEFER: the round's update
stays in the strategy's buffers and the swarm's state is taken), or ``STOPPED``.

``merge_wait`` decides when the merge of a round's sets stops waiting for the round's other
groups, and ``nobody_left`` when a gather still looking for a group can give up. Both take the
times as inputs. Guarded by tests/protocol/test_round_policy.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import AbstractSet, Dict, FrozenSet, Iterable, Mapping, Optional, Sequence, Tuple

from protocol.round.peer_states import DONE, IN_ROUND


def min_steps(inner_steps: int, fraction: float) -> int:
    """The fewest inner steps a round may close early after (>= 1, <= H): ``outer.min_inner_fraction``
    of H (peer/round/early_close.py); a chain's later stages refuse a close before it (peer/training/roles.py)."""
    return max(1, min(inner_steps, math.ceil(fraction * inner_steps - 1e-9)))


class Step(Enum):
    BARRIER = "barrier"
    GATHER = "gather"
    ADOPT_OWN_SET = "adopt our group's set"
    ADOPT_ROUND_SET = "adopt the round's set"
    NO_GROUP = "no group"
    CONCLUDE = "conclude"
    ALONE = "train alone"
    DEFER = "defer and catch up"
    STOP = "stop"


class Outcome(Enum):
    AGREED = "agreed"
    CAUGHT_UP = "caught up by state"
    STOPPED = "stopped"


OUTCOME: Dict[Step, Outcome] = {Step.CONCLUDE: Outcome.AGREED, Step.ALONE: Outcome.AGREED,
                                Step.DEFER: Outcome.CAUGHT_UP, Step.STOP: Outcome.STOPPED}
FINAL: FrozenSet[Step] = frozenset(OUTCOME)


def after_barrier(stopping: bool, nobody_to_meet: bool, adoptable: bool = False) -> Step:
    """The step after the round's barrier: nobody of our round left to meet skips the gather.
    ``adoptable``: peers that went on to later rounds named a set of ours, and we have a lineage to
    judge it by: their set is taken (one set's bytes), not their state (a download, after which a
    late joiner on a loaded host met the next round's barrier just as late: peer/round/merge.py
    ``adopt_round_set``; tests/protocol/test_round_policy.py)."""
    if stopping:
        return Step.STOP
    if not nobody_to_meet:
        return Step.GATHER
    return Step.ADOPT_ROUND_SET if adoptable else Step.NO_GROUP


def after_gather(got_group: bool, gave_up: bool, has_mates: bool, stopping: bool = False) -> Step:
    """The step after the gather. ``gave_up``: it stopped looking because every other peer of the
    round had gathered (our payload went nowhere); ``has_mates``: we have a lineage (groupmates last
    round, or the basis of a state downloaded for this round): only a set of our lineage can be taken."""
    if got_group:
        return Step.CONCLUDE
    if stopping:
        return Step.NO_GROUP
    if gave_up:
        return Step.ADOPT_ROUND_SET if has_mates else Step.NO_GROUP
    return Step.ADOPT_OWN_SET  # a timeout on our side can end a gather our group completed with our payload


def after_adopt(got_set: bool) -> Step:
    return Step.CONCLUDE if got_set else Step.NO_GROUP


def without_group(alone: bool) -> Step:
    """No set of the round holds our payload: with no other peer in rounds we train alone (a solo
    set), otherwise the round is deferred and the swarm's state taken."""
    return Step.ALONE if alone else Step.DEFER


class MergeWait(Enum):
    GO_ON = "go on waiting"
    NOTHING_LEFT = "nothing left to wait for"
    TIMED_OUT = "timed out"


@dataclass(frozen=True)
class MergeClock:
    """The times the merge measured (seconds, any one clock) and the waits it was given."""

    now: float
    started: float  # when the merge began
    last_arrival: float  # when the last set came in (the start, before any)
    allowance: float  # Timing.merge_allowance
    extra: float  # Timing.gathering_extra, while a peer it waits for has finished training; else 0
    round_wait: float  # Timing.round_wait_s


def merge_wait(clock: MergeClock, records_seen: bool, outstanding: int, unfetched: int, min_group_size: int,
               fresh_read: bool) -> MergeWait:
    """Whether the merge of a round's sets waits on. ``outstanding``: peers of the round that may
    still name a set; ``unfetched``: named sets not yet fetched (or tried); ``fresh_read``: the view
    was read after our group's gather. Fewer outstanding peers than make a group cannot gather a set
    of their own."""
    if not records_seen or (outstanding < min_group_size and not unfetched and fresh_read):
        return MergeWait.NOTHING_LEFT
    c = clock
    if c.now - c.last_arrival > c.allowance + c.extra or c.now - c.started > c.round_wait + c.extra:
        return MergeWait.TIMED_OUT
    return MergeWait.GO_ON


def strangers_alone(outstanding: AbstractSet[str], due: AbstractSet[str], known: AbstractSet[str],
                    min_group_size: int) -> bool:
    """Whether the merge waits for strangers alone: ``outstanding`` (peers of the round still to name a
    set, where one that may send is among them) and ``due`` (peers that named a set still to fetch)
    hold nobody ``known``, and a set could still come of them (a set to fetch, or enough outstanding
    peers to form a group: fewer wait only for one fresh read of the view, which costs nobody)."""
    waiting = set(outstanding) | set(due)
    return bool(due or len(outstanding) >= min_group_size) and not (waiting & set(known))


@dataclass
class StrangersWait:
    """The merge's wait for strangers alone, with time as an input: ``check`` once a poll, with whether
    the poll waits for strangers alone (``strangers_alone``), when the last set came in, and whether a
    set a peer we know named was asked for since the last poll. ``vain`` adds up the time from a poll
    that waited for strangers alone to the next where nothing came meanwhile (no set, no known peer's
    set asked for): paid from the budget for strangers however the merge ends (they may leave the round
    naming no set: unpaid, a group of them held every merge the whole grant, round after round).
    ``since``: when the current stretch of such polls began, None outside one: the grant runs from it
    (tests/protocol/test_round_policy.py)."""

    since: Optional[float] = None
    vain: float = 0.0
    last: Optional[float] = None  # the previous poll, where it waited for strangers alone

    def check(self, now: float, alone: bool, last_arrival: float, asked_known: bool) -> None:
        quiet = not asked_known and (self.last is None or last_arrival <= self.last)
        if self.last is not None and quiet:
            self.vain += max(0.0, now - self.last)
        if not (alone and quiet):
            self.since = None
        if alone and self.since is None:
            self.since = now
        self.last = now if alone else None


# (peer id, its round, its state, the part it trains, whether it named a set for the round in question)
Record = Tuple[str, int, str, int, bool]


def nobody_left(records: Iterable[Record], me: str, part: int, round_no: int, not_waited: FrozenSet[str]) -> bool:
    """Whether a gather still looking for a group of ``round_no`` can give up: some peer of our part
    has named a set for the round and none is left in it to gather with (each has named its set, or
    left the round, or is one we no longer wait for: ``not_waited``)."""
    named = open_ = False
    for peer, rnd, state, their_part, has_set in records:
        if peer == me or their_part != part:
            continue
        named |= has_set
        if rnd == round_no and state in IN_ROUND and not has_set and peer not in not_waited:
            open_ = True
    return named and not open_


def still_gathering(states: Iterable[str]) -> bool:
    """Whether any of these peers has finished training its round (its group's set is coming)."""
    return any(s in DONE for s in states)


def swarm_round(rounds: Sequence[int]) -> int:
    """The round the swarm is at as far as one peer's claim cannot move it: the second-highest of
    ``rounds`` (reached by at least two peers), or the only one; -1 for none."""
    ordered = sorted(rounds, reverse=True)
    return ordered[1] if len(ordered) > 1 else (ordered[0] if ordered else -1)


def majority_round(rounds: Sequence[int]) -> int:
    """The latest round a strict majority of ``rounds`` has reached; -1 for none."""
    ordered = sorted(rounds, reverse=True)
    return ordered[len(ordered) // 2] if ordered else -1


def sync_target(rounds: Mapping[str, int], known: AbstractSet[str],
                active: AbstractSet[str]) -> Tuple[int, Optional[FrozenSet[str]]]:
    """The round a peer catches up to (or counts itself behind), from the rounds of the peers it sees
    (peer id -> round), and the peers that may vouch for that state's θ (None: the round's majority).

    Two kinds of claims count. Where it sees two or more peers it ``known``s (seen to come, or with
    standing in its lineage), the second-highest of their rounds, and only they serve it and vouch for
    it. Where a strict majority of the ``active`` peers it sees (training or done with their round: not
    peers still downloading a state or waiting to start) has reached a later round, that round: the
    peers it knows lag the swarm (two newcomers that trained a round together while the swarm was
    ahead), or it knows nobody: new identities must then outnumber the active peers it sees to move
    it, and it downloads from peers at that round only (peer/round/state_sync.py). Two new identities
    announcing a round ahead and vouching for each other's θ once made every honest peer install it
    (tests/protocol/test_round_policy.py ``test_new_identities_fewer_than_the_peers_seen_cannot_set_the_round_to_catch_up_to``)."""
    vouchers = frozenset(p for p in rounds if p in known)
    by_known = swarm_round([rounds[p] for p in vouchers]) if len(vouchers) >= 2 else -1
    by_most = majority_round([r for p, r in rounds.items() if p in active])
    if by_known >= 0 and by_known >= by_most:
        return by_known, vouchers
    return by_most, None
