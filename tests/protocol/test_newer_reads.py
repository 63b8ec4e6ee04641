"""protocol/dht/newer_reads.py: the held list a lean read sends, and what a replica leaves out of its answer."""

from __future__ import annotations

import hashlib
import math
import struct
from collections import Counter

import pytest

from protocol.dht.newer_reads import (ENTRY_BYTES, MAX_HELD, HeldListError, ask_order, newer, pack_held, parse_held,
                                      subkey_digest)


def test_a_held_list_round_trips_and_keeps_the_latest_of_a_subkey_named_twice():
    held = parse_held(pack_held([(b"a", 10.0), (b"b", 20.5), (b"a", 12.0)]))
    assert held == {subkey_digest(b"a"): 12.0, subkey_digest(b"b"): 20.5}
    assert len(pack_held([(b"a", 1.0)])) == ENTRY_BYTES


def test_a_replica_sends_what_the_reader_lacks_or_holds_older_and_nothing_else():
    held = parse_held(pack_held([(b"same", 10.0), (b"older", 10.0), (b"newer-here", 30.0)]))
    items = [(b"same", 10.0), (b"older", 15.0), (b"newer-here", 20.0), (b"unknown", 5.0)]
    assert list(newer(items, held)) == [1, 3]
    assert list(newer(items, {})) == [0, 1, 2, 3]  # a first read: everything


def test_the_list_is_cut_at_its_bound_on_the_way_out():
    assert len(pack_held(((str(i).encode(), 1.0) for i in range(MAX_HELD + 5)))) == MAX_HELD * ENTRY_BYTES


@pytest.mark.parametrize("data, why", [
    (b"\x00" * (ENTRY_BYTES + 1), "whole"),
    (b"\x00" * (ENTRY_BYTES * (MAX_HELD + 1)), "at most"),
    (b"12345678" + struct.pack(">d", math.nan), "finite"),
    (b"12345678" + struct.pack(">d", math.inf), "finite"),
])
def test_a_hostile_held_list_is_refused_with_a_reason(data, why):
    with pytest.raises(HeldListError, match=why):
        parse_held(data)


def test_readers_spread_their_first_asks_over_the_replicas():
    """Every reader asked the key's nearest replica first, so it alone sent every reader the records new
    to it; a reader's own pick spreads that over the replicas, and the same nodes are asked."""
    nearest = ["r0", "r1", "r2", "r3", "r4", "spare0", "spare1", "spare2"]
    firsts = Counter()
    for i in range(1000):
        order = ask_order(nearest, 5, hashlib.sha256(b"reader %d" % i).digest()[:20])
        assert sorted(order[:5]) == nearest[:5] and order[5:] == nearest[5:]  # the spares stay last, in order
        assert order == ask_order(nearest, 5, hashlib.sha256(b"reader %d" % i).digest()[:20])  # one reader, one pick
        firsts[order[0]] += 1
    assert set(firsts) == set(nearest[:5]) and max(firsts.values()) < 1000 / 5 * 1.3
    # a reader that is a replica itself asks the 4 others; fewer candidates than replicas; none
    assert sorted(ask_order(nearest[:4], 4, b"me")) == nearest[:4]
    assert sorted(ask_order(["a", "b"], 5, b"me")) == ["a", "b"]
    assert ask_order([], 5, b"me") == [] and ask_order(["s"], 0, b"me") == ["s"]
