"""bench/partial.py: the pieces of the partial-updates benchmark, on a tiny model."""


import pytest
import torch

from peer.training.data import load_corpus, val_batches
from protocol.spec import ModelSpec
from tests.support.bench_loader import load_bench

bp = load_bench("partial")

TINY = dict(d_model=32, n_layers=2, n_heads=2, ffn_hidden=64, seq_len=32)
CFG = dict(sim_model="tiny", batch_size=4, inner_steps=3, rounds=2, lr=3e-3, warmup=2, val_batches=2)


@pytest.fixture(autouse=True)
def tiny_shape(monkeypatch):
    monkeypatch.setitem(bp.SHAPES, "tiny", TINY)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_resliced_models_compute_the_same_function():
    theta = bp.full_init(TINY)
    x = torch.randint(0, 256, (2, TINY["seq_len"]))
    assert bp.check_reslice(CFG, theta, x) < 1e-4


def test_frozen_slices_skip_only_weight_gradient_flops():
    ms = ModelSpec(**TINY)
    x = torch.randint(0, 256, (2, ms.seq_len))
    flops = {}
    for slices in bp.SLICES:
        model = bp.fresh_model(ms, slices)
        bp.freeze(model, bp.owned_shapes(bp.make_spec(TINY, slices), bp.part_of(slices)))
        flops[slices] = bp.step_flops(model, x)
    share = bp.flop_shares(TINY, 2)
    assert flops[1] == share["total"] and flops[1] > flops[2] > flops[4]
    for s in (2, 4):  # exactly (1 - 1/S) of the MLP weight-gradient FLOPs are skipped
        assert flops[1] - flops[s] == pytest.approx((1 - 1 / s) * share["mlp_wgrad"], rel=1e-9)


# big enough that every weight matrix (256 KiB) is its own mapping under the fixed mmap threshold, so the
# RSS peak must rise by the new state; the tiny model's tensors fit in heap pages the warm-up freed (a
# peak of 0 to 60 KB, possibly 0)
SMALL = dict(d_model=128, n_layers=2, n_heads=2, ffn_hidden=512, seq_len=32)


def test_memory_probe_reports_smaller_state_for_a_partial_peer():
    full = bp.run_probe(SMALL, 1, batch=2, steps=1, threads=1, device="cpu", fixed_mmap=True)
    part = bp.run_probe(SMALL, 4, batch=2, steps=1, threads=1, device="cpu", fixed_mmap=True)
    assert full["param_bytes"] == part["param_bytes"] == 4 * ModelSpec(**SMALL).num_params()
    assert part["grad_bytes"] < full["grad_bytes"] and part["opt_bytes"] < full["opt_bytes"]
    assert part["trainable"] < full["trainable"]
    # the full peer's grads and Adam moments (3 x 2.4 MB) are new mappings; the partial peer's are smaller
    assert full["rss_peak"] >= 3 * full["param_bytes"] and 0 < part["rss_peak"] < full["rss_peak"]


def test_partial_simulation_runs_and_sends_less():
    corpus = load_corpus("stdlib", max_bytes=2 << 20)
    val = val_batches(corpus, TINY["seq_len"], CFG["batch_size"], CFG["val_batches"])
    theta = bp.full_init(TINY)
    rows = [bp.simulate_partial(CFG, s, CFG["rounds"], corpus, val, theta) for s in bp.SLICES]
    for r in rows:  # θ identity across replicas and frozen tensors are asserted inside
        assert r["tokens"] == bp.R * CFG["rounds"] * CFG["inner_steps"] * CFG["batch_size"] * TINY["seq_len"]
        assert r["val_loss"] < r["initial_val_loss"]
    assert rows[0]["sent_per_peer"] > rows[1]["sent_per_peer"] > rows[2]["sent_per_peer"]
    assert rows[0]["trainable"] > rows[1]["trainable"] > rows[2]["trainable"]
