"""The round engine on its own: no processes, no network, milliseconds."""

import threading

import pytest
import torch

from peer.outer.engine import RoundEngine
from peer.checkpoints.files import params_hash
from peer.outer.strategies import make_strategy
from protocol.spec import RunSpec

SPEC = RunSpec().replace(model={"d_model": 16, "n_layers": 1, "n_heads": 2, "ffn_hidden": 32, "seq_len": 8})


def engines(n, strategy="sparseloco"):
    spec = SPEC.replace(outer={"strategy": strategy})
    gen = torch.Generator().manual_seed(0)
    theta = {name: torch.randn(shape, generator=gen) for name, shape in spec.param_shapes().items()}
    return spec, [RoundEngine(make_strategy(spec), {k: v.clone() for k, v in theta.items()}) for _ in range(n)]


def trained(theta, seed):
    """θ after "training": a direction every member shares plus a member's own (independent random
    updates share no direction, and the direction check of peer/outer/consensus.py refuses them)."""
    common, gen = torch.Generator().manual_seed(99), torch.Generator().manual_seed(seed)
    return {k: v - 0.01 * (torch.randn(v.shape, generator=common) + 0.5 * torch.randn(v.shape, generator=gen))
            for k, v in theta.items()}


@pytest.mark.parametrize("strategy", ["sparseloco", "diloco", "dct"])
def test_members_settle_to_identical_theta_whatever_their_own_payload(strategy):
    spec, group = engines(3, strategy)
    encoded = [e.encode(e.theta, trained(e.theta, seed=i)) for i, e in enumerate(group)]
    payloads = {f"peer{i}": data for i, (data, _) in enumerate(encoded)}
    before = group[0].params_hash()
    outcomes = [e.settle_round(payloads, encoded[i][1], me=f"peer{i}") for i, e in enumerate(group)]
    assert all(o.round == 0 and o.contributors == 3 and o.delivered and not o.excluded for o in outcomes)
    assert all(e.round == 1 for e in group)
    hashes = {e.params_hash() for e in group}
    assert len(hashes) == 1 and hashes != {before}
    assert group[0].params_hash() == params_hash(group[0].theta)  # the cache follows θ


def test_an_invalid_payload_is_excluded_and_the_rest_still_counts():
    spec, (a, b) = engines(2)
    data_a, pending_a = a.encode(a.theta, trained(a.theta, 1))
    data_b, _ = b.encode(b.theta, trained(b.theta, 2))
    settled = a.settle_round({"a": data_a, "b": data_b[:-3], "c": b"garbage"}, pending_a, me="a")
    assert settled.contributors == 1 and settled.delivered
    assert set(settled.excluded) == {"b", "c"} and all(r.startswith("invalid payload") for r in settled.excluded.values())


def test_own_payload_excluded_by_the_group_is_kept_in_the_local_buffer():
    spec, (a,) = engines(1)
    data, pending = a.encode(a.theta, trained(a.theta, 1))
    settled = a.settle_round({"a": data}, pending, me="a", excluded={"a": "sent different payloads to different members"})
    assert not settled.delivered
    # not delivered: the error buffer holds the whole signal, nothing was subtracted
    assert all(torch.equal(a.strategy.buffer[n], pending.signal[n]) for n in pending.signal)


def test_defer_keeps_the_round_and_theta():
    spec, (a,) = engines(1)
    h = a.params_hash()
    _, pending = a.encode(a.theta, trained(a.theta, 1))
    a.defer(pending)
    assert a.round == 0 and a.params_hash() == h


def test_install_with_a_shared_state_that_does_not_fit_changes_nothing():
    spec, (a,) = engines(1, "diloco")
    h, momentum = a.params_hash(), {k: v.clone() for k, v in a.strategy.momentum.items()}
    theta = {k: v + 1 for k, v in a.theta.items()}
    bad = {f"momentum.{n}": torch.ones(s) for n, s in spec.param_shapes().items()}
    bad[next(iter(bad))] = torch.full(bad[next(iter(bad))].shape, float("nan"))
    with pytest.raises(ValueError):
        a.install(theta, 5, bad)
    assert a.round == 0 and a.params_hash() == h
    assert all(torch.equal(a.strategy.momentum[k], v) for k, v in momentum.items())
    a.install(theta, 5)
    assert a.round == 5 and a.params_hash() == params_hash(theta)


def test_shareable_state_is_consistent_while_rounds_conclude():
    spec, (a,) = engines(1)
    seen = []

    def serve():
        for _ in range(20):
            meta, tensors = a.shareable()
            seen.append((meta["round"], params_hash(dict(zip(meta["names"], tensors)))))

    t = threading.Thread(target=serve)
    t.start()
    hashes = {0: a.params_hash()}
    for r in range(5):
        data, pending = a.encode(a.theta, trained(a.theta, r))
        a.settle_round({"a": data}, pending, me="a")
        hashes[a.round] = a.params_hash()
    t.join()
    assert all(hashes[r] == h for r, h in seen)  # never a θ of one round labelled with another


def test_a_record_read_without_waiting_reports_theta_of_this_round_or_no_hash():
    """What a training peer's progress record reports (``RoundEngine.reported(waits=False)``): θ's
    hash while the lock is free, the last one reported while the exchange holds the lock in the same
    round, and no hash (never a stale one) once the round or θ changed under the lock."""
    spec, (a, b) = engines(2)
    want = (0, a.params_hash(), a.state_digest())
    assert a.reported(waits=False) == want == a.reported()
    held, release = threading.Event(), threading.Event()

    def exchange(change):
        with a.lock:
            held.set()
            release.wait(10)
            change()

    for change, after in ((lambda: None, want), (lambda: a.install(b.theta, 0), (0, "", "")),
                          (lambda: a.settle_round({}, None, me="a"), (1, "", ""))):
        held.clear(), release.clear()
        t = threading.Thread(target=exchange, args=(change,))
        t.start()
        held.wait(10)
        assert a.reported(waits=False) == want  # the lock is held: no wait, the last report
        release.set()
        t.join(10)
        if after != want:
            with a.lock:  # the change made, the lock held again: its hash is not cached yet
                got = []
                t = threading.Thread(target=lambda: got.append(a.reported(waits=False)))
                t.start(), t.join(10)
            assert got == [after]
        want = a.reported()
    assert a.reported(waits=False) == (1, a.params_hash(), a.state_digest())
