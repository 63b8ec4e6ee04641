"""peer/round/simulate.py: the in-process replica simulation learns, keeps θ identical, counts real bytes."""

import math

import pytest
import torch

from peer.training.data import load_corpus
from protocol.wire.exchange_bytes import allgather_bytes_per_round, allreduce_bytes_per_step
from peer.round.simulate import (
    simulate,
    train_single,
)
from peer.outer.strategies import average, make_strategy
from protocol.wire.payload import payload_max_bytes
from protocol.spec import ModelSpec, RunSpec

TINY = ModelSpec(d_model=32, n_layers=2, n_heads=2, ffn_hidden=64, seq_len=32)
H, ROUNDS, R = 8, 5, 2


def _spec(strategy: str) -> RunSpec:
    return RunSpec(run_id="test-sim", model=TINY).replace(
        data={"batch_size": 8, "val_batches": 2},
        inner={"lr": 3e-3, "warmup_steps": 4, "total_steps": H * ROUNDS},
        outer={"strategy": strategy, "inner_steps": H},
    )


@pytest.fixture(scope="module")
def corpus():
    return load_corpus("stdlib")


@pytest.fixture(scope="module", autouse=True)
def threads():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("strategy", ["diloco", "sparseloco", "dct"])
def test_simulate_learns_and_counts_real_bytes(corpus, strategy):
    spec = _spec(strategy)
    # every replica decodes every payload itself in every round: θ checked bit-identical each round
    res = simulate(spec, R, ROUNDS, corpus=corpus, eval_every=ROUNDS, verify_rounds=ROUNDS)
    assert res.verified_rounds == ROUNDS and len(res.history) == ROUNDS
    assert res.final_val_loss < res.initial_val_loss - 0.3, (res.initial_val_loss, res.final_val_loss)
    assert res.tokens == R * ROUNDS * H * spec.data.batch_size * TINY.seq_len

    # payload sizes: what a fresh encode of any tensors gives (every field of a fixed length), or
    # within a few percent of it for SparseLoCo (entropy-coded indices), and within the receivers' bound
    layout = TINY.param_shapes()
    strategy_obj = make_strategy(spec, layout)
    expected = len(strategy_obj.encode({n: torch.randn(s) for n, s in layout.items()}, 0)[0])
    sizes = [b for r in res.history for b in r.payload_bytes]
    slack = 0.03 * expected if strategy == "sparseloco" else 0
    assert all(abs(b - expected) <= slack for b in sizes), (sizes, expected)
    assert max(sizes + [expected]) <= payload_max_bytes(strategy_obj.codec, layout)
    dense = 4 * TINY.num_params()
    if strategy == "diloco":
        assert dense < expected < dense + 64 * len(layout) + 256
    else:
        assert expected < dense / 20

    # all-gather accounting: each peer sends its payload to the R-1 others every round
    assert res.bytes_sent_per_peer == pytest.approx((R - 1) * sum(sizes) / R) == res.bytes_received_per_peer
    assert res.dp_bytes_per_peer == pytest.approx(ROUNDS * H * 2 * (R - 1) / R * dense)


def test_chosen_aggregate_and_single_baseline(corpus):
    a = {"w": torch.tensor([1.0, 0.0, 2.0, 0.0])}
    b = {"w": torch.tensor([3.0, 5.0, 0.0, 0.0])}
    assert torch.equal(average(["w"], [a, b], over_choosers=True)["w"], torch.tensor([2.0, 5.0, 2.0, 0.0]))
    for how in ("chosen", "mean"):
        res = simulate(_spec("sparseloco").replace(outer={"sparseloco": {"aggregate": how}}), R, 2, corpus=corpus, eval_every=0)
        assert math.isfinite(res.final_val_loss) and res.aggregate == how

    single = train_single(_spec("diloco"), 20, corpus=corpus, eval_every=10)
    assert [p["step"] for p in single.history] == [10, 20]
    assert single.final_val_loss < single.initial_val_loss - 0.3
    assert single.tokens == 20 * 8 * TINY.seq_len


def test_byte_models():
    assert allreduce_bytes_per_step(1000, 1) == 0
    assert allreduce_bytes_per_step(1000, 4) == 2 * 3 / 4 * 4 * 1000
    assert allgather_bytes_per_round(100, 8) == 700


def test_the_floor_applies_past_four_replicas_and_every_replica_concludes_alike(corpus):
    """outer.sparseloco.min_share through the real round engines: 6 replicas, every one concluding
    every round itself (the simulation asserts their θ bit-identical), end on another θ than the
    chosen average without the floor; at 4 replicas the two are one θ."""
    def theta(replicas, share):
        spec = _spec("sparseloco").replace(outer={"sparseloco": {"min_share": share}})
        res = simulate(spec, replicas, 2, corpus=corpus, eval_every=0, verify_rounds=2, keep_theta=True)
        assert res.verified_rounds == 2 and res.min_share == share
        return res.theta

    floored, plain = theta(6, 0.25), theta(6, 0.0)
    assert any(not torch.equal(floored[n], plain[n]) for n in floored)
    four, four_plain = theta(4, 0.25), theta(4, 0.0)
    assert all(torch.equal(four[n], four_plain[n]) for n in four)
