"""protocol/round/serve_gate.py: how many state downloads a peer serves, to whom, how often, how long."""

from __future__ import annotations

import pytest

from protocol.round.serve_gate import ServeGate


def gate(at_once=2, per_peer=5, window=60.0, lease=30.0, **kw) -> ServeGate:
    return ServeGate(at_once, per_peer, window, lease, **kw)


def test_at_most_at_once_downloads_are_served_and_a_release_frees_a_slot():
    g = gate()
    a, _ = g.admit("a", 0.0, stranger=False)
    assert a is not None and g.admit("b", 0.0, stranger=False)[0] is not None
    slot, why = g.admit("c", 0.0, stranger=False)
    assert slot is None and "at most 2 at once" in why
    g.release(a)
    g.release(a)  # twice: harmless
    assert g.admit("c", 1.0, stranger=False)[0] is not None and g.in_flight(1.0) == (2, 0)


def test_strangers_never_take_every_slot_and_a_member_download_leaves_them_theirs():
    g = gate()
    assert g.admit("member", 0.0, stranger=False)[0] is not None
    assert g.admit("new1", 0.0, stranger=True)[0] is not None  # a member downloading does not hold strangers back
    g = gate()
    assert g.admit("new1", 0.0, stranger=True)[0] is not None
    slot, why = g.admit("new2", 0.0, stranger=True)
    assert slot is None and "kept for peers of our rounds" in why
    assert g.admit("member", 0.0, stranger=False)[0] is not None
    assert g.admit("new1", 0.0, stranger=True)[0] is None  # full
    # with a single slot there is nothing to keep: first come, first served
    assert gate(at_once=1).admit("new", 0.0, stranger=True)[0] is not None


def test_a_slot_whose_lease_ended_is_free_and_hold_sets_the_lease():
    g = gate(at_once=1, lease=10.0)
    slot, _ = g.admit("stalled", 0.0, stranger=False)
    assert g.admit("b", 9.0, stranger=False)[0] is None
    assert g.admit("b", 10.0, stranger=False)[0] is not None  # the stalled stream's slot is free at its lease
    g = gate(at_once=1, lease=10.0)
    slot, _ = g.admit("big", 0.0, stranger=False)
    g.hold(slot, 100.0)  # renewed as it keeps up with the slowest accepted rate
    assert g.admit("b", 50.0, stranger=False)[0] is None and g.admit("b", 100.0, stranger=False)[0] is not None
    g = gate(at_once=1, lease=10.0)
    slot, _ = g.admit("slow start", 0.0, stranger=False)
    g.in_flight(11.0)  # its first lease ended a moment before its first renewal: it counts again once renewed
    g.hold(slot, 20.0)
    assert g.admit("b", 12.0, stranger=False)[0] is None


def test_a_peer_begins_at_most_per_peer_downloads_within_the_window():
    g = gate(at_once=4, per_peer=2)
    for t in (0.0, 10.0):
        slot, _ = g.admit("a", t, stranger=False)
        g.release(slot)
    slot, why = g.admit("a", 59.0, stranger=False)
    assert slot is None and "within 60 s" in why
    assert g.admit("b", 59.0, stranger=False)[0] is not None  # another peer is not held back by it
    slot, _ = g.admit("a", 60.0, stranger=False)  # the first has left the window
    assert slot is not None and "already downloading" in g.admit("a", 61.0, stranger=False)[1]  # one at a time
    g.release(slot)
    assert "within 60 s" in g.admit("a", 65.0, stranger=False)[1]


def test_the_table_of_downloaders_is_bounded_and_a_full_one_refuses_strangers_only():
    g = gate(at_once=10, per_peer=1, max_tracked=3)
    for i in range(3):
        g.release(g.admit(f"p{i}", float(i), stranger=True)[0])
    assert "3 peers downloaded" in g.admit("p3", 3.0, stranger=True)[1]
    assert g.admit("member", 3.0, stranger=False)[0] is not None
    assert g.admit("p4", 61.0, stranger=True)[0] is not None  # p0 left the window and the table
    assert len(g._begun) <= 4


@pytest.mark.parametrize("args", [(0, 1, 1.0, 1.0), (1, 0, 1.0, 1.0), (1, 1, 0.0, 1.0), (1, 1, 1.0, 0.0),
                                  (1, 1, 1.0, 1.0, 0)])
def test_a_gate_without_slots_window_or_lease_is_a_clear_error(args):
    with pytest.raises(ValueError):
        ServeGate(*args)
