"""A round that takes at most K contributions a part waits only for the peers that may send: the
barrier (peer/round/membership.py) and the merge (peer/round/merge.py) pass over a peer still training
whose payload the round's draw would pass over, with a scripted view and a fake clock; the predicate
itself comes from the lineage's tables (peer/round/draw.py ``awaited``)."""

from __future__ import annotations

import dataclasses
import threading
import time
from types import SimpleNamespace

import torch

from peer.outer.engine import RoundEngine
from peer.outer.strategies import make_strategy
from peer.round import draw
from peer.round.membership import Membership
from peer.round.merge import merge_round
from peer.training.roles import Role
from protocol.round import eligibility
from protocol.round.eligibility import ONE
from tests.conftest import Clock  # noqa: F401
from tests.protocol.test_group_sets import ROUND
from tests.round.test_group_merge import Swarm, a_group, member_of, record
from tests.round.test_liveness import SPEC, view


def membership(monkeypatch, clock, script) -> Membership:
    """A Membership whose view t seconds after it was made is ``script(t)``; a straggler allowance of 10 s."""
    m = Membership(dht=None, spec=SPEC, peer_id="me", progress=lambda: None, stop=threading.Event())
    m.train_seconds = 20.0
    t0 = clock.now
    monkeypatch.setattr(m, "view", lambda: script(clock.now - t0))
    return m


def late_group(states, named_at_once=False):
    """Our group of 3 has gathered; another group (one peer per entry of ``states``: what its records
    say for three reads, before they name their set) comes late. (its peers, the swarm, a call of
    ``merge_round`` with the given keywords). ``named_at_once``: the set is named from the first read."""
    mine, theirs = a_group(0, 3, b"g1"), a_group(3, len(states), b"g2")
    others = sorted(theirs[2])
    named = [record(p, gathered=theirs[1]) for p in others]
    coming = [record(p, state=state) for p, state in zip(others, states)]
    swarm = Swarm([named] if named_at_once else [coming] * 3 + [named], {others[0]: {theirs[1]: theirs[0]}},
                  allowance=5.0)
    peer, result = member_of(swarm, mine)
    return others, swarm, lambda **kw: merge_round(peer, ROUND, result, ready=[], **kw)


def only(*names):
    return lambda peer, progress: peer in names


def test_the_barrier_waits_for_peers_that_may_send_and_for_last_rounds_mates_only(monkeypatch, clock):
    # "a" may send, "b" may not: both train on; "m", a mate of our last group, may not send either
    script = lambda t: [view("me", 5, "ready"), view("a", 5, "ready" if t >= 2.0 else "training"),
                        view("b", 5, "training"), view("m", 5, "ready" if t >= 3.0 else "training")]
    m = membership(monkeypatch, clock, script)
    t0 = clock.now
    barrier = m.wait_for_round(5, {"m"}, first_round=False, awaited=only("a"))
    assert 3.0 <= clock.now - t0 < 4.0  # "m" came at 3 s; "b", still training, was not waited for
    assert barrier.ready == {"a", "m"} and barrier.gave_up == frozenset() and not m.no_shows
    # without the test (K = 0), "b" is waited for, the straggler allowance past the last arrival
    m = membership(monkeypatch, clock, script)
    t0 = clock.now
    barrier = m.wait_for_round(5, {"m"}, first_round=False)
    assert clock.now - t0 >= 3.0 + m.straggler_allowance() and barrier.gave_up == {"b"}


def test_the_merge_does_not_wait_for_a_peer_that_may_not_send_but_takes_its_set_if_named():
    # the other group still trains: peers that may send (two: enough for a group) are waited for until
    # their set is named ...
    others, _, merge = late_group(["training"] * 3)
    assert merge(awaited=only(*others[:2])).sets == 2
    # ... peers that may not send are not: the merge ends at once, with our set alone
    _, swarm, merge = late_group(["training"] * 3)
    t0 = time.monotonic()
    merged = merge(awaited=only())
    assert merged.sets == 1 and time.monotonic() - t0 < 1.0 and not swarm.no_shows
    # a set such peers named in time is still merged
    _, _, merge = late_group(["training"] * 3, named_at_once=True)
    assert merge(awaited=only()).sets == 2


def test_the_predicate_is_the_lineages_eligibility_and_none_without_k():
    spec_k = SPEC.replace(outer={"strategy": "sparseloco", "max_contributions": 2})
    gen = torch.Generator().manual_seed(0)
    theta = {name: torch.randn(shape, generator=gen) for name, shape in spec_k.param_shapes().items()}
    e = RoundEngine(make_strategy(spec_k), theta, round_no=ROUND)
    # fixed names: with fresh keys every run, no sender at all came up about once in 150 runs (CI, 2026-12-05)
    names = [f"peer{i:02d}" for i in range(60)]
    with e.lock:
        e.eligibility = {"-1": ONE // 8}
        e.standing = {n: 3 for n in names[:30]}
    test = draw.awaited(e, "ab" * 8)
    parts = {n: -1 for n in names}
    records = {n: record(n).progress for n in names}
    assert {n for n in names if test(n, records[n])} == e.senders(parts, ROUND, "ab" * 8)
    assert 0 < len(e.senders(parts, ROUND, "ab" * 8)) < 30
    assert eligibility.part_key(-1) == "-1"
    e0 = RoundEngine(make_strategy(SPEC.replace(outer={"strategy": "sparseloco"})), theta, round_no=ROUND)
    assert draw.awaited(e0, "ab" * 8) is None


def test_one_peer_that_may_send_among_peers_that_may_not_is_waited_for_their_group():
    """The merge's rule that fewer peers than make a group cannot name a set counts every peer of the
    round: one that may send, still training among three that may not, forms a group with them."""
    others, _, merge = late_group(["training"] * 4)
    assert merge(awaited=only(others[2])).sets == 2


def test_a_sender_this_peer_gave_up_on_still_keeps_the_merge_waiting_for_its_groupmates():
    """The barrier gave up on a sender still training; two peers that may not send are matchmaking.
    Before any skip of its own, the merge waited for those two (a group of them can name a set the
    sender's payload is in): it still does, though neither may send."""
    others, _, merge = late_group(["training", "exchanging", "exchanging"])
    assert merge(gave_up=[others[0]], awaited=only(others[0])).sets == 2


def test_a_barrier_that_waited_for_nobody_still_aims_for_a_pair(monkeypatch, clock):
    script = lambda t: [view("me", 5, "ready"), view("b", 5, "training")]
    m = membership(monkeypatch, clock, script)
    barrier = m.wait_for_round(5, set(), first_round=False, awaited=only())
    assert barrier.unawaited == {"b"} and barrier.gave_up == frozenset() and barrier.gather_size == 2


def test_a_chain_stages_record_is_judged_by_its_blocks_and_a_role_names_them():
    assert Role.progress_sends.fget(SimpleNamespace(part=(0, 4))) == "0:4"
    assert Role.progress_sends.fget(SimpleNamespace(part=-1)) == Role.progress_sends.fget(SimpleNamespace(part=3)) == ""
    seen = []
    engine = SimpleNamespace(round=ROUND, may_send=lambda r, base: lambda peer, part, sends: seen.append((peer, part, sends)))
    draw.awaited(engine, "ab" * 8)("x", dataclasses.replace(record("x").progress, sends="0:4"))
    assert seen == [("x", -1, "0:4")]
