"""Overlap (one-step-delayed outer update) and mixed speeds (early close), peer/round/loop.py and
peer/round/early_close.py: the algebra and the rule as functions, then real peers, one of them throttled."""

import threading

import pytest
import torch

from peer.round.early_close import min_steps, most_are_done
from peer.round.handoff import continue_from
from protocol.dht.records import Progress
from swarm.records import PeerView
from tests.support.cpu_limit import throttle
from tests.support.swarm_harness import Swarm, TINY_SPEC, assert_groups_identical, groupmate_pairs


def view(peer_id: str, round_no: int, state: str) -> PeerView:
    progress = Progress(round=round_no, step=0, state=state, spec="s", loss=0.0, val_loss=0.0, tokens=0,
                        tokens_per_s=0.0, bytes_sent=0, bytes_received=0, params_hash="")
    return PeerView(peer_id, progress, expires=0.0)


def test_min_steps_is_a_fraction_of_h_at_least_one():
    assert min_steps(30, 0.25) == 8
    assert min_steps(20, 0.25) == 5
    assert min_steps(3, 0.01) == 1
    assert min_steps(30, 1.0) == 30  # 1.0: never close early


def test_a_round_closes_early_only_once_most_of_it_is_ready():
    me = "me"
    assert not most_are_done([], me, 4)  # alone: train H steps
    assert not most_are_done([view(me, 4, "training")], me, 4)
    assert most_are_done([view("a", 4, "ready")], me, 4)
    assert most_are_done([view("a", 4, "exchanging"), view("b", 4, "training")], me, 4)  # half of the others
    assert not most_are_done([view("a", 4, "ready"), view("b", 4, "training"), view("c", 4, "training")], me, 4)
    assert most_are_done([view("a", 5, "training")], me, 4)  # moved on: this peer is the last of its round
    assert not most_are_done([view("a", 3, "ready"), view("b", 4, "training")], me, 4)  # behind us: not ours


def test_continue_from_keeps_the_local_delta_and_is_exact_without_one():
    torch.manual_seed(0)
    theta = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    sent = {k: torch.randn_like(v) for k, v in theta.items()}
    params = {k: v.clone() for k, v in sent.items()}
    continue_from(params, theta, sent)
    assert all(torch.equal(params[k], theta[k]) for k in theta)  # no step since the payload: θ itself
    now = {k: v + 0.5 for k, v in sent.items()}
    params = {k: v.clone() for k, v in now.items()}
    continue_from(params, theta, sent)
    for k in theta:
        torch.testing.assert_close(params[k], theta[k] + (now[k] - sent[k]))


@pytest.mark.slow
def test_overlapped_peers_stay_identical_and_a_slow_peer_closes_its_rounds_early(tmp_path):
    H = 60  # rounds long enough that the throttled peer sees the others ready (early close reads once a second)
    swarm = Swarm(tmp_path, spec_text=TINY_SPEC.format(run_id="overlap", strategy="sparseloco", inner_steps=H))
    stop = threading.Event()
    try:
        swarm.add_peer("a")
        swarm.add_peer("b")
        slow = swarm.add_peer("c")
        swarm.wait(lambda: swarm.round_of("c") >= 0, 180, "c's first round")  # start-up at full speed
        throttle(slow.proc.pid, stop)
        first = swarm.round_of("c")

        def slow_rounds_shared() -> list:
            s = swarm.status("c")
            return [r for r in s["history"] if r["round"] > first and len(r["group"]) > 1] if s else []

        def enough() -> bool:  # the last peer to start may join rounds after the throttled one had 4, and on a
            # loaded host the fast peers may be as slow as the throttled one for a few rounds
            shared = slow_rounds_shared()
            return (len(shared) >= 4 and any(r["steps"] < H for r in shared)
                    and groupmate_pairs([swarm.status(n) for n in ("a", "b", "c")]) >= 12)

        swarm.wait(enough, 300, "4 rounds of the throttled peer in a group, one closed early, 12 groupmate pairs")
        stop.set()
        statuses = [swarm.status(n) for n in ("a", "b", "c")]
        assert assert_groups_identical(statuses) >= 12  # overlap keeps every member's θ bit-identical
        fast = [r for s in statuses[:2] for r in s["history"]]
        assert any(r["overlapped"] > 0 for r in fast), [(r["round"], r["steps"], r["overlapped"]) for r in fast]
        assert all(r["steps"] <= H for r in fast)
        shared_slow = [r for r in statuses[2]["history"] if r["round"] > first and len(r["group"]) > 1]
        assert any(r["steps"] < H for r in shared_slow), [(r["round"], r["steps"]) for r in shared_slow]
        assert all(r["steps"] >= min_steps(H, 0.25) for r in shared_slow)
        # its payloads said so: its groupmates read the steps each of its early-closed rounds covered (what
        # the clip compares its update at, peer/outer/robust.py ``medians_at_steps``), and nobody else's were short
        c = statuses[2]["peer_id"]
        for mate in statuses[:2]:
            same = {r["round"]: r for r in mate["history"] if c in r["group"]}
            read = [(r["round"], r["steps"], same[r["round"]]["short"].get(c, H)) for r in shared_slow if r["round"] in same]
            assert read and all(steps == got for _, steps, got in read), read
            # another peer's payload is short only where that peer's own round closed early (a loaded host can
            # slow a fast peer too): each count read is the steps its sender's record says it trained
            trained = {(s["peer_id"], r["round"]): r["steps"] for s in statuses for r in s["history"]}
            assert all(steps == trained.get((p, r["round"]), steps) < H
                       for r in mate["history"] for p, steps in r["short"].items()), [r["short"] for r in mate["history"]]
    finally:
        stop.set()
        swarm.close()


def test_a_peer_takes_at_most_max_overlap_steps_ahead_of_an_exchange_in_flight(tmp_path):
    """outer.max_overlap: with a slow groupmate the fast peers' exchanges wait for it, and without the
    cap they would train most of the next round on the old θ; with 0.2 they take at most 4 of 20 steps
    ahead, then wait (peer/round/loop.py), and the group still ends every round on one θ. A peer's
    first exchange, whose barrier no budget for strangers bounds yet, is not overlapped at all
    (``RoundLoop._holds``): the round after it starts from its θ."""
    H = 20
    text = TINY_SPEC.format(run_id="overlap-cap", strategy="sparseloco", inner_steps=H).replace("[swarm]", "max_overlap = 0.2\n[swarm]")
    swarm = Swarm(tmp_path, spec_text=text)
    stop = threading.Event()
    try:
        swarm.add_peer("a")
        slow = swarm.add_peer("b")
        swarm.wait(lambda: swarm.round_of("b") >= 0, 180, "b's first round")
        throttle(slow.proc.pid, stop, run_s=0.1, pause_s=0.2)
        capped = "s exchange, 4 steps ahead of it"
        swarm.wait(lambda: capped in swarm.peers["a"].text() and swarm.round_of("a") >= 4, 300,
                   "a waiting for an exchange after 4 steps ahead of it, 4 rounds")
        stop.set()
        statuses = [swarm.status(n) for n in ("a", "b")]
        assert assert_groups_identical(statuses) >= 2
        assert all(r["overlapped"] <= 4 for s in statuses for r in s["history"]), [
            (r["round"], r["steps"], r["overlapped"]) for s in statuses for r in s["history"]]
        assert all(s["history"][1]["overlapped"] == 0 for s in statuses), [s["history"][:2] for s in statuses]
        assert "exchange before its first step" in swarm.peers["a"].text()
    finally:
        stop.set()
        swarm.close()
