"""SparseLoCo's chosen average and its floor, ``outer.sparseloco.min_share`` (peer/outer/strategies.py
``average``): milliseconds."""

from __future__ import annotations

import pytest
import torch

from peer.outer.strategies import average, make_strategy
from protocol.errors import SpecError
from protocol.spec import RunSpec


def vec(*values):
    return torch.tensor(values, dtype=torch.float32)


# four payloads of one tensor: coordinate 0 kept by all four, 1 by one, 2 by two, 3 by nobody
PAYLOADS = [{"w": vec(1.0, 8.0, 2.0, 0.0)}, {"w": vec(3.0, 0.0, 4.0, 0.0)},
            {"w": vec(5.0, 0.0, 0.0, 0.0)}, {"w": vec(7.0, 0.0, 0.0, 0.0)}]


def test_a_coordinate_is_divided_by_no_fewer_than_the_share_of_its_payloads():
    got = average(["w"], PAYLOADS, over_choosers=True, min_share=0.5)["w"]
    # 4 payloads x 0.5: a coordinate kept by one or two is divided by 2, one kept by all four by 4
    assert torch.equal(got, vec(16.0 / 4, 8.0 / 2, 6.0 / 2, 0.0))


def test_a_floor_of_at_most_one_payload_is_the_chosen_average_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    decoded = [{"w": torch.randn(256, generator=gen) * (torch.rand(256, generator=gen) < 0.2)} for _ in range(4)]
    chosen = average(["w"], decoded, over_choosers=True)["w"]
    for share in (0.0, 0.1, 0.25):  # 4 x 0.25 = 1: nothing is divided by more than its choosers
        assert torch.equal(average(["w"], decoded, over_choosers=True, min_share=share)["w"], chosen)


def test_a_floor_of_every_payload_is_the_mean_bit_for_bit():
    gen = torch.Generator().manual_seed(1)
    decoded = [{"w": torch.randn(256, generator=gen) * (torch.rand(256, generator=gen) < 0.2)} for _ in range(5)]
    assert torch.equal(average(["w"], decoded, over_choosers=True, min_share=1.0)["w"],
                       average(["w"], decoded)["w"])


def test_the_floor_counts_the_payloads_that_carry_the_tensor_only():
    # a slice owner's payload carries "a" only: "b" has two carriers, so its floor is 0.5 x 2 = 1
    decoded = [{"a": vec(2.0, 0.0), "b": vec(6.0, 0.0)}, {"a": vec(4.0, 0.0), "b": vec(0.0, 3.0)},
               {"a": vec(0.0, 8.0)}, {"a": vec(0.0, 2.0)}]
    got = average(["a", "b"], decoded, over_choosers=True, min_share=0.5)
    assert torch.equal(got["a"], vec(6.0 / 2, 10.0 / 2))
    assert torch.equal(got["b"], vec(6.0, 3.0))


def test_with_fresh_senders_the_floor_is_a_share_of_the_weights():
    # 2 established and 2 fresh: the fresh weigh 1/3 in all, 0.5 each (protocol/round/standing.weights)
    established = [True, True, False, False]
    got = average(["w"], PAYLOADS, over_choosers=True, established=established, min_share=0.5)["w"]
    # the weights sum to 3, so a coordinate is divided by no less than 1.5 of them
    want = vec((1 + 3 + 0.5 * 5 + 0.5 * 7) / 3, 8.0 / 1.5, (2 + 4) / 2, 0.0)
    assert torch.allclose(got, want)


def test_with_fresh_senders_a_floor_of_at_most_one_payload_is_none():
    # 4 payloads x 0.25: the weighted average of before, though a fresh sender's weight is below 1
    established = [True, True, False, False]
    lone = [{"w": vec(0.0, 1.0)}, {"w": vec(0.0, 3.0)}, {"w": vec(4.0, 0.0)}, {"w": vec(0.0, 0.0)}]
    before = average(["w"], lone, over_choosers=True, established=established)["w"]
    assert torch.equal(average(["w"], lone, over_choosers=True, established=established, min_share=0.25)["w"], before)
    assert before[0].item() == 4.0  # kept by one fresh sender: its own value


@pytest.mark.parametrize("split", [(2, 3), (2, 6), (5, 7), (2, 9), (4, 11)])
def test_with_fresh_senders_a_floor_of_every_weight_is_the_weighted_mean_bit_for_bit(split):
    established, fresh = split
    gen = torch.Generator().manual_seed(established * 100 + fresh)
    decoded = [{"w": torch.randn(512, generator=gen) * (torch.rand(512, generator=gen) < 0.3)}
               for _ in range(established + fresh)]
    flags = [True] * established + [False] * fresh
    assert torch.equal(average(["w"], decoded, over_choosers=True, established=flags, min_share=1.0)["w"],
                       average(["w"], decoded, established=flags)["w"])


def test_the_strategy_reads_the_share_from_the_spec():
    spec = RunSpec().replace(model={"d_model": 16, "n_layers": 1, "n_heads": 2, "ffn_hidden": 32, "seq_len": 8},
                             outer={"sparseloco": {"min_share": 0.5}})
    strategy = make_strategy(spec)
    decoded = [{n: torch.zeros(s) for n, s in strategy.full_layout.items()} for _ in range(4)]
    name = next(iter(strategy.full_layout))
    decoded[0][name].view(-1)[0] = 8.0
    assert strategy.aggregate(decoded)[name].view(-1)[0].item() == 4.0


def test_the_share_is_checked_and_left_out_of_the_spec_at_its_default():
    assert RunSpec().outer.sparseloco.min_share == 0.25 and "min_share" not in RunSpec().to_toml()
    for other in (0.0, 0.5):  # the chosen average of before is a setting of its own
        assert "min_share" in RunSpec().replace(outer={"sparseloco": {"min_share": other}}).to_toml()
    for bad in (-0.1, 1.5):
        with pytest.raises(SpecError, match="min_share"):
            RunSpec().replace(outer={"sparseloco": {"min_share": bad}})
