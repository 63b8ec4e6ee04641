"""Partial parameter updates: slices, freezing, ownership and per-coordinate aggregation."""

from __future__ import annotations

import pytest
import torch

from peer.training.inner import InnerTrainer
from peer.training.model import build_model
from peer.outer.strategies import make_strategy
from protocol.errors import PayloadError
from protocol.model.partial import FULL, balanced_steps, choose_part, owned_shapes, part_layouts, slice_of
from protocol.spec import RunSpec

TINY = dict(d_model=32, n_layers=2, n_heads=4, ffn_hidden=64, seq_len=16)


def spec(slices=2, attention=False, strategy="diloco"):
    return RunSpec(run_id="p").replace(
        model=TINY, partial={"slices": slices, "attention": attention},
        outer={"strategy": strategy, "dense_dtype": "fp32"}, data={"batch_size": 2},
    )


@pytest.mark.parametrize("slices, attention", [(2, False), (4, False), (4, True), (2, True)])
def test_slices_cover_every_parameter_exactly(slices, attention):
    s = spec(slices, attention)
    full = s.param_shapes()
    parts = [owned_shapes(s, p) for p in range(slices)]
    covered = set().union(*parts)
    assert covered == set(full)
    for name in full:
        owners = [p for p in range(slices) if name in parts[p]]
        assert owners == (list(range(slices)) if slice_of(name) == FULL else [slice_of(name)])
    # sliced tensors add up to the unsliced model, coordinate for coordinate
    assert sum(torch.Size(v).numel() for v in full.values()) == s.model.num_params()
    if attention:
        assert any(".attn.qkv.1." in n for n in parts[1]) and not any(".attn.qkv.0." in n for n in parts[1])


def test_sliced_model_matches_spec_layout():
    s = spec(4, True)
    model = build_model(s.model, 0, 4, 4)
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == list(s.param_shapes().items())


def test_frozen_parameters_are_bit_unchanged_and_have_no_optimizer_state():
    s = spec(2)
    model = build_model(s.model, 0, 2, 1)
    owned = owned_shapes(s, 1)
    for name, p in model.named_parameters():
        p.requires_grad_(name in owned)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = InnerTrainer(model, s.inner)
    x = torch.randint(0, 256, (2, 16))
    for _ in range(3):
        trainer.step(x, x)
    state_params = {id(p) for p in trainer.optimizer.state}
    for name, p in model.named_parameters():
        if name in owned:
            assert id(p) in state_params and not torch.equal(p, before[name]), name
        else:
            assert id(p) not in state_params and p.grad is None, name
            assert p.detach().numpy().tobytes() == before[name].numpy().tobytes(), name


def test_aggregate_is_the_mean_over_owners():
    s = spec(2, strategy="diloco")
    layouts = part_layouts(s)
    gen = torch.Generator().manual_seed(0)
    # three peers: two own slice 0, one owns slice 1
    parts = [0, 0, 1]
    deltas = [{n: torch.randn(sh, generator=gen) for n, sh in layouts[p].items()} for p in parts]
    strategies = [make_strategy(s, part=p) for p in parts]
    payloads = [st.encode(d, 3)[0] for st, d in zip(strategies, deltas)]
    decoded = [strategies[0].decode(b, 3) for b in payloads]
    agg = strategies[0].aggregate(decoded)
    for name in s.param_shapes():
        owners = [d[name] for d in deltas if name in d]
        reference = sum(owners[1:], owners[0].clone()) / len(owners)
        assert torch.equal(agg[name], reference), name


def test_payload_of_a_slice_is_smaller_and_checked_against_its_part():
    s = spec(2, strategy="sparseloco")
    full, half = make_strategy(s, part=FULL), make_strategy(s, part=1)
    delta = {n: torch.randn(sh) for n, sh in s.param_shapes().items()}
    big = full.encode(delta, 0)[0]
    small = half.encode({n: delta[n] for n in half.layout}, 0)[0]
    assert len(small) < len(big)
    assert set(full.decode(small, 0)) == set(half.layout)
    tampered = small.replace(b"\xa4part\x01", b"\xa4part\x00")  # claim the other slice
    assert tampered != small
    with pytest.raises(PayloadError):
        full.decode(tampered, 0)


def test_choose_part_spreads_simultaneous_joiners_and_fills_orphans():
    waiting = ["d", "a", "c", "b"]
    chosen = {p: choose_part(2, [], waiting, p) for p in waiting}
    assert sorted(chosen.values()) == [0, 0, 1, 1]
    assert choose_part(3, [0, 0, 2, 2], [], "x") == 1  # the orphaned slice first
    assert choose_part(1, [], [], "x") == FULL


def test_chain_stage_payloads_carry_their_block_range_and_count_once():
    s = spec(1, strategy="sparseloco")
    n = s.model.n_layers
    stages = [make_strategy(s, part=(0, 1)), make_strategy(s, part=(1, n))]
    full = make_strategy(s)
    assert set(stages[0].layout) | set(stages[1].layout) == set(s.param_shapes())
    assert not set(stages[0].layout) & set(stages[1].layout)
    gen = torch.Generator().manual_seed(1)
    deltas = [{k: torch.randn(sh, generator=gen) for k, sh in st.layout.items()} for st in stages]
    payloads = [st.encode(d, 0)[0] for st, d in zip(stages, deltas)]
    decoded = [full.decode(b, 0) for b in payloads]
    assert [set(d) for d in decoded] == [set(st.layout) for st in stages]
    # the two stages of a chain together are one replica: each tensor appears in exactly one of them
    agg = full.aggregate(decoded)
    assert set(agg) == set(s.param_shapes())
    bad = make_strategy(s, part=(0, 1)).encode(deltas[0], 0)[0].replace(b"\xa4part\x92\x00\x01", b"\xa4part\x92\x00\x05")
    with pytest.raises(PayloadError):
        full.decode(bad, 0)


def test_sparseloco_averages_each_coordinate_over_the_payloads_that_kept_it():
    gen = torch.Generator().manual_seed(1)
    for aggregate in ("chosen", "mean"):
        s = spec(2, strategy="sparseloco").replace(outer={"sparseloco": {"aggregate": aggregate}})
        layouts = part_layouts(s)
        parts = [0, 0, 1]  # two owners of slice 0, one of slice 1
        strategies = [make_strategy(s, part=p) for p in parts]
        payloads = [st.encode({n: torch.randn(sh, generator=gen) for n, sh in layouts[p].items()}, 3)[0]
                    for st, p in zip(strategies, parts)]
        decoded = [strategies[0].decode(b, 3) for b in payloads]
        agg = strategies[0].aggregate(decoded)
        assert agg.keys() == set(s.param_shapes())
        for name in s.param_shapes():
            carried = [d[name] for d in decoded if name in d]
            total = sum(carried[1:], carried[0].clone())
            kept = sum((c != 0).float() for c in carried)
            want = total / kept.clamp(min=1) if aggregate == "chosen" else total / len(carried)
            assert torch.allclose(agg[name], want), name
            # a coordinate kept by one payload of several is that payload's value, not diluted
            if aggregate == "chosen" and len(carried) > 1:
                only = (kept == 1)
                assert torch.equal(agg[name][only], total[only])
        # every member computes the same bits
        assert all(torch.equal(agg[n], strategies[2].aggregate(decoded)[n]) for n in agg)


def test_balanced_steps_are_the_root_of_the_carriers_ratio_for_sliced_tensors_only():
    s = spec(4)
    shared = next(n for n in s.param_shapes() if slice_of(n) == FULL)
    sliced = [n for n in s.param_shapes() if slice_of(n) != FULL]
    carriers = {shared: 8, sliced[0]: 2, sliced[1]: 8, sliced[2]: 4}
    assert balanced_steps(carriers, 4) == {sliced[0]: 2.0, sliced[2]: 2 ** 0.5}
    assert balanced_steps(carriers, 2) == {sliced[0]: 2 ** 0.5, sliced[2]: 2 ** 0.5}  # at most √S
    assert balanced_steps({shared: 3}, 4) == {} and balanced_steps({}, 4) == {}
    assert balanced_steps({shared: 2, sliced[0]: 8}, 4) == {}  # a shared tensor is never scaled, even carried less
    assert balanced_steps({shared: 16, sliced[0]: 1, sliced[1]: 2}, 16) == {sliced[1]: 8 ** 0.5}  # a lone carrier: 1


@pytest.mark.parametrize("strategy", ["sparseloco", "diloco"])
def test_a_slice_carried_by_fewer_owners_steps_further_alike_on_every_member(strategy):
    """Four slice owners of S = 2 (two a slice): shared tensors are carried by 4, each slice by 2, so
    with ``partial.balance_steps`` a slice steps √2 times as far as without, shared tensors alike;
    two members concluding the round get the same bits."""
    from peer.outer.engine import RoundEngine

    def conclude(balance):
        s = spec(2, strategy=strategy).replace(partial={"balance_steps": balance})
        gen = torch.Generator().manual_seed(0)
        theta = {n: torch.randn(sh, generator=gen) for n, sh in s.param_shapes().items()}
        engine = RoundEngine(make_strategy(s), {n: t.clone() for n, t in theta.items()})
        engine.standing = {f"p{i}": 20 for i in range(4)}  # established: every update counts
        layouts, common = part_layouts(s), torch.Generator().manual_seed(1)
        base = {n: torch.randn(sh, generator=common) for n, sh in s.param_shapes().items()}
        payloads = {}
        for i, part in enumerate([0, 0, 1, 1]):
            noise = torch.Generator().manual_seed(10 + i)
            delta = {n: base[n] + torch.randn(sh, generator=noise) for n, sh in layouts[part].items()}
            payloads[f"p{i}"] = make_strategy(s, part=part).encode(delta, 0)[0]
        decoded, invalid = engine.decode(payloads)
        assert not invalid
        settled = engine.conclude(decoded, None, delivered=False)
        assert settled.contributors == 4, settled.excluded
        return theta, engine.theta

    before, on = conclude(True)
    _, on_again = conclude(True)
    _, off = conclude(False)
    for n in before:
        assert torch.equal(on[n], on_again[n])
        moved_on, moved_off = (on[n] - before[n]).norm(), (off[n] - before[n]).norm()
        if slice_of(n) == FULL:
            assert torch.equal(on[n], off[n]), n
        elif moved_off > 0:
            assert moved_on / moved_off == pytest.approx(2 ** 0.5, rel=1e-4), n


def test_balanced_steps_are_off_in_a_run_without_slices_and_omitted_from_its_spec():
    whole = RunSpec(run_id="p").replace(model=TINY)
    assert make_strategy(whole).step_scales([{n: None for n in whole.param_shapes()}]) == {}
    assert "balance_steps" not in spec(4).to_toml()
    assert "balance_steps" in spec(4).replace(partial={"balance_steps": False}).to_toml()
