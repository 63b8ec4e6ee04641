"""Sets a slower group named after our merge stopped waiting, taken before the next round's
matchmaking (peer/round/union.py ``take_named_sets``): the member that concluded the round without
them ends on the θ of the group that held both, bit for bit; a name from a stranger, from another
lineage, or that nobody serves leaves θ as it was."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from peer.round import union
from peer.round.report import RoundRecord
from protocol.round.named_sets import NamedSets
from protocol.round.timing import Timing
from tests.protocol.test_named_sets import _record
from tests.round.test_union import ROUND, Gatherer, concluded, engine, two_groups


class Membership:
    def __init__(self, spec, views, known):
        self.timing, self.views, self._known = Timing.from_spec(spec), views, set(known)
        self.named_sets, self.published = NamedSets(), 0

    def others(self):
        return self.views

    def known(self):
        return frozenset(self._known | {"me"})

    def publish(self):
        self.published += 1


def member(spec, e, serves, views, known):
    peer = SimpleNamespace(engine=e, membership=Membership(spec, views, known), gatherer=Gatherer(serves), spec=spec,
                           peer_id="me", role=SimpleNamespace(progress_part=-1), totals=SimpleNamespace(history=[]))
    peer.totals.history.append(RoundRecord(round=ROUND + 1, params_hash=e.params_hash(), group=["me"], contributors=2,
                                           excluded={}, bytes_sent=0, bytes_received=0, loss=0.0, val_loss=0.0,
                                           seconds=0.0))
    return peer


@pytest.mark.parametrize("strategy", ["diloco", "sparseloco"])
def test_a_set_named_after_our_merge_gave_up_is_taken_and_we_end_on_the_theta_that_held_both(strategy):
    spec, both = engine(strategy)
    _, e = engine(strategy)
    (n1, p1, s1), (n2, p2, s2) = two_groups(spec, both)
    base = both.params_hash()
    concluded(spec, both, {n1: s1, n2: s2})  # the slower group: it merged ours and its own
    last = concluded(spec, e, {n1: s1})  # ours: the merge stopped waiting for the other group's set
    assert e.params_hash() != both.params_hash()
    views = [_record("x", ROUND + 1, ROUND, n2, source=base), _record("y", ROUND + 1, ROUND, n2, source=base)]
    peer = member(spec, e, {"y": {n2: p2}}, views, known={"x", "y"})  # x does not serve it: y is asked next
    assert union.take_named_sets(peer, last) == 1
    assert e.params_hash() == both.params_hash() == last.after_hash == peer.totals.history[-1].params_hash
    assert peer.gatherer.asked == [("x", n2), ("y", n2)] and peer.membership.published == 1
    assert union.announce(last, e) == (base, tuple(sorted((n1, n2))))  # the next group's union repair sees both
    assert peer.totals.history[-1].sets == 2 and peer.totals.history[-1].contributors == 4
    assert union.take_named_sets(peer, last) == 0  # held now: not fetched again
    assert len(peer.gatherer.asked) == 2


@pytest.mark.parametrize("case", ["stranger", "other lineage", "not concluded", "not served", "state installed since",
                                  "no last round"])
def test_a_late_name_that_cannot_be_taken_leaves_theta_as_it_was(case):
    spec, e = engine("sparseloco")
    (n1, p1, s1), (n2, p2, s2) = two_groups(spec, e)
    base = e.params_hash()
    last = concluded(spec, e, {n1: s1})
    known, serves, source, at = {"x"}, {"x": {n2: p2}}, base, ROUND + 1
    if case == "stranger":
        known = set()
    elif case == "other lineage":
        source = "f" * 16
    elif case == "not concluded":
        at = ROUND  # still merging: a start vote lost after would withdraw what it says of the θ
    elif case == "not served":
        serves = {}
    elif case == "state installed since":
        last.after_hash = "0" * 16
    peer = member(spec, e, serves, [_record("x", at, ROUND, n2, source=source)], known)
    before = e.params_hash()
    assert union.take_named_sets(peer, None if case == "no last round" else last) == 0
    assert e.params_hash() == before and union.announce(last, e)[1] in ((n1,), ())
    assert peer.gatherer.asked == ([("x", n2)] if case == "not served" else [])
