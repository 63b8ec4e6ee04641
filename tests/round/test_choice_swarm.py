"""At most K contributions a round, in a real swarm (``outer.max_contributions``, peer/outer/engine.py
``choose``): 4 peers in groups of at most 2 merge their groups' sets each round and take 2 of the 4
payloads into θ, the same 2 on every peer; the peer passed over keeps its update and says so. The
other group's set comes as its list, and only the drawn payloads of it are fetched."""

from __future__ import annotations

import re

import pytest

from tests.support.swarm_harness import Swarm, TINY_SPEC, assert_groups_identical, hashes_by_round

NAMES = ("a", "b", "c", "d")
CHOSE = re.compile(r"round (\d+): (\d+) of (\d+) contributions enter θ \(outer.max_contributions = 2 a part; (.*)\)")
DREW = re.compile(r"round (\d+): drew (\d+) of (\d+) contributions and fetched (\d+) of them")


def _train(tmp_path, run_id, names, k, group, rounds, timeout):
    """(statuses, logs) of ``names`` trained ``rounds`` rounds with K = ``k`` in groups of at most ``group``."""
    spec = TINY_SPEC.format(run_id=run_id, strategy="sparseloco", inner_steps=10)
    spec = spec.replace("inner_steps = 10\n", f"inner_steps = 10\nmax_contributions = {k}\n") + f"max_group_size = {group}\n"
    swarm = Swarm(tmp_path, spec_text=spec)
    try:
        for name in names:
            swarm.add_peer(name, "--wait-peers", str(len(names)))
        swarm.wait(lambda: min(swarm.round_of(n) for n in names) >= rounds, timeout, f"{rounds} rounds of every peer")
        return [swarm.status(n) for n in names], {n: swarm.peers[n].text() for n in names}
    finally:
        swarm.close()


@pytest.mark.slow
def test_four_peers_take_two_contributions_a_round_and_stay_one_model(tmp_path):
    statuses, logs = _train(tmp_path, "choice", NAMES, k=2, group=2, rounds=4, timeout=240)
    assert assert_groups_identical(statuses) >= 2
    for s in statuses:
        assert all(r["contributors"] <= 2 for r in s["history"]), s["history"]
    choices = [m for text in logs.values() for m in CHOSE.finditer(text)]
    assert choices, {n: t[-3000:] for n, t in logs.items()}
    assert all(int(m[2]) == 2 and int(m[3]) > 2 for m in choices)
    assert any(m[4] == "ours waits for a later round" for m in choices)
    # the other group's set came as its list, and only the drawn payloads of it were fetched (peer/round/draw.py)
    drawn = [m for text in logs.values() for m in DREW.finditer(text)]
    assert drawn and all(int(m[4]) <= int(m[2]) <= 2 for m in drawn), drawn
    assert any(int(m[3]) > 2 for m in drawn)
    # a round whose payloads every peer took (several groups merged) ends with one θ on all of them
    by_round = hashes_by_round(statuses)
    merged = [r for r, hashes in by_round.items() if len(hashes) == len(NAMES)]
    assert merged and any(len(set(by_round[r].values())) == 1 for r in merged), by_round
    start = max(s["initial_val_loss"] for s in statuses)
    assert all(s["val_loss"] < start for s in statuses)


SITS_OUT = re.compile(r"round (\d+): this peer is not one of the round's senders: it sends no payload, its update "
                      r"waits \((\d+) of the group's (\d+) send\)")


@pytest.mark.slow
def test_six_peers_with_k_1_send_only_a_few_payloads_and_stay_one_model(tmp_path):
    """protocol/round/eligibility.py in a real swarm: after the first round (everyone sends) p falls
    towards target(1) = 3 of 6, the peers not among a round's senders send nothing (their update waits in their
    buffers), and every round still ends with one θ where every peer merged every set."""
    names = ("a", "b", "c", "d", "e", "f")
    statuses, logs = _train(tmp_path, "senders", names, k=1, group=3, rounds=5, timeout=400)
    assert assert_groups_identical(statuses) >= 3
    out = [m for text in logs.values() for m in SITS_OUT.finditer(text)]
    assert out and all(int(m[1]) >= 1 and int(m[2]) < int(m[3]) for m in out), {n: t[-2000:] for n, t in logs.items()}
    for s in statuses:
        assert all(r["contributors"] <= 1 for r in s["history"]), s["history"]
    by_round = hashes_by_round(statuses)
    merged = [r for r, hashes in by_round.items() if len(hashes) == len(names)]
    assert merged and sum(len(set(by_round[r].values())) == 1 for r in merged) >= len(merged) - 1, by_round
