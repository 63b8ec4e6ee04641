"""The union of a round's sets, agreed by the next round's group (peer/round/union.py): concluding the
round again from the larger union gives the same bits as concluding it with every set the first
time (RoundEngine.redo), a member that lacked a set the group took ends on the group's θ, and one
that cannot take it keeps θ and does not count as holding the group's start."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from peer.outer.engine import RoundEngine
from peer.outer.strategies import make_strategy
from peer.round import union
from peer.exchange.results import GatherResult
from peer.round.report import RoundRecord
from protocol.round.group_sets import empty_set_name, pack_set, set_digest, set_name
from protocol.round.timing import Timing
from tests.protocol.test_group_sets import agreed_set
from tests.support.agreement_sim import MAX_PAYLOAD, RUN, binding_of, signer
from tests.outer.test_round_engine import SPEC, trained
from hivemind.p2p import PeerID

ROUND = 7  # tests/protocol/test_group_sets.py's round


def b58(key) -> str:
    return PeerID(key).to_base58()


def engine(strategy):
    spec = SPEC.replace(outer={"strategy": strategy})
    gen = torch.Generator().manual_seed(0)
    theta = {name: torch.randn(shape, generator=gen) for name, shape in spec.param_shapes().items()}
    return spec, RoundEngine(make_strategy(spec), theta, round_no=ROUND)


def two_groups(spec, e: RoundEngine):
    """Two groups' sets of round ROUND, with real payloads: (name, packed, sender -> payload) each."""
    sets = []
    for first, gid in ((0, b"g1"), (2, b"g2")):
        keys = [signer(i) for i in range(first, first + 2)]
        payloads = {k.peer_id: e.encode(e.theta, trained(e.theta, seed=first + i))[0] for i, k in enumerate(keys)}
        binding, envelopes, payloads = agreed_set(first, 2, group_id=gid, payloads=payloads)
        sets.append((set_digest(binding.context, payloads), pack_set(binding, envelopes),
                     {b58(o): p for o, p in payloads.items()}))
    return sets


@pytest.mark.parametrize("strategy", ["diloco", "sparseloco"])
def test_redo_from_a_larger_union_gives_the_bits_of_concluding_with_it_first(strategy):
    spec, full = engine(strategy)
    _, partial = engine(strategy)
    (n1, _, s1), (n2, _, s2) = two_groups(spec, full)
    every = {**s1, **s2}
    full.conclude(full.decode(every)[0], None, delivered=False)
    snap = partial.snapshot()
class Gatherer:
    run_digest, max_payload_bytes = RUN, MAX_PAYLOAD

    def __init__(self, serves):
        self.serves, self.asked = serves, []

    def fetch_set(self, peer, digest, timeout):
        self.asked.append((peer, digest))
        return self.serves.get(peer, {}).get(digest)

    def keep_checked_set(self, peer, digest):
        pass


def member(spec, e, serves):
    membership = SimpleNamespace(timing=Timing.from_spec(spec))
    return SimpleNamespace(engine=e, membership=membership, gatherer=Gatherer(serves), spec=spec, peer_id="me",
                           totals=SimpleNamespace(history=[]))


def gathered(last_sets, starts, payloads=None):
    """This round's GatherResult as far as the union reads it: every member announced ``last_sets``."""
    return GatherResult(group=sorted(starts), payloads=payloads or {m: b"p" for m in starts}, excluded={},
                        start_hashes=starts, last_sets=last_sets)


def concluded(spec, e, sets):
    """``e`` concluded round ROUND from ``sets`` (name -> sender -> payload): the LastRound it keeps."""
    last = union.LastRound(ROUND, e.snapshot(), dict(sets), base=e.params_hash())
    payloads = {s: p for named in sets.values() for s, p in named.items()}
    e.conclude(e.decode(payloads)[0], None, delivered=False)
    last.settle(e)
    return last


def test_a_member_whose_group_held_a_set_it_lacked_takes_it_and_ends_on_the_groups_theta():
    spec, full = engine("diloco")
    _, e = engine("diloco")
    (n1, p1, s1), (n2, p2, s2) = two_groups(spec, full)
    base = full.params_hash()
    held = concluded(spec, full, {n1: s1, n2: s2})
    last = concluded(spec, e, {n1: s1})
    assert union.announce(last, e) == (base, (n1,))
    peer = member(spec, e, {"x": {n2: p2}})
    peer.totals.history.append(RoundRecord(round=ROUND + 1, params_hash=e.params_hash(), group=["me"], contributors=2,
                                           excluded={}, bytes_sent=0, bytes_received=0, loss=0.0, val_loss=0.0,
                                           seconds=0.0))
    starts = {"me": last.after_hash, "x": held.after_hash, "y": held.after_hash}
    taken = union.take_group_union(peer, last, gathered(
        {"me": (base, (n1,)), "x": (base, (n1, n2)), "y": (base, (n1, n2))}, starts))
    assert taken.holds and taken.taken == 1
    assert taken.keys == {"me": full.params_hash(), "x": full.params_hash(), "y": full.params_hash()}
    assert e.params_hash() == full.params_hash() == last.after_hash == peer.totals.history[-1].params_hash
    assert peer.totals.history[-1].sets == 2 and peer.totals.history[-1].contributors == 4
    assert peer.gatherer.asked == [("x", n2)]
    assert union.announce(last, e) == (base, tuple(sorted((n1, n2))))


@pytest.mark.parametrize("case", ["not served", "one lister not serving", "state installed since",
                                  "tables installed since", "no base"])
def test_a_union_that_cannot_be_taken_leaves_theta_as_it_was(case):
    spec, e = engine("sparseloco")
    (n1, p1, s1), (n2, p2, s2) = two_groups(spec, e)
    base = e.params_hash()
    last = concluded(spec, e, {n1: s1})
    serves = {"x": {n2: p2}, "y": {n2: p2}}
    last_sets = {"me": (base, (n1,)), "x": (base, (n1, n2)), "y": (base, (n1, n2))}
    if case == "not served":
        serves = {}
    elif case == "one lister not serving":
        last_sets["y"] = (base, (n1,))
        serves = {}
    elif case == "state installed since":
        last.after_hash = "0" * 16
    elif case == "tables installed since":  # a table split's repair: the same θ, another member's tables
        e.install(e.theta, e.round, standing={**e.standing, "x": 3})
        assert union.announce(last, e) == ("", ())
    else:
        last_sets["me"] = ("", ())
    before = e.params_hash()
    taken = union.take_group_union(member(spec, e, serves), last, gathered(last_sets, {m: before for m in last_sets}))
    assert e.params_hash() == before
    # a member that lacks a set the group took, and could not take it, does not hold what its key names;
    # a set that only one member announced and did not serve is left out, by every member alike
    assert taken.holds == (case in ("one lister not serving", "no base"))


def test_a_set_without_a_payload_joins_the_union_without_concluding_the_round_again():
    """A group whose members sent nothing this round (with K, none of them may send) names the round's
    empty set: a member that lacked it takes it into the union without fetching it, and θ stays the
    bits it was."""
    spec, e = engine("diloco")
    (n1, p1, s1), _ = two_groups(spec, e)
    base = e.params_hash()
    last = concluded(spec, e, {n1: s1})
    binding = binding_of([signer(i).peer_id for i in (5, 6)], round_no=ROUND, group_id=b"g3")
    n3, p3 = set_name(binding, {}), pack_set(binding, {})
    before = e.params_hash()
    peer = member(spec, e, {"x": {n3: p3}})
    peer.totals.history.append(RoundRecord(round=ROUND + 1, params_hash=before, group=["me"], contributors=2,
                                           excluded={}, bytes_sent=0, bytes_received=0, loss=0.0, val_loss=0.0,
                                           seconds=0.0))
    e.redo = None  # concluding the round again would fail here
    last_sets = {"me": (base, (n1,)), "x": (base, tuple(sorted((n1, n3))))}
    taken = union.take_group_union(peer, last, gathered(last_sets, {"me": before, "x": before}))
    assert peer.gatherer.asked == [] and taken.taken == 1  # known empty by its name
    assert e.params_hash() == before == last.after_hash and taken.holds
    assert union.announce(last, e) == (base, tuple(sorted((n1, n3)))) and peer.totals.history[-1].sets == 2


def test_the_rounds_empty_set_is_taken_where_nobody_that_announced_it_serves():
    """A client-mode member that announced the round's empty set serves nothing, so the union's repair
    has no one to ask: the set comes all the same (known by its name), whole or as its list."""
    spec, e = engine("diloco")
    peer = member(spec, e, {})
    name = empty_set_name(RUN, ROUND)
    got, lists = {}, {}
    assert union._fetch_into(peer, ROUND, name, [], time.monotonic() + 1.0, got, None) and got == {name: {}}
    assert union._fetch_into(peer, ROUND, name, [], time.monotonic() + 1.0, {}, lists) and lists[name].entries == {}
    assert peer.gatherer.asked == []
