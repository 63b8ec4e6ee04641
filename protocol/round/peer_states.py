"""A peer's state, as its progress record publishes it, and the moves between states.

Other peers act on this field (who to wait for, who may still name a set for a round, whose round
means something), so the names, their groupings and the moves a peer makes are defined here once:

    starting    joining, downloading the swarm's state, or recovering after its role lost a round
    waiting     started, holding its first round until ``--wait-peers`` peers have started
    linking     a chain stage bringing its links up (not counted in rounds until they are)
    training    in a round: its inner steps
    ready       its round's payload is made; waiting for its group
    exchanging  gathering its group's payloads and taking the outer step
    syncing     downloading the swarm's state (then back to the state it left)
    stopped     gone for good

Groupings (each a frozenset):

- ``NOT_IN_ROUNDS``: states that take no part in the round they name;
- ``DONE``: a peer that has finished training its round (its group's set is coming);
- ``IN_ROUND``: a peer in a round: it trains, or it is done and about to gather;
- ``NOT_A_SOURCE``: a peer whose round means nothing yet (never a state source).

``TRANSITIONS`` is the table of moves a live peer makes; ``allowed(old, new)`` reads it.
Guarded by tests/protocol/test_peer_states.py.
"""

from __future__ import annotations

from typing import Dict, FrozenSet

STARTING, WAITING, LINKING, TRAINING = "starting", "waiting", "linking", "training"
READY, EXCHANGING, SYNCING, STOPPED = "ready", "exchanging", "syncing", "stopped"
STATES = (STARTING, WAITING, LINKING, TRAINING, READY, EXCHANGING, SYNCING, STOPPED)

NOT_IN_ROUNDS: FrozenSet[str] = frozenset({STOPPED, STARTING, LINKING})
DONE: FrozenSet[str] = frozenset({READY, EXCHANGING})
IN_ROUND: FrozenSet[str] = frozenset({TRAINING}) | DONE
NOT_A_SOURCE: FrozenSet[str] = frozenset({STOPPED, STARTING})

_LIVE = frozenset(STATES) - {STOPPED}
# old state -> the states a peer may move to from it (the same state: a re-publication, always allowed)
TRANSITIONS: Dict[str, FrozenSet[str]] = {
    STARTING: frozenset({WAITING, LINKING, TRAINING, SYNCING, STOPPED}),
    WAITING: frozenset({LINKING, TRAINING, SYNCING, STARTING, STOPPED}),
    LINKING: frozenset({TRAINING, SYNCING, STARTING, STOPPED}),
    # a chain stage whose next round's links are not up yet goes back to linking
    TRAINING: frozenset({READY, LINKING, SYNCING, STARTING, STOPPED}),
    # with overlap, the next round's steps are under way while the exchange of the last one waits
    READY: frozenset({EXCHANGING, TRAINING, SYNCING, STARTING, STOPPED}),
    EXCHANGING: frozenset({TRAINING, READY, LINKING, SYNCING, STARTING, STOPPED}),
    SYNCING: _LIVE | {STOPPED},  # back to whichever state the download interrupted
    STOPPED: frozenset(),
}


def allowed(old: str, new: str) -> bool:
    """Whether a peer in ``old`` may move to ``new`` (an unknown state never)."""
    return new in STATES and (old == new or new in TRANSITIONS.get(old, frozenset()))


def keeps_waiting(round_no: int, state: str, asked_round: int) -> bool:
    """Whether a peer at ``round_no`` in ``state`` is still one that a barrier of ``asked_round`` waits
    for: training that round (or waiting for its start quorum), or in an earlier round and not out of
    rounds (a groupmate still finishing the last one). A peer answers a barrier's direct question only
    once this turns false, or when the question's hold runs out (peer/exchange/ready_notices.py;
    tests/exchange/test_ready_notices.py). A peer never shows a done state for a round it has not
    trained: it is "training" from the moment the round before concludes (peer/round/loop.py)."""
    if state in NOT_IN_ROUNDS:
        return False
    return round_no < asked_round or (round_no == asked_round and state in (TRAINING, WAITING))


def names_no_set_yet(p, asked_round: int) -> bool:
    """Whether a peer whose record is ``p`` (protocol/dht/records.py ``Progress``) is still one that a
    merge of ``asked_round``'s sets waits for: in rounds, at that round (or behind it) and naming no
    set for it yet. A peer answers a merge's direct question only once this turns false, or when the
    question's hold runs out (peer/exchange/ready_notices.py; tests/exchange/test_ready_notices.py)."""
    if p.state in NOT_IN_ROUNDS:
        return False
    return p.round < asked_round or (p.round == asked_round and not p.set_of(asked_round))


def offers_no_set(p, round_no: int, name: str) -> bool:
    """Whether a peer whose record is ``p`` (protocol/dht/records.py ``Progress``) will never say which
    sets it merged for the set ``name`` of ``round_no``: its record names another set for that round
    (a peer agrees one set a round, and names it before it merges), or it is more than two rounds
    past it (its merges of that round are long over). A groupmate's question about ``name`` is then
    answered at once instead of held open until the asker's wait runs out: a member that gave up the
    group's gather and took another set would otherwise hold its groupmates for up to
    ``Timing.mate_merge_bound`` (tests/exchange/test_merged_lists.py)."""
    named = p.set_of(round_no)
    return bool(named and named != name) or p.round > round_no + 2


def settled(state: str) -> str:
    """``state`` with the two done states as one: the move from ready to exchanging changes nothing
    another peer acts on, so it waits for the next keep-alive instead of a publication."""
    return READY if state in DONE else state


def acted_on(p) -> tuple:
    """The fields of a progress record (protocol/dht/records.py ``Progress``) other peers act on: a
    change to one is published at once, the rest (losses, tokens, "exchanging" after "ready") waits
    for the next keep-alive, as every store moves the record to every replica
    (tests/round/test_liveness.py, ``test_only_what_other_peers_act_on_is_published_at_once``)."""
    return (p.round, settled(p.state), p.params_hash, p.part, p.reach, p.gathered_round, p.gathered, p.gathered_before,
            p.gathered_from)
