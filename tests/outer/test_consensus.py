"""The direction check (peer/outer/consensus.py, peer/outer/robust.py's ``screen``): exact sign
counts, and which contributions of a round count: milliseconds."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

import peer.outer.consensus as consensus
from peer.outer.consensus import agreement, score_contributions
from peer.outer.robust import PLAIN, PROJECTED, Contributions, robust_step, screen
from peer.outer.engine import RoundEngine
from peer.outer.strategies import make_strategy
from protocol.spec import RunSpec

SIZE = 4000


def honest(seed: int, common_seed: int = 0, density: float = 0.3, names=("w", "b"), own_noise: float = 1.5):
    """A shared direction plus a member's own noise, on a random sparse support (as top-k leaves it)."""
    own = torch.Generator().manual_seed(1000 + seed)
    out = {}
    for name in names:
        common = torch.Generator().manual_seed(common_seed * 7919 + zlib.crc32(name.encode()))  # one per tensor
        u = torch.randn(SIZE, generator=common) + own_noise * torch.randn(SIZE, generator=own)
        out[name] = u * (torch.rand(SIZE, generator=own) < density)
    return out


def noise(seed: int, density: float = 0.3, names=("w", "b")):
    g = torch.Generator().manual_seed(5000 + seed)
    return {n: torch.randn(SIZE, generator=g) * (torch.rand(SIZE, generator=g) < density) for n in names}


def brute_force(a, b):
    """A_ij and O_ij by the definition, one coordinate at a time, in Python integers."""
    counts = []
    for name in a:
        if name in b:
            agree = overlap = 0
            for x, y in zip(torch.sign(a[name]).tolist(), torch.sign(b[name]).tolist()):
                agree += int(x * y)
                overlap += int(x != 0 and y != 0)
            counts.append((agree, overlap))
    return sum(c[0] for c in counts), sum(c[1] for c in counts)


def brute_weighted(a, b):
    """(W, V) per tensor name both carry, in ``a``'s order, by the module docstring's definition: each
    side's magnitudes as integer levels of its own largest, one coordinate at a time, in Python."""
    out = []
    for name in a:
        if name in b:
            levels = []
            for t in (a[name], b[name]):
                top = max(abs(x) for x in t.tolist())
                levels.append([round(abs(x) / top * consensus.LEVELS) * (1 if x > 0 else -1 if x < 0 else 0)
                               if top else 0 for x in t.tolist()])
            out.append((sum(x * y for x, y in zip(*levels)), sum(x * x * y * y for x, y in zip(*levels))))
    return out


def stouffer(tests):
    """z of a pair by the module docstring's definition: each tensor's W / √V, added in order, over √T."""
    zs = [max(-consensus.TENSOR_Z, min(consensus.TENSOR_Z, w / math.sqrt(v))) for w, v in tests if v]
    return math.fsum(zs) / math.sqrt(len(zs)) if zs else 0.0


@pytest.mark.parametrize("density", [0.3, 0.02], ids=["dense-blocks", "sparse-blocks"])
def test_counts_are_exact_integers_whatever_the_block_size(monkeypatch, density):
    # sparse: most coordinates of a block set by nobody, which are dropped before the products
    contributions = [honest(0, density=density), honest(1, density=density), noise(2, density=density),
                     {"w": honest(3, density=density)["w"]}]  # the last carries one tensor
    want = {(i, j): brute_force(contributions[i], contributions[j]) for i in range(4) for j in range(i + 1, 4)}
    for block in (SIZE, 997, 64):
        monkeypatch.setattr(consensus, "_BLOCK", block)
        pairs = agreement(contributions)
        assert {k: (pairs.agree[k], pairs.overlap[k]) for k in pairs.agree} == want
        for (i, j) in want:
            z = stouffer(brute_weighted(contributions[i], contributions[j]))
            assert pairs.z(i, j).hex() == z.hex() == pairs.z(j, i).hex()


def test_one_tensor_whose_coordinates_move_together_cannot_outweigh_the_others():
    """A slice owner in round 0 (bench/RESULTS.md, "Per-tensor scores"): its input embedding's signs
    disagree with most others' on nearly every coordinate (one common mode, one coin flip), its other
    tensors agree as honest ones do. Pooled over coordinates the embedding sank it; each tensor one
    test, it counts. A member negated on every tensor is still refused."""
    names = ("a", "b", "c", "d", "f", "g")  # six tensors that agree as honest ones do
    members = [honest(i, names=names) for i in range(6)]
    common = torch.sign(torch.randn(SIZE, generator=torch.Generator().manual_seed(3)))
    for i, m in enumerate(members):  # "e": 20x the coordinates, one shared sign pattern (flipped for member 4),
        own = torch.Generator().manual_seed(77 + i)  # each member's own support: no two are copies
        m["e"] = torch.cat([common * (-1.0 if i == 4 else 1.0)] * 20) * (torch.rand(20 * SIZE, generator=own) < 0.3)
    members[5] = {n: -t for n, t in members[5].items()}  # negated on every tensor, "e" included
    pooled = agreement(members[:5])
    assert sum(pooled.agree[(j, 4)] for j in range(4)) / math.sqrt(sum(pooled.overlap[(j, 4)] for j in range(4))) < -3
    s = screen(members, math.inf, min_z=3.0)
    assert s.kept == [0, 1, 2, 3, 4] and list(s.excluded) == [5], s.scores
    # that one tensor of member 4 points against the others: it is left out, the rest of it counts
    assert s.dropped == {4: ["e"]} and "e" not in s.contributions[4] and set(s.contributions[4]) == set(names)


@pytest.mark.parametrize("hostile", ["negated", "noise", "elsewhere", "copy-negated"])
def test_honest_contributions_count_and_a_hostile_minority_does_not(hostile):
    members = [honest(i) for i in range(4)]
    if hostile == "negated":  # the negated pseudo-gradient of its own honest training
        bad = {n: -t for n, t in honest(9).items()}
    elif hostile == "noise":
        bad = noise(9)
    elif hostile == "elsewhere":  # honest size, on coordinates no honest member sets
        bad = {n: torch.where(t == 0, torch.randn(SIZE), torch.zeros(SIZE)) for n, t in honest(9, density=0.0).items()}
        for n in bad:
            bad[n][torch.stack([m[n] != 0 for m in members]).any(0)] = 0.0
    else:  # the exact negation of one honest member's update: it must not sink that member
        bad = {n: -t for n, t in members[0].items()}
    contributions = members + [bad]
    s = screen(contributions, math.inf, min_z=3.0)
    assert s.kept == [0, 1, 2, 3], (hostile, s.scores)
    assert list(s.excluded) == [4] and "standard deviations above chance" in s.excluded[4]
    assert all(s.scores[i] > 4 for i in range(4)) and s.scores[4] < 3


def covert(c, share: float = 0.25):
    """``c``'s signs at a tiny magnitude, its largest ``share`` of coordinates flipped and carrying its
    whole norm (bench/trust.py's ``covert``): four values a tensor, as a 2-bit codebook sends."""
    out = {}
    for name, t in c.items():
        set_ = t != 0
        top = torch.zeros_like(set_)
        top.view(-1)[torch.topk(t.abs().view(-1), int(share * int(set_.sum()))).indices] = True
        small = 1e-3 * float(t[set_].abs().mean())
        large = math.sqrt((float(t.norm()) ** 2 - small ** 2 * int((set_ & ~top).sum())) / int(top.sum()))
        out[name] = torch.where(top, -torch.sign(t) * large, torch.sign(t) * small)
    return out


def test_a_member_whose_mass_points_back_under_honest_signs_is_refused():
    """Signs alone would let it in (the shared direction's signs, its largest tenth flipped); where
    its mass points, weighed by the magnitudes both sides put there, it is against the others."""
    members = [honest(i) for i in range(4)]
    bad = covert(honest(9, own_noise=0.0), share=0.1)
    by_signs = [a / math.sqrt(o) for a, o in (brute_force({n: bad[n]}, {n: m[n]}) for m in members for n in bad)]
    assert min(by_signs) > 3  # every tensor's sign test against every member: agreement
    s = screen(members + [bad], math.inf, min_z=3.0)
    assert s.kept == [0, 1, 2, 3] and list(s.excluded) == [4], s.scores
    assert s.scores[4] < -3 and all(s.scores[i] > 4 for i in range(4))


def test_tensors_that_point_against_the_others_are_left_out_and_the_rest_counts():
    """A member negated on its two largest tensors, honest on the four others: its score counts each
    tensor as one test, so it passes; those two tensors are left out, by every member alike
    (robust.against), and its honest tensors count. Each honest tensor counts whole."""
    names = ("big1", "big2", "s1", "s2", "s3", "s4")
    members = [honest(i, names=names, own_noise=1.0) for i in range(4)]  # each tensor's z at the clamp
    bad = honest(9, names=names, own_noise=1.0)
    bad = {n: -t if n.startswith("big") else t for n, t in bad.items()}
    s = screen(members + [bad], math.inf, min_z=3.0)
    assert s.kept == [0, 1, 2, 3, 4] and s.scores[4] > 3, s.scores  # it passes the score
    assert s.dropped == {4: ["big1", "big2"]}
    assert set(s.contributions[4]) == {"s1", "s2", "s3", "s4"} and all(set(s.contributions[i]) == set(names) for i in range(4))
    assert consensus.tensor_scores(agreement(members + [bad]), 4, range(4))["big1"] == -consensus.TENSOR_Z


def test_a_refused_update_judges_no_tensor_of_the_others():
    """A negated member is refused; were it to judge, its −6 on every tensor would sink the median of
    an honest tensor on which the honest judges are split (here: "a" of member 0, judged by one honest
    member that agrees and one that disagrees). Only what still counts judges tensors."""
    names = ("a", "b", "c", "d", "f", "g")
    members = [honest(i, names=names, own_noise=1.0) for i in range(3)]
    members[2]["a"] = -members[0]["a"] * (torch.rand(SIZE, generator=torch.Generator().manual_seed(4)) < 0.5)
    bad = {n: -t for n, t in honest(9, names=names, own_noise=1.0).items()}
    pairs = agreement(members + [bad])
    assert consensus.tensor_scores(pairs, 0, [1, 2, 3])["a"] == -consensus.TENSOR_Z  # with the refused one judging: left out
    s = screen(members + [bad], math.inf, min_z=3.0)
    assert list(s.excluded) == [3] and s.kept == [0, 1, 2] and s.dropped.get(0) is None, (s.scores, s.dropped)


@pytest.mark.parametrize("n_honest, n_hostile", [(6, 3), (6, 5), (3, 2)])
def test_hostile_members_fewer_than_the_honest_are_outvoted_and_as_many_are_not_let_in(n_honest, n_hostile):
    members = [honest(i) for i in range(n_honest)]
    bad = [{n: -t for n, t in honest(20 + k).items()} for k in range(n_hostile)]  # they agree with each other
    s = screen(members + bad, math.inf, min_z=3.0)
    assert s.kept == list(range(n_honest)) and sorted(s.excluded) == list(range(n_honest, n_honest + n_hostile))
    half = screen(members[:n_hostile] + bad, math.inf, min_z=3.0)  # as many as the honest: nobody's direction wins
    assert not any(i in half.kept for i in range(n_hostile, 2 * n_hostile))


def test_parts_are_compared_on_what_they_share_and_a_part_nobody_shares_is_not_judged():
    full = [honest(i, names=("s1", "s2")) for i in range(3)]
    stage1, stage2 = {"s1": honest(7, names=("s1",))["s1"]}, {"s2": honest(8, names=("s2",))["s2"]}
    lone = {"only-mine": torch.randn(SIZE)}  # a slice no other member of the round carries
    scores = score_contributions(full + [stage1, stage2, lone])
    assert all(scores[i] > 3 for i in range(5)) and 5 not in scores
    s = screen(full + [stage1, stage2, lone], math.inf, min_z=3.0)
    assert s.kept == [0, 1, 2, 3, 4, 5] and not s.excluded


def test_a_full_replica_is_not_judged_by_chain_stages_and_a_chain_stage_is_judged_by_all():
    # a chain-local stage trains θ projected onto its links' subspace: its sparse update agrees with a full
    # replica's no more than chance (the tiny run's chain in tests/chain/test_chain_swarm.py scored -2 to +2)
    full = [honest(i, names=("s1", "s2")) for i in range(2)]  # 0 established, 1 a fresh honest full replica
    stages = [noise(7, names=("s1",)), noise(8, names=("s2",))]  # one chain: its stages share no tensor
    alike = screen(full + stages, math.inf, min_z=3.0, established=[0])
    assert 1 in alike.excluded  # the chain's two stages sank the fresh replica's median
    s = screen(full + stages, math.inf, min_z=3.0, established=[0], kinds=[PLAIN] * 2 + [PROJECTED] * 2)
    assert s.kept == [0, 1] and s.scores[1] > 3 and sorted(s.excluded) == [2, 3]  # the stages must agree with θ's
    agreeing = [honest(9, names=("s1",)), honest(10, names=("s2",))]  # a chain whose update does agree: it counts
    s = screen(full + agreeing, math.inf, min_z=3.0, established=[0], kinds=[PLAIN] * 2 + [PROJECTED] * 2)
    assert s.kept == [0, 1, 2, 3] and not s.excluded


def test_a_payload_of_a_chain_stage_decodes_as_trained_on_projected_theta_unless_every_replica_is():
    spec = RunSpec().replace(model={"d_model": 32, "n_layers": 2, "n_heads": 2, "ffn_hidden": 32, "seq_len": 8})
    assert make_strategy(spec).kind_of((0, 1)) == PROJECTED and make_strategy(spec).kind_of(-1) == PLAIN
    assert make_strategy(spec.replace(chain={"compress_all": True})).kind_of((0, 1)) == PLAIN
    assert make_strategy(spec.replace(chain={"rank": 32})).kind_of((0, 1)) == PLAIN  # uncompressed links
    stage, full = make_strategy(spec, part=(0, 1)), make_strategy(spec)
    theta = {n: torch.zeros(sh) for n, sh in spec.param_shapes().items()}
    engine = RoundEngine(full, theta)
    payloads = {"b-stage": stage.encode({n: torch.ones(sh) for n, sh in stage.layout.items()}, 0)[0],
                "a-full": full.encode({n: torch.ones(sh) for n, sh in full.layout.items()}, 0)[0]}
    decoded, invalid = engine.decode(payloads)
    assert not invalid and decoded.senders == ["a-full", "b-stage"] and decoded.kinds == [PLAIN, PROJECTED]


def test_a_tensor_of_another_size_under_the_same_name_is_not_compared():
    odd = {"w": torch.randn(SIZE // 2)}
    scores = score_contributions([honest(0), honest(1), odd])
    assert 2 not in scores and scores[0] > 3


def test_a_pairs_z_has_the_same_bits_whatever_order_its_tensors_come_in():
    """Parts that carry different tensors (a stage, a slice owner) change the order in which a pair's
    tensors are first seen; the pair's z is an exactly rounded sum (math.fsum), so not its bits."""
    names = tuple("abcdefgh")
    full = [honest(i, names=names) for i in range(3)]
    part = {n: honest(7, names=names)[n] for n in ("f", "c", "a")}  # its own subset, in its own order
    forward, backward = agreement(full + [part]), agreement([part] + full[::-1])
    for i in range(4):
        for j in range(4):
            if i != j:  # position p forward is position 3 - p backward
                assert forward.z(i, j).hex() == backward.z(3 - i, 3 - j).hex()


def test_off_at_zero_and_decided_alike_in_any_order():
    contributions = [honest(0), honest(1), noise(2)]
    assert not screen(contributions, math.inf, min_z=0.0).excluded
    forward = score_contributions(contributions)
    backward = score_contributions(contributions[::-1])
    assert [forward[i].hex() for i in range(3)] == [backward[2 - i].hex() for i in range(3)]


SPEC = RunSpec().replace(model={"d_model": 16, "n_layers": 1, "n_heads": 2, "ffn_hidden": 32, "seq_len": 8},
                         outer={"strategy": "diloco"})


def test_the_round_records_the_reason_and_our_own_refused_update_is_not_lost():
    strategy = make_strategy(SPEC, layout={"w": (SIZE,), "b": (SIZE,)})
    assert strategy.min_agreement == 3.0  # the spec's default
    theta = {"w": torch.zeros(SIZE), "b": torch.zeros(SIZE)}
    decoded = Contributions([honest(0), honest(1), honest(2), noise(3)], ["p0", "p1", "p2", "p3"])
    out = robust_step(strategy, theta, decoded)
    assert out.contributors == 3 and list(out.excluded) == ["p3"] and set(out.scores) == {"p0", "p1", "p2", "p3"}

    spec = SPEC.replace(outer={"strategy": "sparseloco"})
    engine = RoundEngine(make_strategy(spec), {n: torch.zeros(s) for n, s in spec.param_shapes().items()})
    gen = torch.Generator().manual_seed(0)
    mine = {n: torch.randn(s, generator=gen) for n, s in spec.param_shapes().items()}
    data, pending = engine.encode(engine.theta, mine)  # our update is -mine: θ - θ_local
    others = [{n: t.clone() for n, t in mine.items()} for _ in range(3)]  # three members that went the other way
    settled = engine.conclude(Contributions([engine.strategy.decode(data, 0)] + others, ["me", "a", "b", "c"]),
                              pending, delivered=True, me="me")
    assert "me" in settled.excluded and not settled.delivered
    assert all(torch.equal(engine.strategy.buffer[n], pending.signal[n]) for n in pending.signal)


# --- standing: who judges, and the benefit of the doubt (protocol/round/standing.py) ----------------------
def test_a_burst_of_fresh_identities_larger_than_the_established_honest_is_judged_not_judging():
    members = [honest(i) for i in range(3)]
    burst = [{n: -t for n, t in honest(30 + k).items()} for k in range(5)]  # agree with each other
    everyone = screen(members + burst, math.inf, min_z=3.0)  # nobody established: all judge, the burst wins
    assert not any(i in everyone.kept for i in range(3))
    s = screen(members + burst, math.inf, min_z=3.0, established=[0, 1, 2])
    assert s.kept == [0, 1, 2] and sorted(s.excluded) == [3, 4, 5, 6, 7]


def test_an_established_sender_without_a_clear_direction_counts_and_one_pointing_against_does_not():
    members = [honest(i) for i in range(4)]
    unclear = noise(7)
    against = {n: -sum(m[n] for m in members) for n in members[0]}  # the honest consensus, negated
    fresh = screen(members + [unclear], math.inf, min_z=3.0, established=[0, 1, 2, 3])
    assert 4 in fresh.excluded and "without standing" in fresh.excluded[4]
    settled = screen(members + [unclear], math.inf, min_z=3.0, established=[0, 1, 2, 3, 4])
    assert 4 in settled.kept and abs(settled.scores[4]) < 3
    turned = screen(members + [against], math.inf, min_z=3.0, established=[0, 1, 2, 3, 4])
    assert 4 in turned.excluded and "points against" in turned.excluded[4]


def test_the_engine_keeps_standing_in_its_lineage_state_snapshot_and_redo():
    strategy = make_strategy(SPEC, layout={"w": (SIZE,), "b": (SIZE,)})
    engine = RoundEngine(strategy, {"w": torch.zeros(SIZE), "b": torch.zeros(SIZE)})
    senders = ["p0", "p1", "p2", "p3"]
    for _ in range(3):
        engine.conclude(Contributions([honest(0), honest(1), honest(2), noise(3)], senders), None, delivered=False)
    assert engine.standing == {"p0": 3, "p1": 3, "p2": 3}  # p3 refused every round
    snap = engine.snapshot()
    settled = engine.conclude(Contributions([honest(0), honest(1), honest(2), noise(4)], senders), None, delivered=False)
    assert "p3" in settled.excluded and engine.standing["p0"] == 4
    meta, _ = engine.shareable()
    assert meta["standing"] == engine.standing
    engine.redo(snap, Contributions([honest(0), honest(1)], ["p0", "p1"]))
    assert engine.standing == {"p0": 4, "p1": 4, "p2": 3}  # from the snapshot's table, not the later one


def test_a_fresh_full_replica_far_weaker_than_its_rounds_others_is_refused_and_established_or_stages_are_not():
    """outer.fresh_agreement: six replicas agreeing strongly (+17) and three that share their
    direction under 11 times the noise (+3.6 to +5.4, above the fixed bar of 3, like a peer trained on
    random ASCII beside honest ones in a run's first rounds). A fresh one must reach the given share of
    the round's median; an established one, or a chain stage (weak by nature), is held to min_z alone
    (protocol/round/standing.fresh_bar)."""
    names = tuple("abcdefgh")
    members = [honest(i, own_noise=0.5, names=names) for i in range(6)]
    members += [honest(20 + j, own_noise=11.0, names=names) for j in range(3)]
    assert screen(members, math.inf, min_z=3.0).kept == list(range(9))
    s = screen(members, math.inf, min_z=3.0, fresh_fraction=1 / 3)
    assert s.kept == list(range(6)) and all(3.0 < s.scores[i] < 17.0 / 3 for i in (6, 7, 8))
    assert "of its round's median full replica's" in s.excluded[6]
    assert screen(members, math.inf, min_z=3.0, fresh_fraction=1 / 3, established=range(9)).kept == list(range(9))
    stages = screen(members, math.inf, min_z=3.0, fresh_fraction=1 / 3, kinds=[PLAIN] * 6 + [PROJECTED] * 3)
    assert stages.kept == list(range(9))


def weak(seed: int, own_noise: float = 5.5):
    """The shared direction under 5.5 times a member's own noise: scores of +1.2 to +2.9 beside honest(0..2)."""
    own, out = torch.Generator().manual_seed(3000 + seed), {}
    for name in ("w", "b"):
        common = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        u = torch.randn(SIZE, generator=common) + own_noise * torch.randn(SIZE, generator=own)
        out[name] = u * (torch.rand(SIZE, generator=own) < 0.3)
    return out


def test_a_fresh_sender_whose_every_score_is_below_the_bar_counts_once_its_pooled_scores_reach_it():
    """A chain stage's scores sit at +0.8 to +3.0 (the demo): one round alone never lets it in; its
    evidence, pooled over rounds in the lineage's state, does (protocol/round/standing.py)."""
    strategy = make_strategy(SPEC, layout={"w": (SIZE,), "b": (SIZE,)})
    engine = RoundEngine(strategy, {"w": torch.zeros(SIZE), "b": torch.zeros(SIZE)})
    engine.install(engine.theta, 0, standing={"p0": 3, "p1": 3, "p2": 3})
    senders, fresh_digest, outcomes = ["p0", "p1", "p2", "stage"], None, []
    for seed in (0, 1, 2, 3, 5):
        settled = engine.conclude(Contributions([honest(0), honest(1), honest(2), weak(seed)], senders), None,
                                  delivered=False)
        assert settled.scores["stage"] < 3.0
        outcomes.append("stage" in settled.excluded)
        if seed == 0:
            meta, _ = engine.shareable()
            assert meta["evidence"] == {"stage": [2416, 1]} and "1 round pooled" in settled.excluded["stage"]
            fresh_digest = engine.state_digest()
            twin = RoundEngine(make_strategy(SPEC, layout={"w": (SIZE,), "b": (SIZE,)}), engine.theta)
            twin.install(engine.theta, engine.round, standing=engine.standing)
            assert twin.state_digest() != fresh_digest and twin.evidence == {}  # the pool is part of the state
    assert outcomes == [True, True, False, False, False]  # (2.42 + 1.21 + 2.88) / sqrt(3) = 3.76
    # counted on pooled evidence only: it earns no standing, so it stays fresh (judged, within the
    # fresh share) and keeps its pool (protocol/round/standing.advance)
    assert "stage" not in engine.standing and engine.evidence["stage"][1] == 5


def test_an_established_sender_whose_update_agrees_no_better_than_chance_counts_and_spends_its_standing():
    """An established sender's contribution at or below chance counts and spends a round of its
    standing (protocol/round/standing.advance): one just established is fresh again after it."""
    strategy = make_strategy(SPEC, layout={"w": (SIZE,), "b": (SIZE,)})
    engine = RoundEngine(strategy, {"w": torch.zeros(SIZE), "b": torch.zeros(SIZE)})
    engine.install(engine.theta, 0, standing={"p0": 3, "p1": 3, "p2": 3, "odd": 3})
    senders = ["odd", "p0", "p1", "p2"]
    settled = engine.conclude(Contributions([noise(10), honest(0), honest(1), honest(2)], senders), None, delivered=False)
    assert settled.scores["odd"] <= 0 and "odd" not in settled.excluded  # counted: the benefit of the doubt
    assert engine.standing["odd"] == 2 and engine.standing["p0"] == 4
    settled = engine.conclude(Contributions([noise(12), honest(0), honest(1), honest(2)], senders), None, delivered=False)
    assert "odd" in settled.excluded and "without standing" in settled.excluded["odd"]  # fresh now: must agree


def test_a_sender_with_tensors_left_out_gains_no_standing_from_that_round():
    names = ("big1", "big2", "s1", "s2", "s3", "s4")
    layout = {n: (SIZE,) for n in names}
    engine = RoundEngine(make_strategy(SPEC, layout=layout), {n: torch.zeros(SIZE) for n in names})
    engine.install(engine.theta, 0, standing={"p0": 3, "p1": 3, "p2": 3, "p3": 3})
    bad = {n: -t if n.startswith("big") else t for n, t in honest(9, names=names, own_noise=1.0).items()}
    settled = engine.conclude(Contributions([honest(i, names=names, own_noise=1.0) for i in range(4)] + [bad],
                                            ["p0", "p1", "p2", "p3", "x"]),
                              None, delivered=False)
    assert settled.dropped == {"x": ["big1", "big2"]} and "x" not in settled.excluded
    assert engine.standing == {"p0": 4, "p1": 4, "p2": 4, "p3": 4}  # x counted, in part, and earned nothing


# --- copies ----------------------------------------------------------------------------------------
def near_copy(c, flip: float, drop: float = 0.0, seed: int = 9, scale: float = 0.9):
    """``c`` scaled, with a fraction ``flip`` of its set coordinates' signs flipped and ``drop`` of them unset."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in c.items():
        r = torch.rand(t.shape, generator=g)
        out[name] = torch.where(r < flip, -t, t) * (torch.rand(t.shape, generator=g) >= drop) * scale
    return out


def test_copies_and_near_copies_are_found_and_honest_pairs_never_are():
    h = [honest(i) for i in range(4)]
    # honest members: their signs agree far above chance, yet none is a copy of another
    assert consensus.copies(agreement(h)) == {}
    round_ = [h[0], h[1], near_copy(h[1], flip=0.0, scale=1.0), h[2], near_copy(h[1], flip=0.04, drop=0.04),
              near_copy(h[3], flip=0.3)]
    # 2 copies 1 exactly, 4 nearly (a copy of a copy is in the same group); 5 flips 30 %: not a copy, noise
    assert consensus.copies(agreement(round_)) == {2: 1, 4: 1}
    # a chain stage carries only some tensors of a replica: sharing its signs there is no copy of the whole
    assert consensus.copies(agreement([h[0], {"w": h[0]["w"].clone()}])) == {}


def test_a_copied_update_counts_once_and_earns_neither_sender_standing():
    spec = RunSpec().replace(model={"d_model": 16, "n_layers": 1, "n_heads": 2, "ffn_hidden": 32, "seq_len": 8},
                             outer={"strategy": "diloco", "lr": 1.0, "momentum": 0.0})
    names = list(spec.param_shapes())
    gen = torch.Generator().manual_seed(0)
    common = {n: torch.randn(sh, generator=gen) for n, sh in spec.param_shapes().items()}

    def member(seed):
        g = torch.Generator().manual_seed(100 + seed)
        return {n: common[n] + torch.randn(common[n].shape, generator=g) for n in names}

    a, b, c = member(1), member(2), member(3)
    copier = {n: t.clone() for n, t in b.items()}
    theta = {n: torch.zeros(sh) for n, sh in spec.param_shapes().items()}
    outcome = robust_step(make_strategy(spec), theta, Contributions([a, copier, b, c], ["a", "attacker", "b", "c"]),
                          multiple=math.inf)
    assert outcome.copies == {"b": "attacker"} and outcome.copied == {"attacker", "b"} and outcome.contributors == 3
    assert not outcome.excluded
    want = {n: torch.zeros(sh) for n, sh in spec.param_shapes().items()}
    make_strategy(spec).apply(want, make_strategy(spec).aggregate([a, b, c]))
    assert all(torch.equal(theta[n], want[n]) for n in names)  # as if the copy had not been sent
    engine = RoundEngine(make_strategy(spec), {n: torch.zeros(sh) for n, sh in spec.param_shapes().items()})
    settled = engine.conclude(Contributions([a, copier, b, c], ["a", "attacker", "b", "c"]), None, delivered=True)
    assert engine.standing == {"a": 1, "c": 1} and settled.copies == {"b": "attacker"} and settled.contributors == 3
