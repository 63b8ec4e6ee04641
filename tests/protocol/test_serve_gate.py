"""protocol/round/serve_gate.py: how many state downloads a peer serves, to whom, how often."""

from __future__ import annotations

import pytest

from protocol.round.serve_gate import ServeGate


def test_at_most_at_once_downloads_are_served_and_a_release_frees_a_slot():
    gate = ServeGate(at_once=2, per_peer=5, window=60.0)
    assert gate.admit("a", 0.0, stranger=False) is None
    assert gate.admit("b", 0.0, stranger=False) is None
    assert "at most 2 at once" in gate.admit("c", 0.0, stranger=False)
    gate.release("a")
    assert gate.admit("c", 1.0, stranger=False) is None and gate.in_flight == 2


def test_strangers_cannot_take_the_last_slot_from_the_peers_of_our_rounds():
    gate = ServeGate(at_once=2, per_peer=5, window=60.0)
    assert gate.admit("new1", 0.0, stranger=True) is None
    assert "kept for peers of our rounds" in gate.admit("new2", 0.0, stranger=True)
    assert gate.admit("member", 0.0, stranger=False) is None
    # with a single slot there is nothing to keep: first come, first served
    solo = ServeGate(at_once=1, per_peer=5, window=60.0)
    assert solo.admit("new", 0.0, stranger=True) is None


def test_a_peer_begins_at_most_per_peer_downloads_within_the_window():
    gate = ServeGate(at_once=4, per_peer=2, window=60.0)
    for t in (0.0, 10.0):
        assert gate.admit("a", t, stranger=False) is None
        gate.release("a")
    assert "within 60 s" in gate.admit("a", 59.0, stranger=False)
    assert gate.admit("b", 59.0, stranger=False) is None  # another peer is not held back by it
    assert gate.admit("a", 60.0, stranger=False) is None  # the first has left the window
    assert "within 60 s" in gate.admit("a", 65.0, stranger=False)


def test_the_table_of_downloaders_is_bounded_and_a_full_one_refuses_strangers_only():
    gate = ServeGate(at_once=10, per_peer=1, window=60.0, max_tracked=3)
    for i in range(3):
        assert gate.admit(f"p{i}", float(i), stranger=True) is None
        gate.release(f"p{i}")
    assert "3 peers downloaded" in gate.admit("p3", 3.0, stranger=True)
    assert gate.admit("member", 3.0, stranger=False) is None
    assert gate.admit("p4", 61.0, stranger=True) is None  # p0 left the window and the table
    assert len(gate._begun) <= 4


def test_releases_count_per_download_and_an_unknown_release_is_harmless():
    gate = ServeGate(at_once=3, per_peer=3, window=60.0)
    gate.admit("a", 0.0, stranger=False)
    gate.admit("a", 0.0, stranger=False)
    gate.release("a")
    assert gate.serving == {"a": 1}
    gate.release("a")
    gate.release("a")
    gate.release("nobody")
    assert gate.serving == {} and gate.in_flight == 0


@pytest.mark.parametrize("args", [(0, 1, 1.0), (1, 0, 1.0), (1, 1, 0.0), (1, 1, 1.0, 0)])
def test_a_gate_without_slots_or_window_is_a_clear_error(args):
    with pytest.raises(ValueError):
        ServeGate(*args)
