"""Pipeline chains: the memory estimate, chain formation, stage ownership, and chain records."""

from __future__ import annotations

import functools
import random

import msgpack
import pytest
import torch

from protocol import PROTOCOL_VERSION
from protocol.model.capacity import (
    block_activation_values,
    estimate,
    fits_full_replica,
    head_activation_values,
    layer_bytes,
    link_state_bytes,
    max_blocks,
    replica_bytes,
    stage_bytes,
)
from protocol.chain.formation import form_chains, plan_chain
from protocol.chain.records import (
    CandidateRecord,
    ChainAssignment,
    ChainError,
    latest_assignments,
    parse_assignment,
    parse_candidate,
)
from protocol.chain.stages import Candidate, chain_id_for, make_chain, stage_shapes
from protocol.errors import ProtocolError
from protocol.spec import RunSpec

SPEC = RunSpec(run_id="chains").replace(model={"n_layers": 12})
X = replica_bytes(SPEC)


def cands(*fractions, prefix="p"):
    return [Candidate(f"{prefix}{i:02d}", int(X * f), 100.0) for i, f in enumerate(fractions)]


def assert_valid_chain(spec, chain, by_id, micro_batch=None):
    n = spec.model.n_layers
    assert [s.index for s in chain.stages] == list(range(len(chain.stages)))
    assert chain.stages[0].start_block == 0 and chain.stages[-1].end_block == n
    for a, b in zip(chain.stages, chain.stages[1:]):
        assert a.end_block == b.start_block
    for s in chain.stages:
        assert s.end_block - s.start_block >= 1
        assert stage_bytes(spec, s.start_block, s.end_block, micro_batch) <= by_id[s.peer_id].capacity_bytes
    assert chain.chain_id == chain_id_for(chain.ranges())
    assert_partition(spec, [(s.start_block, s.end_block) for s in chain.stages])


def assert_partition(spec, ranges):
    full = spec.param_shapes()
    owned = [stage_shapes(spec, a, b) for a, b in ranges]
    names = [name for part in owned for name in part]
    assert names == list(full)  # every tensor exactly once, in the run's order
    for part in owned:
        for name, shape in part.items():
            assert full[name] == shape


# --- capacity ----------------------------------------------------------------------------------


def test_replica_bytes_is_the_sum_of_its_terms():
    e = estimate(SPEC, 12, embed=True, head=True)
    assert e.params == SPEC.model.num_params()
    assert e.state == 16 * e.params and e.outer == 8 * e.params
    n = SPEC.data.batch_size * SPEC.model.seq_len
    assert e.activations == 4 * n * (12 * block_activation_values(SPEC) + head_activation_values(SPEC) + 2)
    assert replica_bytes(SPEC) == e.total == stage_bytes(SPEC, 0, 12)


def test_recomputed_blocks_keep_their_inputs_and_twice_one_blocks_activations():
    """inner.checkpoint_activations: a full replica's estimate, and a chain stage's, counts d a token
    for every block and 2 A_block for the one recomputed at a time; a stage still grows by exactly
    layer_bytes a block, and the published spec is the same at the default (protocol/model/capacity.py)."""
    rc = SPEC.replace(inner={"checkpoint_activations": True})
    n = SPEC.data.batch_size * SPEC.model.seq_len
    e = estimate(rc, 12, embed=True, head=True, recompute=True)
    blocks = 12 * SPEC.model.d_model + 2 * block_activation_values(SPEC)
    assert e.activations == 4 * n * (blocks + head_activation_values(SPEC) + 2)
    assert replica_bytes(rc) == e.total < replica_bytes(SPEC)
    assert stage_bytes(rc, 0, 6) < stage_bytes(SPEC, 0, 6)
    for start, end in [(0, 3), (2, 7), (5, 10)]:
        assert stage_bytes(rc, start, end + 1) - stage_bytes(rc, start, end) == layer_bytes(rc)
    assert layer_bytes(rc) < layer_bytes(SPEC)
    assert fits_full_replica(rc, replica_bytes(rc)) and not fits_full_replica(SPEC, replica_bytes(rc))
    assert estimate(rc, 0, embed=True, head=False, recompute=True).activations == 4 * n * 2
    assert SPEC.digest() == SPEC.replace(inner={"checkpoint_activations": False}).digest() != rc.digest()


def test_each_block_adds_layer_bytes_and_micro_batch_scales_activations():
    for embed in (False, True):
        for head in (False, True):
            for layers in range(1, 12):
                grow = replica_bytes(SPEC, layers + 1, embed=embed, head=head) - replica_bytes(SPEC, layers, embed=embed, head=head)
                assert grow == layer_bytes(SPEC)
    assert replica_bytes(SPEC, 3) < stage_bytes(SPEC, 0, 3) < stage_bytes(SPEC, 0, 4)
    assert stage_bytes(SPEC, 9, 12) > stage_bytes(SPEC, 3, 6)  # the head's stage holds norm + head
    assert stage_bytes(SPEC, 3, 6) == replica_bytes(SPEC, 3) + link_state_bytes(SPEC)
    small, big = estimate(SPEC, 4, embed=False, head=False, micro_batch=2), estimate(SPEC, 4, embed=False, head=False, micro_batch=8)
    assert big.activations == 4 * small.activations and big.state == small.state
    # the stages of a chain together never need less than one full replica
    assert stage_bytes(SPEC, 0, 5) + stage_bytes(SPEC, 5, 12) >= replica_bytes(SPEC)


def test_fits_full_replica_and_max_blocks_boundaries():
    assert fits_full_replica(SPEC, X) and not fits_full_replica(SPEC, X - 1)
    assert max_blocks(SPEC, X, embed=True, head=True) == 12
    one = replica_bytes(SPEC, 1) + link_state_bytes(SPEC)  # a middle stage of one block
    assert one == stage_bytes(SPEC, 4, 5)
    assert max_blocks(SPEC, one - 1, embed=False, head=False) == 0
    assert max_blocks(SPEC, one, embed=False, head=False) == 1
    assert max_blocks(SPEC, one + layer_bytes(SPEC), embed=False, head=False) == 2
    with pytest.raises(ValueError):
        replica_bytes(SPEC, 13)
    with pytest.raises(ValueError):
        replica_bytes(SPEC, micro_batch=0)
    with pytest.raises(ValueError):
        stage_bytes(SPEC, 3, 3)


def test_activation_estimate_covers_what_autograd_saves():
    """Saved-tensor hooks count every tensor a block and the head keep for backward."""
    from peer.training.model import Model

    spec = RunSpec(run_id="act").replace(
        model=dict(d_model=64, n_heads=4, ffn_hidden=176, seq_len=32, n_layers=1, vocab_size=300), data={"batch_size": 2}
    )
    model = Model(spec.model)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    B, T = 2, spec.model.seq_len

    def saved_values(fn):
        seen = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return sum(seen.values()) / (4 * B * T)

    h = torch.randn(B, T, spec.model.d_model, requires_grad=True)
    tok = torch.randint(0, spec.model.vocab_size, (B, T))
    block = saved_values(lambda: model.forward_blocks(h, 0, 1))
    head = saved_values(lambda: model.forward_head(h, tok))
    assert block <= block_activation_values(spec)
    assert head <= head_activation_values(spec)


# --- stage ownership ---------------------------------------------------------------------------


@pytest.mark.parametrize("slices, attention", [(1, False), (2, False), (4, True)])
def test_stage_shapes_partition_the_model(slices, attention):
    spec = SPEC.replace(partial={"slices": slices, "attention": attention})
    for ranges in ([(0, 12)], [(0, 1), (1, 12)], [(0, 5), (5, 6), (6, 11), (11, 12)], [(i, i + 1) for i in range(12)]):
        assert_partition(spec, ranges)
    first, last = stage_shapes(spec, 0, 2), stage_shapes(spec, 10, 12)
    assert "embed.weight" in first and "head.weight" not in first and "norm.weight" not in first
    assert "head.weight" in last and "norm.weight" in last and "embed.weight" not in last
    with pytest.raises(ValueError):
        stage_shapes(spec, 4, 13)


# --- formation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("divisor, stages", [(1.5, 2), (2.5, 3), (3.5, 4)])
def test_capacities_that_need_2_3_and_4_stages(divisor, stages):
    pool = cands(*[1 / divisor] * 9)
    chains, waiting = form_chains(SPEC, pool)
    by_id = {c.peer_id: c for c in pool}
    assert len(chains) == 9 // stages
    assert all(len(c.stages) == stages for c in chains)
    assert len(waiting) == 9 - stages * len(chains)
    assert sorted(waiting + [m for c in chains for m in c.members]) == sorted(by_id)
    for chain in chains:
        assert_valid_chain(SPEC, chain, by_id)
        # equal capacities: equal splits, up to one block
        sizes = [s.blocks for s in chain.stages]
        assert max(sizes) - min(sizes) <= 1


def test_blocks_are_split_in_proportion_to_capacity():
    spec = SPEC.replace(model={"n_layers": 24})
    x = replica_bytes(spec)
    pool = [Candidate("big", int(0.9 * x), 1.0), Candidate("mid", int(0.6 * x), 1.0), Candidate("small", int(0.3 * x), 1.0)]
    chain = plan_chain(spec, pool)
    assert_valid_chain(spec, chain, {c.peer_id: c for c in pool})
    total = sum(c.capacity_bytes for c in pool)
    for stage in chain.stages:
        cap = next(c.capacity_bytes for c in pool if c.peer_id == stage.peer_id)
        assert abs(stage.blocks - 24 * cap / total) <= 1
    # the largest member holds the head, the second largest the embedding
    assert chain.members == ["mid", "small", "big"]


def test_a_member_never_gets_more_blocks_than_fit():
    # a large vocabulary: the head's logits take much of the last stage's memory, so an equal
    # share of the blocks by capacity would not fit there
    spec = SPEC.replace(model={"vocab_size": 32000})
    share = replica_bytes(spec) * 3 // 4
    pool = [Candidate("a", share, 1.0), Candidate("b", share, 1.0)]
    chain = plan_chain(spec, pool)
    assert_valid_chain(spec, chain, {c.peer_id: c for c in pool})
    first, last = chain.stages
    assert last.blocks == max_blocks(spec, share, embed=False, head=True) < 6 < first.blocks


def test_mixed_pool_prefers_more_chains_then_fewer_stages():
    # the two big peers each need a small partner: pairing them together would strand the rest
    pool = cands(0.9, 0.9, 0.25, 0.25)
    chains, waiting = form_chains(SPEC, pool)
    assert len(chains) == 2 and waiting == []
    assert all(len(c.stages) == 2 for c in chains)
    # one peer alone a full replica: a one-stage chain
    chains, waiting = form_chains(SPEC, cands(1.2, 0.6, 0.6))
    assert sorted(len(c.stages) for c in chains) == [1, 2] and waiting == []


def test_matches_an_exhaustive_search_on_small_pools():
    spec = SPEC

    def optimum(pool):
        n = len(pool)
        ok = {m: plan_chain(spec, [pool[i] for i in range(n) if m >> i & 1]) is not None for m in range(1, 1 << n)}

        @functools.lru_cache(None)
        def best(mask):
            if not mask:
                return (0, 0)
            low = mask & -mask
            rest = mask & ~low
            result = best(rest)
            sub = rest
            while True:
                if ok[sub | low]:
                    count, stages = best(rest & ~sub)
                    result = max(result, (count + 1, stages - bin(sub | low).count("1")))
                if not sub:
                    break
                sub = (sub - 1) & rest
            return result

        return best((1 << n) - 1)

    rng = random.Random(7)
    worse = 0
    for trial in range(40):
        pool = cands(*[rng.uniform(0.12, 0.9) for _ in range(rng.randint(2, 7))], prefix=f"t{trial}-")
        chains, _ = form_chains(spec, pool)
        count, neg_stages = optimum(pool)
        assert len(chains) <= count
        worse += (len(chains), -sum(len(c.stages) for c in chains)) < (count, neg_stages)
    assert worse <= 2


def test_formation_is_deterministic():
    rng = random.Random(3)
    pool = cands(*[rng.uniform(0.1, 0.8) for _ in range(40)])
    chains, waiting = form_chains(SPEC, pool)
    assert chains and len({m for c in chains for m in c.members}) == sum(len(c.stages) for c in chains)
    for seed in range(3):
        shuffled = pool[:]
        random.Random(seed).shuffle(shuffled)
        again, waiting_again = form_chains(SPEC, shuffled)
        assert [(c.chain_id, c.ranges()) for c in again] == [(c.chain_id, c.ranges()) for c in chains]
        assert waiting_again == waiting
    by_id = {c.peer_id: c for c in pool}
    for chain in chains:
        assert_valid_chain(SPEC, chain, by_id)


def test_waiting_candidates():
    assert form_chains(SPEC, []) == ([], [])
    tiny = Candidate("tiny", stage_bytes(SPEC, 4, 5) - 1, 10.0)  # cannot hold one block
    chains, waiting = form_chains(SPEC, cands(0.6, 0.6) + [tiny])
    assert len(chains) == 1 and waiting == ["tiny"]
    # three 0.3 peers are not one replica: all wait
    chains, waiting = form_chains(SPEC, cands(0.3, 0.3, 0.3))
    assert chains == [] and sorted(waiting) == ["p00", "p01", "p02"]
    # enough capacity in total, but not within max_stages
    chains, waiting = form_chains(SPEC, cands(*[0.2] * 8), max_stages=4)
    assert chains == [] and len(waiting) == 8
    chains, _ = form_chains(SPEC, cands(*[0.2] * 8), max_stages=8)
    assert len(chains) == 1 and len(chains[0].stages) <= 8


def test_micro_batch_changes_what_fits():
    pool = cands(0.15, 0.15)
    assert form_chains(SPEC, pool)[0] == []
    assert not fits_full_replica(SPEC, pool[0].capacity_bytes, micro_batch=2)
    chains, waiting = form_chains(SPEC, pool, micro_batch=2)  # an eighth of the activations
    assert len(chains) == 1 and len(chains[0].stages) == 2 and waiting == []
    assert_valid_chain(SPEC, chains[0], {c.peer_id: c for c in pool}, micro_batch=2)


def test_bad_candidate_lists():
    with pytest.raises(ValueError):
        form_chains(SPEC, cands(0.6) + cands(0.6))  # the same id twice
    with pytest.raises(TypeError):
        form_chains(SPEC, [("p", 1, 1.0)])
    with pytest.raises(ValueError):
        form_chains(SPEC, cands(0.6), max_stages=0)
    for bad in (Candidate("", 10, 1.0), Candidate("p", 1.5e9, 1.0), Candidate("p", True, 1.0)):
        with pytest.raises(ValueError):
            form_chains(SPEC, [bad])


def test_formation_scales_to_hundreds_of_candidates():
    rng = random.Random(11)
    pool = cands(*[rng.uniform(0.15, 0.7) for _ in range(300)])
    chains, waiting = form_chains(SPEC, pool)
    capacity_bound = sum(c.capacity_bytes for c in pool) // X
    assert len(chains) >= 0.8 * capacity_bound
    assert len(waiting) + sum(len(c.stages) for c in chains) == 300


# --- records -----------------------------------------------------------------------------------


def test_candidate_record_round_trip():
    rec = CandidateRecord(SPEC.digest(), int(X * 0.4), 250.5, "waiting")
    for raw in (rec.to_dict(), rec.to_bytes()):
        assert parse_candidate(raw, SPEC) == rec
    assert rec.candidate("peer-a") == Candidate("peer-a", int(X * 0.4), 250.5)
    assert parse_candidate({**rec.to_dict(), "bandwidth": 100}).bandwidth == 100.0


@pytest.mark.parametrize(
    "change",
    [
        {"capacity": 0},
        {"capacity": -5},
        {"capacity": 1.5},
        {"capacity": True},
        {"capacity": 1 << 63},
        {"bandwidth": float("nan")},
        {"bandwidth": float("inf")},
        {"bandwidth": -1.0},
        {"bandwidth": "fast"},
        {"bandwidth": False},
        {"state": "sleeping"},
        {"state": 3},
        {"spec": ""},
        {"spec": "x" * 65},
        {"spec": "0123456789abcdef"},  # another run
        {"v": PROTOCOL_VERSION + 1},
        {"v": True},
        {"extra": 1},
    ],
)
def test_candidate_record_rejects(change):
    raw = {**CandidateRecord(SPEC.digest(), 1000, 10.0, "waiting").to_dict(), **change}
    with pytest.raises(ChainError):
        parse_candidate(raw, SPEC)


def test_candidate_record_rejects_malformed_containers():
    good = CandidateRecord(SPEC.digest(), 1000, 10.0, "waiting")
    for bad in (None, 5, [], "x", b"\xc1", b"\x93\x01\x02\x03", good.to_bytes()[:-1], good.to_bytes() + b"\x00", b"\x00" * (1 << 15)):
        with pytest.raises(ProtocolError):
            parse_candidate(bad)
    missing = good.to_dict()
    del missing["state"]
    with pytest.raises(ChainError, match="exactly the fields"):
        parse_candidate(missing)


def assignment(ranges, epoch=3):
    return ChainAssignment(SPEC.digest(), epoch, make_chain(ranges))


def test_assignment_round_trip_and_id():
    a = assignment([("a", 0, 5), ("b", 5, 9), ("c", 9, 12)])
    for raw in (a.to_dict(), a.to_bytes()):
        parsed = parse_assignment(raw, SPEC)
        assert parsed == a and parsed.chain.stage_of("b").start_block == 5
    # the id depends on members, order and ranges
    assert make_chain([("a", 0, 6), ("b", 6, 12)]).chain_id != make_chain([("a", 0, 5), ("b", 5, 12)]).chain_id
    assert make_chain([("a", 0, 6), ("b", 6, 12)]).chain_id != make_chain([("b", 0, 6), ("a", 6, 12)]).chain_id


@pytest.mark.parametrize(
    "stages, match",
    [
        ([["a", 0, 5], ["b", 6, 12]], "starting at 5"),  # a gap
        ([["a", 0, 6], ["b", 5, 12]], "starting at 6"),  # an overlap
        ([["a", 1, 12]], "starting at 0"),
        ([["a", 0, 5], ["b", 5, 11]], "not at n_layers"),
        ([["a", 0, 5], ["b", 5, 5], ["c", 5, 12]], "non-empty"),
        ([["a", 0, 5], ["a", 5, 12]], "more than one stage"),
        ([["a", 0, 13]], "end block"),
        ([["a", -1, 12]], "start block"),
        ([["a", 0, 5.0]], "end block"),
        ([["a", 0]], r"\[peer id"),
        ([[7, 0, 12]], "peer id"),
        ([["", 0, 12]], "peer id"),
        ([["x" * 200, 0, 12]], "peer id"),
        ([], "1 to"),
        ([[f"p{i}", i, i + 1] for i in range(12)] + [["q", 12, 12]], "1 to"),
        ("a", "1 to"),
    ],
)
def test_assignment_rejects_bad_stages(stages, match):
    raw = {**assignment([("a", 0, 12)]).to_dict(), "stages": stages}
    raw["chain"] = "ch-0000000000000000"
    with pytest.raises(ChainError, match=match):
        parse_assignment(raw, SPEC)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"chain": "ch-0123456789abcdef"}, "does not match"),
        ({"epoch": -1}, "epoch"),
        ({"epoch": "1"}, "epoch"),
        ({"spec": "0123456789abcdef"}, "run spec"),
        ({"v": 0}, "version"),
        ({"chain": 5}, "chain id"),
    ],
)
def test_assignment_rejects_bad_header(change, match):
    raw = {**assignment([("a", 0, 6), ("b", 6, 12)]).to_dict(), **change}
    with pytest.raises(ChainError, match=match):
        parse_assignment(raw, SPEC)
    with pytest.raises(ChainError):
        parse_assignment(msgpack.packb([1, 2, 3]), SPEC)


def test_newer_assignments_supersede_older_ones():
    old = assignment([("a", 0, 6), ("b", 6, 12)], epoch=1)
    other = assignment([("c", 0, 6), ("d", 6, 12)], epoch=1)
    new = assignment([("a", 0, 4), ("e", 4, 12)], epoch=2)
    latest = latest_assignments([old, other, new])
    assert latest["a"] is new and latest["e"] is new and latest["c"] is other
    assert "b" not in latest  # its chain lost a member to a newer one: b waits for a new assignment
    assert latest_assignments([new, old]) == latest_assignments([old, new])


@pytest.mark.parametrize("endpoint, ok", [
    ("127.0.0.1:4100", True), ("peer-3.example.org:65535", True), ("[::1]:9", True), ("", True),
    ("127.0.0.1", False), ("127.0.0.1:0", False), ("127.0.0.1:70000", False), ("a b:1", False), ("x" * 300 + ":1", False),
    # a short list of endpoints (protocol/chain/endpoints.py)
    ("10.7.0.2:4100,[2001:db8::5]:4100", True), (",".join(["10.0.0.1:5"] * 4), True),
    (",".join(["10.0.0.1:5"] * 5), False), ("10.7.0.2:4100,", False), ("10.7.0.2:4100,a b:1", False),
    # hosts no socket can dial: the pattern passed them and the stage that dialed one raised UnicodeError
    ("a..b:4000", False), ("x" * 64 + ":4000", False), (".:1", False), ("h:4000\n", False), ("-a.org:1", False),
    ("x" * 63 + ".org:4000", True),
])
def test_candidate_endpoint_is_host_and_port(endpoint, ok):
    raw = CandidateRecord(SPEC.digest(), 1000, 10.0, "waiting", endpoint).to_dict()
    if ok:
        assert parse_candidate(raw, SPEC).endpoint == endpoint
    else:
        with pytest.raises(ChainError):
            parse_candidate(raw, SPEC)
