"""A set of the last round that arrives after the round ended joins its union (peer/round/union.py):
concluding the round again from the larger union gives the same bits as concluding it with every
set the first time (RoundEngine.redo), and a member that lacked a set ends on its groupmates' θ."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from peer.outer.engine import RoundEngine
from peer.outer.strategies import make_strategy
from peer.round import union
from peer.round.report import RoundRecord
from protocol.group_sets import pack_set, set_digest
from protocol.timing import Timing
from tests.protocol.test_group_sets import agreed_set
from tests.round.test_group_merge import record
from tests.support.agreement_sim import MAX_PAYLOAD, RUN, signer
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
    local = {k: v.clone() for k, v in partial.strategy.local_state().items()}
    partial.conclude(partial.decode(s1)[0], None, delivered=False)
    assert partial.params_hash() != full.params_hash()  # one set short: another θ
    partial.redo(snap, partial.decode_at(every, ROUND)[0])
    assert partial.round == full.round == ROUND + 1 and partial.params_hash() == full.params_hash()
    for k, v in full.strategy.shared_state().items():  # DiLoCo's outer momentum too
        assert torch.equal(v, partial.strategy.shared_state()[k])
    assert all(torch.equal(v, partial.strategy.local_state()[k]) for k, v in local.items())  # not settled again


class Gatherer:
    run_digest, max_payload_bytes = RUN, MAX_PAYLOAD

    def __init__(self, serves):
        self.serves, self.asked = serves, []

    def fetch_set(self, peer, digest, timeout):
        self.asked.append((peer, digest))
        return self.serves.get(peer, {}).get(digest)


def member(spec, e, views, serves):
    membership = SimpleNamespace(view=lambda: views, timing=Timing.from_spec(spec))
    return SimpleNamespace(engine=e, membership=membership, gatherer=Gatherer(serves), spec=spec, peer_id="me",
                           role=SimpleNamespace(progress_part=-1), totals=SimpleNamespace(history=[]))


def test_a_member_that_lacked_a_set_of_the_last_round_takes_it_and_ends_on_the_groups_theta():
    spec, full = engine("diloco")
    _, e = engine("diloco")
    (n1, p1, s1), (n2, p2, s2) = two_groups(spec, full)
    full.conclude(full.decode({**s1, **s2})[0], None, delivered=False)
    last = union.LastRound(ROUND, e.snapshot(), {n1: s1})
    e.conclude(e.decode(s1)[0], None, delivered=False)
    last.after_hash = e.params_hash()
    views = [record("x", gathered_before=n2, gathered_round=ROUND + 1, round_no=ROUND + 1)]
    peer = member(spec, e, views, {"x": {n2: p2}})
    peer.totals.history.append(RoundRecord(round=ROUND + 1, params_hash=e.params_hash(), group=["me"], contributors=2,
                                           excluded={}, bytes_sent=0, bytes_received=0, loss=0.0, val_loss=0.0,
                                           seconds=0.0))
    assert union.repair(peer, last)
    assert e.params_hash() == full.params_hash() == last.after_hash == peer.totals.history[-1].params_hash
    assert peer.totals.history[-1].sets == 2 and peer.totals.history[-1].contributors == 4
    assert not union.repair(peer, last)  # nothing more to take: nothing fetched again
    assert peer.gatherer.asked == [("x", n2)]


@pytest.mark.parametrize("case", ["state installed since", "set not served", "nothing named", "another round"])
def test_a_round_that_cannot_be_repaired_stays_as_it_was(case):
    spec, e = engine("diloco")
    (n1, p1, s1), (n2, p2, s2) = two_groups(spec, e)
    last = union.LastRound(ROUND, e.snapshot(), {n1: s1})
    e.conclude(e.decode(s1)[0], None, delivered=False)
    last.after_hash = e.params_hash()
    views = [record("x", gathered=n2)]
    serves = {"x": {n2: p2}}
    if case == "state installed since":
        last.after_hash = "0" * 16
    elif case == "set not served":
        serves = {}
    elif case == "nothing named":
        views = [record("x", gathered=n1)]
    else:
        last.round = ROUND - 1
    before = e.params_hash()
    assert not union.repair(member(spec, e, views, serves), last)
    assert e.params_hash() == before
