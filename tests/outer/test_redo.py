"""A round concluded again (``RoundEngine.redo``): our own payload enters θ once whatever the second
conclusion decides, and a conclusion that raises leaves the engine as it was (peer/outer/engine.py)."""

import pytest
import torch

from peer.outer import engine as engine_module
from peer.outer.engine import RoundEngine
from peer.outer.robust import Contributions
from peer.outer.strategies import make_strategy
from protocol.spec import RunSpec

SPEC = RunSpec().replace(model={"d_model": 16, "n_layers": 1, "n_heads": 2, "ffn_hidden": 32, "seq_len": 8})
STRATEGIES = ["sparseloco", "diloco", "dct"]


def make(strategy):
    spec = SPEC.replace(outer={"strategy": strategy})
    gen = torch.Generator().manual_seed(0)
    theta = {name: torch.randn(shape, generator=gen) for name, shape in spec.param_shapes().items()}
    engine = RoundEngine(make_strategy(spec), theta)
    engine.standing = {"me": 20, "mate": 20}  # established senders: counted without pooled evidence
    return engine


def trained(theta, seed):
    common, gen = torch.Generator().manual_seed(99), torch.Generator().manual_seed(seed)
    return {k: v - 0.01 * (torch.randn(v.shape, generator=common) + 0.5 * torch.randn(v.shape, generator=gen))
            for k, v in theta.items()}


def decoded(engine, payloads):
    out, invalid = engine.decode_at(payloads, 0)
    assert not invalid
    return out


def buffers(engine):
    """The local buffers as tensors by parameter name (an empty DiLoCo carry: zeros)."""
    state = {k.split(".", 1)[1]: v for k, v in engine.strategy.local_state().items()}
    return {n: state.get(n, torch.zeros(t.shape)) for n, t in engine.theta.items()}


def first_round(strategy, counted):
    """An engine that concluded round 0 with its own payload counted or not, the round's snapshot, and
    the payloads: ours (``me``) and a groupmate's."""
    e, mate = make(strategy), make(strategy)
    data, pending = e.encode(e.theta, trained(e.theta, 1))
    other, _ = mate.encode(mate.theta, trained(mate.theta, 2))
    payloads = {"me": data, "mate": other}
    snap = e.snapshot()
    first = decoded(e, payloads if counted else {"mate": other})
    settled = e.conclude(first, pending, delivered=counted, me="me")
    assert settled.delivered == counted
    return e, snap, payloads


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("counted_first", [True, False])
def test_a_redo_that_changes_whether_ours_counts_moves_it_into_or_out_of_the_buffers(strategy, counted_first):
    """Against an engine that concluded the round once as the redo does, the signal the buffers carry
    forward is the same: ours enters θ once, neither twice nor never."""
    e, snap, payloads = first_round(strategy, counted_first)
    ref, _, _ = first_round(strategy, not counted_first)
    again = payloads if not counted_first else {"mate": payloads["mate"]}
    settled = e.redo(snap, decoded(e, again), me="me", own=payloads["me"])
    assert settled.delivered == (not counted_first)
    assert e.params_hash() == ref.params_hash()
    for n, t in buffers(ref).items():
        assert torch.allclose(buffers(e)[n], t, atol=1e-6), n


def settle_next(engine, pending, how):
    """The round encoded after the first one settles: deferred (its whole signal stays) or counted."""
    if how == "defer":
        engine.defer(pending)
    else:
        engine.conclude(Contributions([], []), pending, delivered=True)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("counted_first", [True, False])
@pytest.mark.parametrize("how", ["defer", "delivered"])
def test_a_redo_while_the_next_round_is_encoded_corrects_once_that_round_settles(strategy, counted_first, how):
    """The next round's payload was encoded from the old buffers (and sent): the correction waits for
    that round's settle, which rewrites the buffers, and then what was sent plus what is kept equals
    what the engine that concluded the first round as the redo did sent plus kept."""
    e, snap, payloads = first_round(strategy, counted_first)
    ref, _, _ = first_round(strategy, not counted_first)
    _, pending = e.encode(e.theta, trained(e.theta, 3))
    _, ref_pending = ref.encode(ref.theta, trained(ref.theta, 3))
    again = payloads if not counted_first else {"mate": payloads["mate"]}
    e.redo(snap, decoded(e, again), me="me", own=payloads["me"])
    assert e.params_hash() == ref.params_hash()
    before = buffers(e)
    settle_next(e, pending, how)
    settle_next(ref, ref_pending, how)
    assert any(not torch.equal(before[n], buffers(e)[n]) for n in before)
    kept, ref_kept = buffers(e), buffers(ref)
    if how == "delivered":  # what was sent differs (encoded from other buffers): compare sent + kept
        kept = {n: t + pending.sent.get(n, torch.zeros(t.shape)) for n, t in kept.items()}
        ref_kept = {n: t + ref_pending.sent.get(n, torch.zeros(t.shape)) for n, t in ref_kept.items()}
    for n, t in ref_kept.items():
        assert torch.allclose(kept[n], t, atol=1e-5), n


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_redo_after_a_deferred_round_decays_the_correction_once_per_encode(strategy):
    """Round 0, then round 1 encoded and deferred, encoded again, and round 0 concluded again: the
    correction is carried two encodes (β² for the error feedback), as the buffer it belonged to was."""
    e, snap, payloads = first_round(strategy, True)
    ref, _, _ = first_round(strategy, False)
    for engine in (e, ref):
        engine.defer(engine.encode(engine.theta, trained(engine.theta, 3))[1])
    _, pending = e.encode(e.theta, trained(e.theta, 4))
    _, ref_pending = ref.encode(ref.theta, trained(ref.theta, 4))
    e.redo(snap, decoded(e, {"mate": payloads["mate"]}), me="me", own=payloads["me"])
    e.defer(pending)
    ref.defer(ref_pending)
    for n, t in buffers(ref).items():
        assert torch.allclose(buffers(e)[n], t, atol=1e-5), n


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_redos_that_flip_and_flip_back_leave_the_buffers_as_they_were(strategy):
    e, snap, payloads = first_round(strategy, True)
    before = buffers(e)
    e.redo(snap, decoded(e, {"mate": payloads["mate"]}), me="me", own=payloads["me"])
    assert any(not torch.equal(before[n], t) for n, t in buffers(e).items())
    e.redo(snap, decoded(e, payloads), me="me", own=payloads["me"])
    for n, t in before.items():
        assert torch.allclose(buffers(e)[n], t, atol=1e-6), n


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_redo_that_keeps_whether_ours_counts_leaves_the_buffers(strategy):
    e, snap, payloads = first_round(strategy, True)
    before = buffers(e)
    e.redo(snap, decoded(e, payloads), me="me", own=payloads["me"])
    assert all(torch.equal(before[n], t) for n, t in buffers(e).items())


def test_a_redo_that_raises_leaves_the_engine_as_it_was(monkeypatch):
    e, snap, payloads = first_round("sparseloco", True)
    e.standing = {"someone": 3}
    state = (e.round, e.params_hash(), dict(e.standing), {k: v.clone() for k, v in e.strategy.shared_state().items()})

    def fails(*args, **kwargs):
        raise RuntimeError("the outer step failed")

    monkeypatch.setattr(engine_module, "robust_step", fails)
    with pytest.raises(RuntimeError, match="outer step failed"):
        e.redo(snap, Contributions([], []), me="me", own=payloads["me"])
    assert (e.round, e.params_hash(), e.standing) == state[:3]
    assert e.eligibility == {} and e.evidence == {}
    assert all(torch.equal(v, state[3][k]) for k, v in e.strategy.shared_state().items())


def test_a_state_installed_since_drops_what_a_redo_would_recount():
    """Buffers forgotten (a state of another lineage): a redo of the old round moves nothing into them."""
    e, snap, payloads = first_round("sparseloco", True)
    e.install({n: t.clone() for n, t in e.theta.items()}, e.round, forget_local=True)
    e.redo(snap, decoded(e, {"mate": payloads["mate"]}), me="me", own=payloads["me"])
    assert all(not t.any() for t in buffers(e).values())
