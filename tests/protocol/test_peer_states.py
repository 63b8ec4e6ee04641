"""protocol/round/peer_states.py: the states a progress record names, their groupings and the moves between them."""

from __future__ import annotations

import pytest

from protocol.round import peer_states as ps
from protocol.dht.records import STATES

# (old, new, allowed?) for the moves that matter to the round
MOVES = [
    (ps.STARTING, ps.WAITING, True),  # holding the first round for --wait-peers
    (ps.STARTING, ps.TRAINING, True),
    (ps.WAITING, ps.TRAINING, True),
    (ps.STARTING, ps.LINKING, True),  # a chain stage
    (ps.LINKING, ps.TRAINING, True),
    (ps.TRAINING, ps.READY, True),  # the payload is made
    (ps.READY, ps.EXCHANGING, True),
    (ps.EXCHANGING, ps.TRAINING, True),  # θ of the next round is known
    (ps.READY, ps.TRAINING, True),  # overlap: the next round's steps go on while the exchange waits
    (ps.TRAINING, ps.SYNCING, True),
    (ps.SYNCING, ps.EXCHANGING, True),  # back to the state the download interrupted
    (ps.EXCHANGING, ps.STARTING, True),  # a role that lost its round recovers
    (ps.TRAINING, ps.STOPPED, True),
    (ps.STOPPED, ps.TRAINING, False),  # stopped is for good
    (ps.STOPPED, ps.STOPPED, True),
    (ps.WAITING, ps.READY, False),  # no payload without a round's steps
    (ps.STARTING, ps.EXCHANGING, False),
    (ps.TRAINING, "dancing", False),
    ("dancing", ps.TRAINING, False),
]


@pytest.mark.parametrize("old,new,ok", MOVES)
def test_the_transition_table(old, new, ok):
    assert ps.allowed(old, new) is ok


def test_every_state_has_a_row_and_every_live_state_can_stop():
    assert set(ps.TRANSITIONS) == set(STATES) == set(ps.STATES)
    for state in set(ps.STATES) - {ps.STOPPED}:
        assert ps.allowed(state, ps.STOPPED) and ps.allowed(state, ps.SYNCING), state


@pytest.mark.parametrize("state,in_round,done,counted,source", [
    (ps.STARTING, False, False, False, False),
    (ps.WAITING, False, False, True, True),
    (ps.LINKING, False, False, False, True),
    (ps.TRAINING, True, False, True, True),
    (ps.READY, True, True, True, True),
    (ps.EXCHANGING, True, True, True, True),
    (ps.SYNCING, False, False, True, True),
    (ps.STOPPED, False, False, False, False),
])
def test_the_groupings(state, in_round, done, counted, source):
    assert (state in ps.IN_ROUND, state in ps.DONE) == (in_round, done)
    assert (state not in ps.NOT_IN_ROUNDS, state not in ps.NOT_A_SOURCE) == (counted, source)


def test_ready_and_exchanging_publish_as_one():
    assert ps.settled(ps.EXCHANGING) == ps.settled(ps.READY) == ps.READY
    assert ps.settled(ps.TRAINING) == ps.TRAINING
