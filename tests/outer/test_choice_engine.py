"""At most K contributions a round (``outer.max_contributions``): every member draws the same K,
and a contribution passed over stays with its sender (peer/outer/engine.py, protocol/round/choice.py)."""

import pytest
import torch

from peer.outer.engine import RoundEngine
from peer.outer.strategies import make_strategy
from peer.round.simulate import simulate
from protocol.round import choice, eligibility
from protocol.spec import RunSpec

SPEC = RunSpec().replace(model={"d_model": 16, "n_layers": 1, "n_heads": 2, "ffn_hidden": 32, "seq_len": 8})


def engines(n, strategy="sparseloco", k=3):
    spec = SPEC.replace(outer={"strategy": strategy, "max_contributions": k})
    gen = torch.Generator().manual_seed(0)
    theta = {name: torch.randn(shape, generator=gen) for name, shape in spec.param_shapes().items()}
    return [RoundEngine(make_strategy(spec), {k: v.clone() for k, v in theta.items()}) for _ in range(n)]


def trained(theta, seed):
    common, gen = torch.Generator().manual_seed(99), torch.Generator().manual_seed(seed)
    return {k: v - 0.01 * (torch.randn(v.shape, generator=common) + 0.5 * torch.randn(v.shape, generator=gen))
            for k, v in theta.items()}


@pytest.mark.parametrize("strategy", ["sparseloco", "diloco", "dct"])
def test_members_take_the_same_k_and_the_passed_over_keep_their_update(strategy):
    group = engines(6, strategy)
    encoded = [e.encode(e.theta, trained(e.theta, seed=i)) for i, e in enumerate(group)]
    payloads = {f"peer{i}": data for i, (data, _) in enumerate(encoded)}
    outcomes = [e.settle_round(payloads, encoded[i][1], me=f"peer{i}") for i, e in enumerate(group)]
    assert len({e.params_hash() for e in group}) == 1
    assert all(o.contributors == 3 and len(o.passed) == 3 and o.passed == outcomes[0].passed for o in outcomes)
    for i, (e, o) in enumerate(zip(group, outcomes)):
        assert o.delivered == (f"peer{i}" not in o.passed)
        signal = encoded[i][1].signal
        kept = e.strategy.local_state()
        if not o.delivered:  # all of the round's signal is still here, for a later round
            assert all(torch.equal(kept[k], signal[k.split(".", 1)[1]]) for k in kept) and kept
    # the next round's signal of a passed-over peer still holds the round it missed (DiLoCo: all of it)
    passed = int(outcomes[0].passed[0][4:])
    e = group[passed]
    again = e.strategy.signal({n: torch.zeros_like(t) for n, t in e.theta.items()})
    missed = encoded[passed][1].signal
    if strategy == "diloco":
        assert all(torch.equal(again[n], missed[n]) for n in again)
    else:  # the error feedback's or the DCT momentum's decay
        assert all(torch.allclose(again[n], missed[n] * e.strategy.decay) for n in again)


def test_off_and_below_k_nothing_changes():
    for k in (0, 6):
        group = engines(2, k=k) + engines(4, k=k)[2:]
        encoded = [e.encode(e.theta, trained(e.theta, seed=i)) for i, e in enumerate(group)]
        payloads = {f"peer{i}": data for i, (data, _) in enumerate(encoded)}
        chosen, invalid, passed = group[0].choose(payloads, 0, group[0].params_hash())
        assert chosen == payloads and not invalid and not passed


def test_a_payload_with_a_bad_header_is_invalid_and_takes_no_place():
    group = engines(5, k=3)
    encoded = [e.encode(e.theta, trained(e.theta, seed=i)) for i, e in enumerate(group)]
    payloads = {f"peer{i}": data for i, (data, _) in enumerate(encoded)}
    payloads["bad"] = b"\x81\xa1v\x01"
    chosen, invalid, passed = group[0].choose(payloads, 0, group[0].params_hash())
    assert list(invalid) == ["bad"] and len(chosen) == 3 and len(passed) == 2


def test_a_simulated_swarm_takes_k_a_round_and_followers_match_members_that_conclude_themselves():
    spec = RunSpec(seed=3).replace(
        model={"d_model": 32, "n_layers": 1, "n_heads": 2, "ffn_hidden": 64, "seq_len": 16},
        data={"batch_size": 2, "val_batches": 1}, outer={"inner_steps": 2, "max_contributions": 2, "min_agreement": 0.0})
    every = simulate(spec, 5, 3, keep_theta=True, verify_rounds=2)
    led = simulate(spec, 5, 3, keep_theta=True, verify_rounds=1, conclude_rounds=1)
    assert [s.contributors for s in every.history] == [2, 2, 2]
    assert [s.params_hash for s in every.history] == [s.params_hash for s in led.history]
    assert all(torch.equal(every.theta[n], led.theta[n]) for n in every.theta)


def test_a_diloco_carry_survives_a_checkpoint_and_an_older_checkpoint_has_none():
    (e,) = engines(1, "diloco")
    data, pending = e.encode(e.theta, trained(e.theta, seed=1))
    e.defer(pending)  # a round with no group: DiLoCo keeps it too
    saved = e.strategy.local_state()
    assert set(saved) == {f"carry.{n}" for n in e.theta}
    fresh = make_strategy(e.strategy.spec)
    fresh.load_local_state(saved)
    assert all(torch.equal(fresh.carry[n], pending.signal[n]) for n in e.theta)
    fresh.load_local_state({})
    assert fresh.carry == {} and fresh.local_state() == {}
    with pytest.raises(ValueError):
        fresh.load_local_state({"carry.nothing": torch.zeros(1)})


def test_each_round_moves_the_eligibility_table_alike_and_it_travels_with_the_state():
    """protocol/round/eligibility.py: the draw's candidates per part move p; members hold the same
    table, it is part of the state digest, a redo starts from the snapshot's, a shared state carries it."""
    group = engines(40, k=2)
    for round_no in range(2):
        encoded = [e.encode(e.theta, trained(e.theta, seed=i + 10 * round_no)) for i, e in enumerate(group)]
        payloads = {f"peer{i}": data for i, (data, _) in enumerate(encoded)}
        snap, base = group[0].snapshot(), group[0].params_hash()
        for i, e in enumerate(group):
            e.settle_round(payloads, encoded[i][1], me=f"peer{i}")
    tables = {tuple(sorted(e.eligibility.items())) for e in group}
    assert len(tables) == 1 and 0 < group[0].eligibility["-1"] < eligibility.CAP
    assert len({e.state_digest() for e in group}) == 1
    before = group[1].state_digest()
    group[1].install(group[1].theta, group[1].round, eligibility={})
    assert group[1].state_digest() != before
    meta, _ = group[0].shareable()
    assert meta["eligibility"] == group[0].eligibility
    # concluding the last round again starts from the table it started from, moved by that round's draw
    table = dict(group[0].eligibility)
    group[0].choose(payloads, snap[0], base, *snap[3:5])
    group[0].redo(snap, [])
    assert group[0].eligibility == table != snap[4]
    group[0].redo(snap, [])  # no draw of that round this time: not moved
    assert group[0].eligibility == snap[4]


def test_a_payload_from_a_member_that_was_not_to_send_is_passed_over_alike_everywhere():
    """A lone peer's own set, or a set anyone makes up, can put such a payload in the union: the draw
    takes only the senders the eligibility table let send, and only they count for the table."""
    e = engines(1, k=2)[0]
    data, _ = e.encode(e.theta, trained(e.theta, seed=1))
    payloads = {f"peer{i:02d}": data for i in range(40)}
    e.install(e.theta, 0, eligibility={"-1": eligibility.ONE})  # fresh members send at a quarter
    chosen, invalid, passed = e.choose(payloads, 0, "base")
    sent = eligibility.contributors({s: -1 for s in payloads}, "base:0", e.eligibility, e.standing)
    assert 2 < len(sent) < 25 and set(chosen) <= sent and not invalid
    assert set(passed) == set(payloads) - set(chosen)
    assert e._candidates[0] == {"-1": [(s, 1) for s in sorted(sent)]}  # each candidate, fresh (weight 1)


def test_the_table_counts_the_standing_the_round_gave_its_candidates():
    """The engine hands protocol/round/eligibility.py ``update`` each candidate's weight at the draw and
    after the round's standing moved: senders that counted weigh more next round, and p aims at that."""
    group = engines(2, k=2)
    encoded = [e.encode(e.theta, trained(e.theta, seed=i)) for i, e in enumerate(group)]
    payloads = {f"peer{i:02d}": encoded[i % 2][0] for i in range(12)}
    e = group[0]
    e.settle_round(payloads, encoded[0][1], me="peer00")  # round 0 from CAP: all 12 sent
    grew = {s for s, n in e.standing.items() if n > 0}
    assert grew  # the drawn ones counted
    expected = eligibility.update({}, {"-1": [(1, choice.weight(e.standing.get(s, 0))) for s in sorted(payloads)]}, 2)
    assert e.eligibility == expected != eligibility.update({}, {"-1": [(1, 1)] * 12}, 2)
