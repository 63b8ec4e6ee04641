"""Robust aggregation (peer/outer/robust.py) on its own and through the round engine: milliseconds."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from peer.outer.robust import (CLIP_MULTIPLE, Contributions, NonFiniteStep, robust_step, screen,
                               squared_norm)
from peer.outer.engine import RoundEngine
from peer.outer.strategies import make_strategy
from protocol.spec import RunSpec

# the direction check (tests/outer/test_consensus.py) needs more coordinates than these hand-made vectors have
SPEC = RunSpec().replace(model={"d_model": 16, "n_layers": 1, "n_heads": 2, "ffn_hidden": 32, "seq_len": 8},
                         outer={"min_agreement": 0.0})


def vec(*values):
    return torch.tensor(values, dtype=torch.float32)


def scaled_payload(data: bytes, factor: float) -> bytes:
    """A well-formed payload whose float fields are ``factor`` times larger (bench/hostile_peers.py's poison)."""
    from bench.hostile_peers import scale_payload

    return scale_payload(data, factor)


# --- the arithmetic --------------------------------------------------------------------------------
def test_squared_norm_is_float64_and_flags_non_finite():
    t = torch.randn(3000, generator=torch.Generator().manual_seed(0))
    sq, peak = squared_norm(t)
    assert sq == pytest.approx(float((t.double() ** 2).sum()), rel=1e-12) and peak == float(t.abs().max())
    assert squared_norm(torch.zeros(0)) == (0.0, 0.0)
    assert squared_norm(vec(3e38, 3e38))[0] == pytest.approx(1.8e77)  # no float32 overflow
    for bad in (float("nan"), float("inf")):
        sq, peak = squared_norm(vec(1.0, bad))
        assert not (math.isfinite(sq) and math.isfinite(peak))


@pytest.mark.parametrize("density", [0.0, 0.016, 0.5, 1.0])
def test_squared_norm_skips_zeros_and_keeps_the_bits_of_the_sum_over_every_element(monkeypatch, density):
    import peer.outer.robust as robust
    from bench.outer_step import reference_squared_norm  # the definition: every element, in order

    monkeypatch.setattr(robust, "_CHUNK", 1000)  # several chunks, a partial one last
    g = torch.Generator().manual_seed(7)
    for n in (1, 999, 1000, 3457):
        x = torch.randn(n, generator=g) * torch.exp(8 * torch.randn(n, generator=g))  # magnitudes far apart
        x[torch.rand(n, generator=g) >= density] = 0.0
        x[torch.rand(n, generator=g) < 0.05] = -0.0
        got, want = squared_norm(x), reference_squared_norm(x)
        assert got[0].hex() == want[0].hex() and got[1] == want[1], (n, got, want)
    assert not math.isfinite(squared_norm(vec(0.0, -float("inf"), 0.0))[0])


def test_chosen_average_is_bit_identical_to_dividing_by_a_float_count():
    from bench.outer_step import reference_average
    from peer.outer.strategies import average

    g = torch.Generator().manual_seed(3)
    layout = {"w": (64, 33), "b": (17,)}
    decoded = []
    for i in range(5):
        d = {}
        for name, shape in layout.items():
            t = torch.randn(shape, generator=g) * (i + 1)
            t[torch.rand(shape, generator=g) > 0.3] = 0.0
            d[name] = t
        decoded.append(d)
    decoded[2].pop("b")  # a contribution that does not carry a tensor
    got = average(layout, decoded, over_choosers=True)
    want = reference_average(layout, decoded, over_choosers=True)  # a float32 count, every coordinate divided
    for name in layout:
        assert torch.equal(got[name].view(torch.int32), want[name].view(torch.int32)), name
    # with the floor (outer.sparseloco.min_share) above one payload: 0.5 of 5 (4 for "b")
    got = average(layout, decoded, over_choosers=True, min_share=0.5)
    want = reference_average(layout, decoded, over_choosers=True, min_share=0.5)
    for name in layout:
        assert torch.equal(got[name].view(torch.int32), want[name].view(torch.int32)), name


def test_clip_to_the_median_per_tensor():
    # tensor "a": norms 1, 2, 3, 100 -> lower median 2; tensor "b": norms 5, 5, 5, 5 -> nothing clipped
    decoded = [{"a": vec(0.6, 0.8) * n, "b": vec(3.0, 4.0)} for n in (1.0, 2.0, 3.0, 100.0)]
    poisoned = decoded[3]["a"].clone()
    s = screen(decoded, 1.0)
    assert s.kept == [0, 1, 2, 3] and not s.excluded
    assert s.limits == pytest.approx({"a": 2.0, "b": 5.0}, rel=1e-7)  # 0.6 and 0.8 in float32
    assert set(s.clipped) == {2, 3}
    assert s.clipped[3] == pytest.approx(0.02) and s.clipped[2] == pytest.approx(2 / 3)
    for i in (2, 3):
        assert float(s.contributions[i]["a"].norm()) == pytest.approx(2.0, rel=1e-6)
        assert s.contributions[i]["b"] is decoded[i]["b"]  # untouched tensors are not copied
    for i in (0, 1):
        assert s.contributions[i]["a"] is decoded[i]["a"]
    assert torch.equal(decoded[3]["a"], poisoned)  # the input is never modified


def test_multiple_and_off():
    decoded = [{"a": vec(n)} for n in (1.0, 2.0, 3.0, 100.0)]
    s = screen(decoded, 2.0)
    assert s.limits == {"a": 4.0} and list(s.clipped) == [3]
    assert float(s.contributions[3]["a"]) == pytest.approx(2.0)  # past the limit: to the median
    off = screen(decoded, math.inf)
    assert not off.clipped and not off.limits
    assert all(off.contributions[i]["a"] is decoded[i]["a"] for i in range(4))


def test_past_the_limit_an_update_weighs_the_median():
    # norms 2, 2.5, 2.9, 3.1, 5000 (lower median 2.9, limit 4.35): 3.1 stays, under the limit; 5000 is
    # scaled to the median, not to the limit: an amplified update weighs what a typical one does
    decoded = [{"a": vec(n)} for n in (2.0, 2.5, 2.9, 3.1, 5000.0)]
    s = screen(decoded, CLIP_MULTIPLE)
    assert s.limits == pytest.approx({"a": 1.5 * 2.9}) and list(s.clipped) == [4]
    assert float(s.contributions[3]["a"]) == pytest.approx(3.1)
    assert float(s.contributions[4]["a"]) == pytest.approx(2.9, rel=1e-6)
    assert s.norms[4] == pytest.approx(2.9, rel=1e-6)


def test_a_multiple_below_one_clips_to_the_limit():
    s = screen([{"a": vec(n)} for n in (1.0, 2.0, 3.0, 100.0)], 0.5)  # median 2, limit 1
    assert s.limits == {"a": 1.0} and set(s.clipped) == {1, 2, 3}
    assert [float(s.contributions[i]["a"]) for i in range(4)] == pytest.approx([1.0, 1.0, 1.0, 1.0])


def test_a_zero_update_cannot_pull_the_limit_to_zero():
    s = screen([{"a": vec(0.0)}, {"a": vec(1.0)}, {"a": vec(1.5)}, {"a": vec(2.0)}], 1.0)
    assert s.limits == {"a": 1.0} and set(s.clipped) == {2, 3}


def test_partial_and_chain_contributions_compare_like_with_like():
    # a full replica carries a, b and c; two slice owners carry a and b; a chain stage only c
    decoded = [
        {"a": vec(1.0), "b": vec(10.0), "c": vec(1000.0)},  # its c is the only c but one
        {"a": vec(2.0), "b": vec(20.0)},
        {"a": vec(3.0), "b": vec(300.0)},
        {"c": vec(5.0)},
    ]
    s = screen(decoded, 1.0)
    assert s.limits == {"a": 2.0, "b": 20.0, "c": 5.0}
    assert float(s.contributions[0]["c"]) == pytest.approx(5.0)  # clipped among the carriers of c
    assert float(s.contributions[2]["b"]) == pytest.approx(20.0)
    assert float(s.contributions[2]["a"]) == pytest.approx(2.0)
    assert set(s.contributions[3]) == {"c"} and float(s.contributions[3]["c"]) == 5.0
    lone = screen([{"x": vec(1e6)}, {"y": vec(1.0)}], 1.0)  # a tensor only one member carries: its own median
    assert not lone.clipped


def test_an_update_of_more_steps_is_compared_at_its_steps():
    """A peer that trained H = 20 steps beside one that closed its round early at 5: its norm is
    compared with the other's scaled to 20 steps (x4 at most), not with the other's own; an update
    of fewer steps is never held to less than the others' norms themselves, and with equal steps the
    clip is the one without counts (the same bits)."""
    pair = [{"a": vec(1.0)}, {"a": vec(3.0)}]  # 5 steps, then 20
    assert set(screen(pair, CLIP_MULTIPLE).clipped) == {1}  # uncounted: clipped to the early closer's norm
    s = screen(pair, CLIP_MULTIPLE, steps=[5, 20])
    assert not s.clipped and s.contributions[1]["a"] is pair[1]["a"]
    amplified = screen([{"a": vec(1.0)}, {"a": vec(3e3)}], CLIP_MULTIPLE, steps=[5, 20])
    assert float(amplified.contributions[1]["a"]) == pytest.approx(4.0)  # at most 4x the 5-step norm: H / 5
    assert not screen([{"a": vec(3.0)}, {"a": vec(2.0)}], CLIP_MULTIPLE, steps=[5, 20]).clipped  # a 5-step norm may be larger
    four = [{"a": vec(n)} for n in (1.0, 2.0, 3.0, 100.0)]
    same, uncounted = screen(four, 1.0, steps=[20] * 4), screen(four, 1.0)
    assert same.limits == uncounted.limits and same.clipped == uncounted.clipped
    # an early closer's tiny claim (a liar's) raises only its own entry of each median: 3 honest 20-step
    # updates and one claiming 5 steps with a huge norm; the honest ones' medians stay theirs
    liar = screen([{"a": vec(n)} for n in (2.0, 2.2, 2.4, 50.0)], CLIP_MULTIPLE, steps=[20, 20, 20, 5])
    assert list(liar.clipped) == [3] and liar.limits["a"] == pytest.approx(1.5 * 2.2)


def test_the_engine_reads_the_steps_a_payload_claims_and_counts_a_claim_below_the_floor_as_the_floor():
    engines = group(3, "sparseloco")
    H = engines[0].strategy.spec.outer.inner_steps
    payloads = {}
    for i, (e, steps) in enumerate(zip(engines, (H, 1, H // 2))):
        gen = torch.Generator().manual_seed(i)
        payloads[f"peer{i}"] = e.encode(e.theta, {k: v - 0.01 * torch.randn(v.shape, generator=gen)
                                                  for k, v in e.theta.items()}, steps)[0]
    decoded, invalid = engines[0].decode(payloads)
    floor = math.ceil(engines[0].strategy.spec.outer.min_inner_fraction * H)
    assert not invalid and decoded.steps == [H, floor, H // 2]


@pytest.mark.parametrize("bad, why", [(float("nan"), "non-finite"), (float("inf"), "non-finite"),
                                      (3e8, "magnitude"), (-1e29, "magnitude")])
def test_a_non_finite_or_absurd_contribution_is_excluded(bad, why):
    decoded = [{"a": vec(1.0, 2.0)}, {"a": vec(1.0, bad)}, {"a": vec(2.0, 1.0)}]
    s = screen(decoded, 1.0)
    assert s.kept == [0, 2] and why in s.excluded[1]
    spec = SPEC.replace(outer={"strategy": "diloco"})
    strategy = make_strategy(spec, layout={"a": (2,)})
    theta = {"a": vec(0.5, 0.5)}
    out = robust_step(strategy, theta, Contributions(decoded, ["p0", "p1", "p2"]))
    assert out.contributors == 2 and list(out.excluded) == ["p1"] and torch.isfinite(theta["a"]).all()


# --- the outer step, all or nothing ----------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["diloco", "sparseloco", "dct"])
def test_a_step_that_would_leave_theta_non_finite_changes_nothing(strategy):
    s = make_strategy(SPEC.replace(outer={"strategy": strategy}), layout={"a": (2,), "b": (2,)})
    theta = {"a": vec(1.0, 1.0), "b": vec(-3.4e38, 0.0)}
    state = {k: v.clone() for k, v in s.shared_state().items()}
    before = {k: v.clone() for k, v in theta.items()}
    with pytest.raises(NonFiniteStep, match="b"):
        s.apply(theta, {"a": vec(0.1, 0.1), "b": vec(1e38, 0.0)})
    assert all(torch.equal(theta[k], before[k]) for k in theta)
    assert all(torch.equal(v, state[k]) for k, v in s.shared_state().items())
    # through robust_step: the offending contribution is excluded, the rest applied, nothing raises
    # (bounded contributions cannot overflow a finite θ at a real outer lr: an absurd lr stands in for it)
    s.lr = 1e31
    decoded = Contributions([{"a": vec(0.1, 0.1), "b": vec(0.0, 0.0)}, {"a": vec(0.1, 0.1), "b": vec(9e7, 0.0)}], ["x", "y"])
    out = robust_step(s, theta, decoded, multiple=math.inf)
    assert out.contributors == 1 and "y" in out.excluded and torch.isfinite(theta["b"]).all()
    assert not torch.equal(theta["a"], before["a"])


def test_diloco_apply_matches_the_single_pass_arithmetic():
    spec = SPEC.replace(outer={"strategy": "diloco"})
    s = make_strategy(spec)
    gen = torch.Generator().manual_seed(3)
    theta = {n: torch.randn(sh, generator=gen) for n, sh in spec.param_shapes().items()}
    ref_theta = {n: t.clone() for n, t in theta.items()}
    ref_mom = {n: torch.zeros(sh) for n, sh in spec.param_shapes().items()}
    mu, lr = spec.outer.momentum, s.lr
    for _ in range(3):
        update = {n: torch.randn(sh, generator=gen) * 1e-2 for n, sh in spec.param_shapes().items()}
        s.apply(theta, update)
        for n, g in update.items():  # the implementation before the all-or-nothing step
            ref_mom[n].mul_(mu).add_(g)
            ref_theta[n].sub_((g + ref_mom[n] * mu) * lr)
    assert all(torch.equal(theta[n], ref_theta[n]) and torch.equal(s.momentum[n], ref_mom[n]) for n in theta)


# --- through the round engine: real payloads -------------------------------------------------------
def group(n, strategy, aggregate="chosen"):
    spec = SPEC.replace(outer={"strategy": strategy, "sparseloco": {"aggregate": aggregate}})
    gen = torch.Generator().manual_seed(0)
    theta = {name: torch.randn(shape, generator=gen) for name, shape in spec.param_shapes().items()}
    return [RoundEngine(make_strategy(spec), {k: v.clone() for k, v in theta.items()}) for _ in range(n)]


def round_payloads(engines, poison=None):
    out = {}
    for i, e in enumerate(engines):
        gen = torch.Generator().manual_seed(10 + i)
        trained = {k: v - 0.01 * torch.randn(v.shape, generator=gen) for k, v in e.theta.items()}
        data, pending = e.encode(e.theta, trained)
        out[f"peer{i}"] = (scaled_payload(data, poison) if poison and i == len(engines) - 1 else data, pending)
    return out


@pytest.mark.parametrize("strategy", ["sparseloco", "diloco", "dct"])
def test_members_are_bit_identical_whatever_the_arrival_order(strategy):
    engines = group(4, strategy)
    sent = round_payloads(engines, poison=1e3)
    names = list(sent)
    for i, e in enumerate(engines):
        order = names[:]
        random.Random(i).shuffle(order)  # each member's payloads arrive in another order
        settled = e.settle_round({n: sent[n][0] for n in order}, sent[f"peer{i}"][1], me=f"peer{i}")
        assert settled.contributors == 4 and "peer3" in settled.clipped
    assert len({e.params_hash() for e in engines}) == 1


@pytest.mark.parametrize("strategy, aggregate", [("sparseloco", "chosen"), ("sparseloco", "mean"), ("diloco", "mean"),
                                                 ("dct", "mean")])
def test_a_poisoned_payload_moves_theta_no_more_than_an_honest_one(strategy, aggregate):
    start = group(1, strategy, aggregate)[0].theta
    moved = {}
    for poison in (None, 1e4):
        engines = group(4, strategy, aggregate)
        sent = round_payloads(engines, poison)
        settled = engines[0].settle_round({n: d for n, (d, _) in sent.items()}, sent["peer0"][1], me="peer0")
        assert settled.contributors == 4 and not settled.excluded
        if poison:
            assert settled.clipped["peer3"] < 1e-3
        theta = engines[0].theta
        assert all(torch.isfinite(t).all() for t in theta.values())
        moved[poison] = math.sqrt(sum(float(((theta[n] - start[n]).double() ** 2).sum()) for n in theta))
    assert moved[1e4] < 1.5 * moved[None]


def test_an_absurd_payload_is_rejected_at_decode_with_its_reason():
    engines = group(4, "sparseloco")
    sent = round_payloads(engines, poison=1e29)
    settled = engines[0].settle_round({n: d for n, (d, _) in sent.items()}, sent["peer0"][1], me="peer0")
    assert settled.contributors == 3 and list(settled.excluded) == ["peer3"]
    assert "magnitude" in settled.excluded["peer3"] and "no pseudo-gradient is that large" in settled.excluded["peer3"]


def test_the_simulation_and_a_plain_list_name_contributions():
    engines = group(2, "diloco")
    sent = round_payloads(engines)
    decoded, invalid = engines[0].decode({n: d for n, (d, _) in sent.items()})
    assert not invalid and decoded.senders == ["peer0", "peer1"]
    bad = [dict(decoded[0]), {k: v * float("nan") for k, v in decoded[1].items()}]
    settled = engines[1].conclude(bad, None, delivered=True)
    assert settled.contributors == 1 and list(settled.excluded) == ["#1"]
    assert np.isfinite(np.concatenate([t.numpy().ravel() for t in engines[1].theta.values()])).all()


@pytest.mark.parametrize("strategy,aggregate", [("diloco", None), ("sparseloco", "chosen"), ("sparseloco", "mean")])
def test_a_burst_of_fresh_senders_moves_theta_by_a_third_of_the_step_at_most(strategy, aggregate):
    """2 established senders send a, 6 fresh ones b: the step is (2a + 6 w b) / (2 + 6 w) with the
    fresh ones weighing a third together (protocol/round/standing.weights), not (2a + 6b) / 8."""
    outer = {"strategy": strategy, "min_agreement": 0.0, "lr": 1.0, "momentum": 0.0}
    if aggregate:
        outer["sparseloco"] = {"aggregate": aggregate}
    spec = SPEC.replace(outer=outer)
    name, shape = next(iter(spec.param_shapes().items()))
    a, b = torch.zeros(shape), torch.zeros(shape)
    a.view(-1)[:3], b.view(-1)[:3] = vec(1.0, 2.0, 0.0), vec(-4.0, 0.0, 3.0)
    senders = ["e1", "e2"] + [f"f{i}" for i in range(6)]
    decoded = Contributions([{name: a}, {name: a}] + [{name: b}] * 6, senders)
    theta = {n: torch.zeros(sh) for n, sh in spec.param_shapes().items()}
    outcome = robust_step(make_strategy(spec), theta, decoded, round_no=4, multiple=math.inf,
                          standing={"e1": 3, "e2": 7, "f0": 2})
    assert outcome.contributors == 8 and set(outcome.weighed) == {f"f{i}" for i in range(6)}
    w = outcome.weighed["f0"]
    assert w == pytest.approx(1 / 6)
    if aggregate == "chosen":  # per coordinate over those that kept it: where only b was kept, b
        want = vec((2 * 1.0 - 6 * w * 4.0) / (2 + 6 * w), 2.0, 3.0)
    else:
        want = (2 * a + 6 * w * b).view(-1)[:3] / (2 + 6 * w)
    moved = -theta[name].view(-1)
    assert torch.allclose(moved[:3], want, atol=1e-6) and not moved[3:].any(), (moved[:3], want)
    # nobody established: the plain mean, bit for bit the unweighted code
    plain = {n: torch.zeros(sh) for n, sh in spec.param_shapes().items()}
    assert robust_step(make_strategy(spec), plain, decoded, multiple=math.inf, standing={}).weighed == {}
    reference = {n: torch.zeros(sh) for n, sh in spec.param_shapes().items()}
    s = make_strategy(spec)
    s.apply(reference, s.aggregate(list(decoded)))
    assert torch.equal(plain[name], reference[name])


def test_fresh_chain_stages_among_established_replicas_are_weighed_per_tensor_they_carry():
    """The bound counts the carriers of each tensor: two fresh stages that each carry their own
    blocks beside three established full replicas are one fresh carrier in four per tensor, under a
    third, so they weigh 1; counted over the round (2 of 5) they would have been weighed down."""
    spec = SPEC.replace(outer={"strategy": "diloco", "min_agreement": 0.0, "lr": 1.0, "momentum": 0.0})
    shapes = spec.param_shapes()
    x, y = list(shapes)[:2]
    full = {n: torch.full(shapes[n], 0.1) for n in (x, y)}
    decoded = Contributions([full, full, full, {x: torch.full(shapes[x], 0.5)}, {y: torch.full(shapes[y], 0.5)}],
                            ["e1", "e2", "e3", "s1", "s2"])
    theta = {n: torch.zeros(sh) for n, sh in shapes.items()}
    outcome = robust_step(make_strategy(spec), theta, decoded, multiple=math.inf, standing={"e1": 3, "e2": 3, "e3": 5})
    assert outcome.weighed == {}
    assert torch.allclose(-theta[x], torch.full(shapes[x], (0.3 + 0.5) / 4))
    # a third fresh carrier of x tips it over: those of x weigh less, s2 (alone on y) does not
    decoded = Contributions(list(decoded) + [{x: torch.full(shapes[x], 0.5)}], ["e1", "e2", "e3", "s1", "s2", "s3"])
    outcome = robust_step(make_strategy(spec), {n: torch.zeros(sh) for n, sh in shapes.items()}, decoded,
                          multiple=math.inf, standing={"e1": 3, "e2": 3, "e3": 5})
    assert set(outcome.weighed) == {"s1", "s3"} and outcome.weighed["s1"] == pytest.approx(0.75)
