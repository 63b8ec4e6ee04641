"""Sets a slower group named after our merge stopped waiting, taken before the next round's
matchmaking (peer/round/union.py ``take_named_sets``): the member that concluded the round without
them ends on the θ of the group that held both, bit for bit; a name from a stranger, from another
lineage, or that nobody serves leaves θ as it was; strangers' names cost what their budget grants."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from peer.round import union
from peer.round.membership import Membership as RealMembership
from peer.round.report import RoundRecord
from protocol.round.named_sets import NamedSets
from protocol.round.timing import Timing
from protocol.round.group_sets import set_digest
from tests.protocol.test_named_sets import _record
from tests.support.agreement_sim import binding_of, signer
from tests.round.test_liveness import SPEC as LIVE_SPEC
from tests.round.test_union import ROUND, concluded, engine, two_groups
from tests.round.test_union import member as union_member


class Membership:
    def __init__(self, spec, views, known, grant=None):
        self.timing, self.views, self._known = Timing.from_spec(spec), views, set(known)
        self.named_sets, self.published = NamedSets(), 0
        self.grant, self.paid = grant, []  # what the budget for strangers grants (None: not limiting); waits paid
        self.admits = True  # our matchmaking admits strangers

    def admits_strangers(self):
        return self.admits

    def strangers_wait(self, peers):
        return self.grant

    def waited_for_strangers(self, seconds):
        self.paid.append(seconds)

    def came_late(self, round_no, senders):
        self.came = (round_no, set(senders))

    def others(self):
        return self.views

    def known(self):
        return frozenset(self._known | {"me"})

    def publish(self):
        self.published += 1


def member(spec, e, serves, views, known, grant=None):
    """tests/round/test_union.py's member, with a view, a part and a record of the round under way."""
    peer = union_member(spec, e, serves)
    peer.membership, peer.role = Membership(spec, views, known, grant), SimpleNamespace(progress_part=-1)
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
    assert peer.membership.came == (ROUND, set(s2))  # its senders came: a merge waits for them again
    assert union.take_named_sets(peer, last) == 0  # held now: not fetched again
    assert len(peer.gatherer.asked) == 2


@pytest.mark.parametrize("grant", [None, 5.0])
def test_a_set_only_strangers_name_is_taken_while_the_budget_for_strangers_grants_time(grant):
    """At a run's start every peer is a stranger: two groups that never met take each other's late sets
    (the budget does not limit yet, None, or grants time)."""
    spec, both = engine("diloco")
    _, e = engine("diloco")
    (n1, p1, s1), (n2, p2, s2) = two_groups(spec, both)
    base = both.params_hash()
    concluded(spec, both, {n1: s1, n2: s2})
    last = concluded(spec, e, {n1: s1})
    peer = member(spec, e, {"x": {n2: p2}}, [_record("x", ROUND + 1, ROUND, n2, source=base)], known=(), grant=grant)
    assert union.take_named_sets(peer, last) == 1 and e.params_hash() == both.params_hash()
    assert peer.membership.paid == []


def test_strangers_naming_sets_nobody_serves_cost_what_their_budget_grants_and_known_names_go_first():
    spec, e = engine("diloco")
    (n1, p1, s1), (n2, p2, s2) = two_groups(spec, e)
    base = e.params_hash()
    last = concluded(spec, e, {n1: s1})
    bogus = ["f" * 32, "e" * 32]
    views = [_record(f"s{i}", ROUND + 1, ROUND, name, source=base) for i, name in enumerate(bogus)]
    views.append(_record("k", ROUND + 1, ROUND, n2, source=base))
    peer = member(spec, e, {"k": {n2: p2}}, views, known={"k"}, grant=0.5)
    assert union.take_named_sets(peer, last) == 1
    assert peer.gatherer.asked[0] == ("k", n2)  # the set a known peer names first
    assert sorted(peer.gatherer.asked[1:]) == [("s0", bogus[0]), ("s1", bogus[1])]
    assert len(peer.membership.paid) == 2  # each vain fetch paid from the budget for strangers
    peer = member(spec, e, {}, views[:2], known=(), grant=0.0)  # nothing granted: not even asked
    assert union.take_named_sets(peer, last) == 0 and peer.gatherer.asked == [] and peer.membership.paid == []
    peer = member(spec, e, {}, views[:2], known=())
    peer.membership.admits = False  # our matchmaking keeps strangers out now: their names too
    assert union.take_named_sets(peer, last) == 0 and peer.gatherer.asked == []


def test_where_a_set_a_known_peer_names_cannot_be_had_none_is_taken():
    """Part of the late sets would leave θ where nobody is: the member stays on its group's θ."""
    spec, e = engine("diloco")
    (n1, p1, s1), (n2, p2, s2) = two_groups(spec, e)
    binding = binding_of([signer(i).peer_id for i in (5, 6)], round_no=ROUND, group_id=b"g3")
    n3 = set_digest(binding.context, {})
    base = e.params_hash()
    last = concluded(spec, e, {n1: s1})
    views = [_record("k", ROUND + 1, ROUND, n2, source=base), _record("j", ROUND + 1, ROUND, n3, source=base)]
    peer = member(spec, e, {"k": {n2: p2}}, views, known={"k", "j"})  # j does not serve n3
    before = e.params_hash()
    assert union.take_named_sets(peer, last) == 0
    assert e.params_hash() == before and union.announce(last, e) == (base, (n1,))
    assert not hasattr(peer.membership, "came")


@pytest.mark.parametrize("case", ["stranger", "other lineage", "not concluded", "not served", "state installed since",
                                  "tables installed since", "no last round"])
def test_a_late_name_that_cannot_be_taken_leaves_theta_as_it_was(case):
    spec, e = engine("sparseloco")
    (n1, p1, s1), (n2, p2, s2) = two_groups(spec, e)
    base = e.params_hash()
    last = concluded(spec, e, {n1: s1})
    known, serves, source, at = {"x"}, {"x": {n2: p2}}, base, ROUND + 1
    grant = None
    if case == "stranger":
        known, grant = set(), 0.0  # the budget for strangers spent
    elif case == "other lineage":
        source = "f" * 16
    elif case == "not concluded":
        at = ROUND  # still merging: a start vote lost after would withdraw what it says of the θ
    elif case == "not served":
        serves = {}
    elif case == "state installed since":
        last.after_hash = "0" * 16
    elif case == "tables installed since":  # a table split's repair: the same θ, another member's tables
        e.install(e.theta, e.round, standing={**e.standing, "x": 3})
    peer = member(spec, e, serves, [_record("x", at, ROUND, n2, source=source)], known, grant)
    before = e.params_hash()
    assert union.take_named_sets(peer, None if case == "no last round" else last) == 0
    assert e.params_hash() == before and union.announce(last, e)[1] in ((n1,), ())
    assert peer.gatherer.asked == ([("x", n2)] if case == "not served" else [])


def test_senders_of_a_late_set_came_a_merge_waits_for_them_again_and_they_are_no_strangers():
    """A merge that gave up on an honest slower group struck its peers; their payloads in a set taken late
    count as an appearance (peer/round/no_show_views.py ``came_late``): a single strike's skip ends."""
    m = RealMembership(dht=None, spec=LIVE_SPEC, peer_id="me", progress=lambda: None, stop=threading.Event())
    m.missed({"b1", "b2"}, 10)
    assert {"b1", "b2"} <= m.no_shows and m.wait_budget.stranger("b1")
    m.came_late(10, {"b1", "me"})
    assert "b1" not in m.no_shows and "b2" in m.no_shows
    assert not m.wait_budget.stranger("b1") and "b1" in m.known()
