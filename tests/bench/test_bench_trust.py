"""bench/trust.py on its quick config: the direction check refuses a negated update, refuses no
honest one, without it the negated update costs loss, and each attacked arm is also compared with
its R + K honest control. Seconds."""

from __future__ import annotations

import json

import torch

from bench import trust


def test_quick_negate_is_refused_with_the_check_and_costs_loss_without(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert trust.main(["--quick", "--honest", "3", "--hostile", "1", "--attacks", "negate", "--kinds", "", "--seeds", "1",
                       "--jobs", "1", "--json", str(out)]) == 0
    summary = {(s["attack"], s["check"]): s for s in json.loads(out.read_text())["summary"]}
    on, off = summary[("negate", True)], summary[("negate", False)]
    assert on["hostile_refused"] == on["hostile_sent"] == 4 and on["honest_refused"] == 0
    assert on["gap"] == 0.0  # every hostile update refused: θ is the honest replicas' alone, bit for bit
    assert off["hostile_refused"] == 0 and off["gap"] > 0.01
    assert on["z_honest"][0] > 3 > on["z_hostile"][1]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["honest"], r["check"]) for r in rows if r["hostile"] == 0} >= {(4, True), (4, False)}  # the controls
    loss = {(r["honest"], r["hostile"], r["check"]): r["val_loss"] for r in rows}
    assert on["vs_control"] == loss[(3, 1, True)] / loss[(4, 0, True)] - 1
    assert off["vs_control"] == loss[(3, 1, False)] / loss[(4, 0, False)] - 1
    assert "vs R + K honest" in capsys.readouterr().out


def test_amplify_and_scale_multiply_only_hostile_senders_in_float32():
    t = {"w": torch.tensor([0.1, -0.3, 0.0, 7.0])}
    for attack, factor in (("amplify", trust.AMPLIFY), ("scale", 1e4)):
        tamper = trust.make_tamper(attack)
        assert torch.equal(tamper(0, f"{trust.HOSTILE}0", t)["w"], t["w"] * torch.tensor(factor, dtype=torch.float32))
        assert tamper(0, "replica0", t) is t  # honest senders untouched


def test_negate_third_negates_every_third_tensor_of_hostile_senders_only():
    t = {n: torch.tensor([0.5, -1.0]) for n in "abcdef"}
    tamper = trust.make_tamper("negate-third")
    out = tamper(0, f"{trust.HOSTILE}0", t)
    assert [bool(torch.equal(out[n], -t[n])) for n in "abcdef"] == [True, False, False, True, False, False]
    assert tamper(0, "replica0", t) is t


def test_a_turncoat_is_honest_for_its_first_rounds_then_negates():
    t = {"w": torch.tensor([0.5, -1.0])}
    tamper = trust.make_tamper("turncoat")
    assert tamper(trust.TURN - 1, f"{trust.HOSTILE}0", t) is t
    assert torch.equal(tamper(trust.TURN, f"{trust.HOSTILE}0", t)["w"], -t["w"])
    assert tamper(trust.TURN, "replica0", t) is t


def test_a_noisy_turncoat_is_honest_for_its_first_rounds_then_sends_noise_of_its_norm_on_its_support():
    t = {"w": torch.tensor([0.5, 0.0, -1.0, 2.0])}
    tamper = trust.make_tamper("turncoat-noise")
    assert tamper(trust.TURN - 1, f"{trust.HOSTILE}0", t) is t
    out = tamper(trust.TURN, f"{trust.HOSTILE}0", t)["w"]
    assert out[1] == 0 and torch.isclose(out.norm(), t["w"].norm()) and not torch.equal(out, t["w"])
    assert tamper(trust.TURN, "replica0", t) is t


def test_ascii_garbage_draws_bytes_1_to_127_only():
    from types import SimpleNamespace

    stream = trust.RandomTokens(SimpleNamespace(batch_size=4, seq_len=64), 128, seed=0, low=1)
    x, y = stream.next_batch()
    assert x.shape == (4, 64) and torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.min()) >= 1 and int(x.max()) <= 127 and int(y.min()) >= 1
