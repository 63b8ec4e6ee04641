"""A round that takes at most K contributions a part, from the sets' lists (peer/round/draw.py): a
member draws the senders it would draw from every payload, fetches only the chosen ones it does
not hold, and ends on the θ of concluding with every payload in hand; a list that misstates a part
or a chosen payload nobody serves changes nothing on one member that it does not on all."""

from __future__ import annotations

from types import SimpleNamespace

import msgpack
import torch
from hivemind.p2p import PeerID

from peer.exchange.results import GatherResult
from peer.outer.engine import RoundEngine
from peer.outer.strategies import make_strategy
from peer.round import draw, union
from peer.round.draw import fetch_into
from protocol.round.group_sets import empty_set_name, entries_digest, set_digest
from protocol.round.set_manifests import PART_MISMATCH, entries_of, pack_manifest
from protocol.round.timing import Timing
from tests.outer.test_choice_engine import SPEC, trained
from tests.protocol.test_group_sets import ROUND, agreed_set
from tests.support.agreement_sim import MAX_PAYLOAD, RUN, signer

K = 2
SPEC_K = SPEC.replace(outer={"strategy": "sparseloco", "max_contributions": K})


def b58(owner: bytes) -> str:
    return PeerID(owner).to_base58()


def engine() -> RoundEngine:
    gen = torch.Generator().manual_seed(0)
    theta = {name: torch.randn(shape, generator=gen) for name, shape in SPEC_K.param_shapes().items()}
    return RoundEngine(make_strategy(SPEC_K), theta, round_no=ROUND)


class Gatherer:
    """Serves the sets ``held`` (name -> (binding, owner -> payload, owner -> envelope)) to whoever asks."""

    run_digest, max_payload_bytes = RUN, MAX_PAYLOAD

    def __init__(self, held, lists=None, envelopes=None):
        self.held, self.lists, self.members_asked = held, lists or {}, []
        self.envelopes = envelopes or {}  # the envelopes of a set whose list is served and its envelopes not

    def fetch_manifest(self, peer, digest, timeout):
        if digest in self.lists:
            return self.lists[digest]
        binding, payloads, envelopes = self.held[digest]
        return pack_manifest(binding, envelopes or self.envelopes[digest])

    def fetch_members(self, asks, timeout):
        out = []
        for peer, digest, owner in asks:
            self.members_asked.append((digest, b58(owner)))
            out.append(self.held[digest][2].get(owner) if digest in self.held else None)
        return out


def groups(e: RoundEngine, n: int = 4):
    """``n`` groups of 2 with real payloads: name -> (binding, owner -> payload, owner -> envelope)."""
    out = {}
    for g in range(n):
        keys = [signer(2 * g + i) for i in range(2)]
        payloads = {k.peer_id: e.encode(e.theta, trained(e.theta, seed=2 * g + i))[0] for i, k in enumerate(keys)}
        binding, envelopes, payloads = agreed_set(2 * g, 2, group_id=b"g%d" % g, payloads=payloads)
        out[set_digest(binding.context, payloads)] = (binding, payloads, envelopes)
    return out


def member(e: RoundEngine, gatherer) -> SimpleNamespace:
    return SimpleNamespace(engine=e, gatherer=gatherer, spec=SPEC_K, membership=SimpleNamespace(timing=Timing.from_spec(SPEC_K)),
                           peer_id="me", totals=SimpleNamespace(history=[]))


def by_name(payloads):
    return {b58(o): p for o, p in payloads.items()}


def split(sets, gatherer):
    """(our group's set held whole, the others fetched as lists) as the merge holds them."""
    mine, *others = sorted(sets)
    held, lists = {mine: by_name(sets[mine][1])}, {}
    for name in others:
        assert fetch_into(held, lists, gatherer, SPEC_K, ["x", "y"], name, ROUND, 1.0)
    return held, lists


def test_a_member_draws_from_the_lists_fetches_only_the_chosen_and_ends_on_the_theta_of_every_payload():
    full, e = engine(), engine()
    sets = groups(full)
    every = {s: p for _, payloads, _ in sets.values() for s, p in by_name(payloads).items()}
    chosen, _, passed = full.choose(every, ROUND, full.params_hash())
    full.conclude(full.decode(chosen)[0], None, delivered=False)
    gatherer = Gatherer(sets)
    held, lists = split(sets, gatherer)
    assert set(lists) == set(sets) - set(held) and lists[sorted(lists)[0]].sources == ["x", "y"]
    drawn = draw.take(member(e, gatherer), ROUND, e.params_hash(), held, lists, 5.0)
    assert sorted(drawn.payloads) == sorted(chosen) and drawn.passed == passed and not drawn.excluded
    assert drawn.senders == sorted(every)
    mine = set(next(iter(held.values())))
    assert sorted(s for _, s in gatherer.members_asked) == sorted(set(chosen) - mine)  # only the chosen, once each
    e.conclude(e.decode(drawn.payloads)[0], None, delivered=False)
    assert e.params_hash() == full.params_hash()


def misstated_list(sets, name, part):
    """A list of set ``name`` whose first entry claims ``part``, under the name that commits to it:
    what a hostile member of that group could name and serve. (the name, the packed list)"""
    binding, payloads, envelopes = sets[name]
    victim = binding.members[0]
    entries = {o: (x.digest, part if o == victim else x.part) for o, x in entries_of(payloads).items()}
    fields = msgpack.unpackb(pack_manifest(binding, envelopes), raw=False)
    fields[5] = [[o, d, (list(part) if o == victim else p), k, g] for o, d, p, k, g in fields[5]]
    return entries_digest(binding.context, entries), msgpack.packb(fields, use_bin_type=True), b58(victim)


def test_a_part_two_lists_disagree_on_is_read_from_the_payload():
    e = engine()
    sets = groups(e)
    mine, theirs = sorted(sets)[:2]
    bogus, packed, victim = misstated_list(sets, theirs, (0, 1))  # a chain stage's part, of this run
    gatherer = Gatherer({**sets, bogus: sets[theirs]}, lists={bogus: packed})
    honest, _ = split(sets, gatherer)
    _, lists = split(sets, gatherer)
    alone = draw.take(member(e, gatherer), ROUND, e.params_hash(), honest, lists, 5.0)
    assert fetch_into(honest, lists, gatherer, SPEC_K, ["x"], bogus, ROUND, 1.0)
    first = "0" * 32  # the misstating list first in the union's order, whatever its name hashes to
    lists[first], gatherer.held[first] = lists.pop(bogus), gatherer.held[bogus]
    drawn = draw.take(member(e, gatherer), ROUND, e.params_hash(), honest, lists, 5.0)
    assert (drawn.payloads, drawn.passed, drawn.excluded) == (alone.payloads, alone.passed, alone.excluded)
    assert victim in drawn.senders and not drawn.invalid


def test_a_chosen_payload_whose_part_differs_from_its_entry_is_refused_on_every_member():
    e = engine()
    sets = groups(e, 2)
    mine, theirs = sorted(sets)
    bogus, packed, victim = misstated_list(sets, theirs, (0, 1))
    gatherer = Gatherer({mine: sets[mine], bogus: sets[theirs]}, lists={bogus: packed})
    held, lists = {mine: by_name(sets[mine][1])}, {}
    assert fetch_into(held, lists, gatherer, SPEC_K, ["x"], bogus, ROUND, 1.0)
    drawn = draw.take(member(e, gatherer), ROUND, e.params_hash(), held, lists, 5.0)
    # alone in its part, it is drawn; fetched, its header says -1
    assert drawn.excluded == {victim: PART_MISMATCH} and victim not in drawn.payloads


def test_a_chosen_payload_that_nobody_serves_is_left_out():
    e = engine()
    sets = groups(e, 2)
    for attempt in range(30):  # seeds of other rounds, until the draw takes a payload of the other group
        mine, theirs = sorted(sets)
        binding, payloads, envelopes = sets[theirs]
        gatherer = Gatherer({mine: sets[mine], theirs: (binding, payloads, {})}, envelopes={theirs: envelopes})
        held, lists = {mine: by_name(sets[mine][1])}, {}
        assert fetch_into(held, lists, gatherer, SPEC_K, ["x", "y"], theirs, ROUND, 1.0)
        drawn = draw.take(member(e, gatherer), ROUND, f"{e.params_hash()}{attempt}", held, lists, 5.0)
        outside = {b58(o) for o in binding.members} - set(drawn.passed)
        if outside:
            break
    assert outside and all(drawn.excluded[s] == draw.NOT_FETCHED for s in outside)
    # each asked of its owner, its set's other member, a peer that named the set: then given up
    assert len(gatherer.members_asked) == draw.TRIES_PER_PAYLOAD * len(outside)
    assert sorted(drawn.payloads) == sorted(set(held[mine]) - set(drawn.passed))


def test_a_member_that_lacked_a_set_takes_its_list_draws_again_and_ends_on_the_groups_theta():
    full, e = engine(), engine()
    sets = groups(full, 2)
    n1, n2 = sorted(sets)
    every = {s: p for _, payloads, _ in sets.values() for s, p in by_name(payloads).items()}
    base = full.params_hash()
    chosen, _, _ = full.choose(every, ROUND, base)
    snap = full.snapshot()
    full.conclude(full.decode(chosen)[0], None, delivered=False)
    held = {n1: by_name(sets[n1][1])}
    last = union.LastRound(ROUND, e.snapshot(), dict(held), base=e.params_hash(), lists={})
    mine_only, _, _ = e.choose(held[n1], ROUND, base)
    e.conclude(e.decode(mine_only)[0], None, delivered=False)
    last.settle(e)
    assert union.announce(last, e) == (base, (n1,)) and snap[0] == ROUND
    gatherer = Gatherer(sets)
    starts = {"me": last.after_hash, "x": full.params_hash(), "y": full.params_hash()}
    result = GatherResult(group=sorted(starts), payloads={m: b"p" for m in starts}, excluded={}, start_hashes=starts,
                          last_sets={"me": (base, (n1,)), "x": (base, (n1, n2)), "y": (base, (n1, n2))})
    taken = union.take_group_union(member(e, gatherer), last, result)
    assert taken.holds and taken.taken == 1 and e.params_hash() == full.params_hash()
    assert union.announce(last, e) == (base, (n1, n2)) and set(last.lists) == {n2}
    assert {d for d, _ in gatherer.members_asked} <= {n2}  # only envelopes of the set it lacked


def test_a_member_that_cannot_fetch_a_payload_the_grown_union_drew_keeps_theta_and_does_not_hold_its_key():
    e = engine()
    for attempt in range(30):  # seeds of other rounds, until the draw takes a payload of the set it lacked
        sets = groups(e, 2)
        n1, n2 = sorted(sets)
        base = f"{e.params_hash()}{attempt}"
        every = {s: p for _, payloads, _ in sets.values() for s, p in by_name(payloads).items()}
        chosen = e.draw({s: -1 for s in every}, ROUND, base, {})[0]
        if set(chosen) - set(by_name(sets[n1][1])):
            break
    held = {n1: by_name(sets[n1][1])}
    last = union.LastRound(ROUND, e.snapshot(), dict(held), base=base, lists={})
    e.conclude(e.decode(held[n1])[0], None, delivered=False)  # 2 payloads: both, whatever the draw
    last.settle(e)
    binding, payloads, envelopes = sets[n2]
    gatherer = Gatherer({n1: sets[n1], n2: (binding, payloads, {})}, envelopes={n2: envelopes})  # its list is served, its envelopes are not
    starts = {"me": last.after_hash, "x": "f" * 16, "y": "f" * 16}
    result = GatherResult(group=sorted(starts), payloads={m: b"p" for m in starts}, excluded={}, start_hashes=starts,
                          last_sets={"me": (base, (n1,)), "x": (base, (n2,)), "y": (base, (n2,))})
    before = e.params_hash()  # nobody announced the grown union's start: only the fetch can tell
    taken = union.take_group_union(member(e, gatherer), last, result)
    assert not taken.holds and e.params_hash() == before


def test_lists_that_misstate_many_parts_make_a_member_read_at_most_k_payloads():
    e = engine()
    sets = groups(e)
    mine, *others = sorted(sets)
    bogus_lists, served = {}, dict(sets)
    for name in others:  # every payload of the other groups misstated, in lists of their own names
        binding, payloads, envelopes = sets[name]
        entries = {o: (x.digest, (0, 1)) for o, x in entries_of(payloads).items()}
        fields = msgpack.unpackb(pack_manifest(binding, envelopes), raw=False)
        fields[5] = [[o, d, [0, 1], k, g] for o, d, p, k, g in fields[5]]
        bogus = entries_digest(binding.context, entries)
        bogus_lists[bogus], served[bogus] = msgpack.packb(fields, use_bin_type=True), sets[name]
    gatherer = Gatherer(served, lists=bogus_lists)
    held, lists = split(sets, gatherer)
    for name in bogus_lists:
        assert fetch_into(held, lists, gatherer, SPEC_K, ["x"], name, ROUND, 1.0)
    drawn = draw.take(member(e, gatherer), ROUND, e.params_hash(), held, lists, 5.0)
    disagree = [s for s, why in drawn.excluded.items() if why == draw.PARTS_DISAGREE]
    assert len(disagree) == 6 - K  # 6 senders' parts in dispute, K of them read
    assert len(gatherer.members_asked) <= 2 * K  # the K read, then at most K drawn


class _NoNetwork(Gatherer):
    def fetch_manifest(self, peer, digest, timeout):
        raise AssertionError(f"the empty set {digest} was fetched")

    def fetch_set(self, peer, digest, timeout):
        raise AssertionError(f"the empty set {digest} was fetched")


def test_the_rounds_empty_set_is_taken_without_a_fetch_and_leaves_theta_as_it_is():
    """Groups none of whose members sent (most of a large swarm's, with K) all name the round's empty
    set: a member takes it, as a list or whole, without asking anyone, once however many groups named
    it, and draws and concludes as if it were not there (so the lists a peer fetches follow the groups
    that hold senders, not the swarm's size)."""
    full, e = engine(), engine()
    sets = groups(full, 2)
    every = {s: p for _, payloads, _ in sets.values() for s, p in by_name(payloads).items()}
    chosen, _, _ = full.choose(every, ROUND, full.params_hash())
    full.conclude(full.decode(chosen)[0], None, delivered=False)
    empty = empty_set_name(RUN, ROUND)
    held, lists = split(sets, Gatherer(sets))
    offline = _NoNetwork(sets)
    assert fetch_into(held, lists, offline, SPEC_K, ["a"], empty, ROUND, 1.0)
    assert fetch_into(held, lists, offline, SPEC_K, ["b"], empty, ROUND, 1.0)  # a second empty group: the same name
    assert lists[empty].entries == {} and len(lists) == len(sets)  # one more list than the other groups' sets
    whole: dict = {}
    assert fetch_into(whole, None, offline, SPEC_K, ["a"], empty, ROUND, 1.0) and whole == {empty: {}}
    drawn = draw.take(member(e, Gatherer(sets)), ROUND, e.params_hash(), held, lists, 5.0)
    assert sorted(drawn.payloads) == sorted(chosen) and not drawn.excluded
    e.conclude(e.decode(drawn.payloads)[0], None, delivered=False)
    assert e.params_hash() == full.params_hash()
