"""bench/wan.py --quick: hivemind.Optimizer and the four voloco arms on separate hosts (network
namespaces, 10 Mbit/s links), every arm to its token budget; the JSON holds together.

Needs root and ``ip netns``; skips cleanly without them. The issue's goals (utilization, time to
target, bytes against hivemind.Optimizer) are measured by the full run, not asserted here. About
4 minutes on a quiet 2-core machine, most of it the processes' start-up (twice that under load).
"""

from __future__ import annotations

import pytest

from bench import wan
from swarm.jsonout import loads_strict
from tests.support.netns_hosts import netns_unavailable


@pytest.mark.slow
def test_quick_runs_every_arm_to_its_budget(tmp_path, capsys):
    if (why := netns_unavailable()) is not None:
        pytest.skip(f"needs network namespaces: {why}")
    out = tmp_path / "wan.json"
    assert wan.main(["--quick", "--workdir", str(tmp_path / "runs"), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fast / slow = " in text and "target validation loss" in text
    doc = loads_strict(out.read_text())  # strict JSON: no NaN anywhere
    assert list(doc["rates"]) == ["10mbit"]
    # the slow peer really is slower: measured, all four at once. 2x is asked; --quick's model takes
    # milliseconds a step, so the work around each step (not slowed) blurs it: 1.16x to 2.13x seen,
    # 1.04x with another test running beside CI
    assert 1.0 < doc["speed_ratio"] < 3.5, doc["speeds"]
    rate = doc["rates"]["10mbit"]
    arms = {r["arm"]: r for r in rate["arms"]}
    assert list(arms) == list(wan.ARMS)
    target = rate["target_val_loss"]
    voloco_finals = [r["final_val_loss"] for r in arms.values() if r["kind"] == "voloco"]
    assert target == max(voloco_finals)
    for name, r in arms.items():
        assert r["finished"], (name, r["failure"], r["logs"])
        assert r["tokens"] >= doc["budget_tokens"], name
        assert r["wall_s"] > 0 and r["curve"], name
        assert r["final_val_loss"] <= r["initial_val_loss"] + 1e-6, name
        assert 0 < r["util_fast"] <= 1 and 0 < r["util_slow"] <= 1, name
        for host, p in r["peers"].items():  # every peer trained and talked (finished rounds: r["peers"][h]["rounds"])
            assert p["busy_s"] > 0 and p["wire_sent"] > 0 and p["wire_received"] > 0, (name, host, p)
            if r["kind"] == "voloco":
                assert p["accounted_sent"] > 0, (name, host, p)
                # what the peer says it sent and received crossed its interface: its TCP payload since it
                # started, against the interface's bytes less each packet's frame headers around the moment
                # its newest status was written (pure ACKs and small control messages can make the headers
                # half of a slow peer's sent bytes; the bytes after its last status, a state download at
                # a round's end, can be a quarter of another's); a segment the shaped link dropped crossed
                # the sender's interface twice and was written once (at most a full segment: 1448 bytes)
                # the status was written after the poll before it ("before") and read before the "at" counters:
                # a loaded machine's late poll lets the next round's payloads in between (a fifth of p0's bytes
                # received, once in CI)
                sent, mine = p["wire_payload_sent_at_status"], p["accounted_sent_with_startup"]
                before = p["wire_payload_sent_before_status"] - 1448 * p["wire_retrans_segs_at_status"]
                assert 0.85 * before <= mine <= 1.05 * sent, (name, host, p)
                received, mine = p["wire_payload_received_at_status"], p["accounted_received_with_startup"]
                assert 0.85 * p["wire_payload_received_before_status"] <= mine <= 1.05 * received, (name, host, p)
        if r["kind"] == "voloco":
            assert r["final_val_loss"] < r["initial_val_loss"], name  # a few rounds of training show
            assert r["time_to_target_s"] is not None and r["time_to_target_s"] <= r["wall_s"] + 1.0, name
            assert r["fewer_bytes_than_hivemind"] > 0
    hm = arms[wan.HIVEMIND]
    assert hm["hivemind"]["target_batch_size"] % (4 * 8) == 0 and hm["hivemind"]["epochs"] >= 1
    assert all(p["accounted_sent"] is None for p in hm["peers"].values())  # hivemind counts no bytes


def test_hivemind_settings_follow_the_documented_rules():
    spec = wan.base_spec(quick=False)
    budget = 4 * 4 * spec.outer.inner_steps * spec.data.batch_size * spec.model.seq_len
    slow = wan.hivemind_settings(spec, 10e6, samples_per_s=60.0, budget=budget, rounds=4)
    fast = wan.hivemind_settings(spec, 100e6, samples_per_s=60.0, budget=budget, rounds=4)
    assert slow["target_batch_size"] % 64 == 0 and slow["target_batch_size"] > fast["target_batch_size"]
    assert slow["matchmaking_time"] == spec.swarm.matchmaking_time == 3.0
    assert slow["averaging_timeout"] >= 30.0
    assert slow["epochs"] * slow["target_batch_size"] * spec.model.seq_len >= budget
    assert slow["epochs"] >= 4  # at least as many global steps as a voloco peer takes rounds
    assert slow["lr"] > spec.inner.lr  # scaled up for the larger batch


def test_overlap_arms_only_switch_the_spec_field():
    base = wan.base_spec(quick=True)
    plain, overlap = wan.arm_spec(base, "SparseLoCo"), wan.arm_spec(base, "SparseLoCo+overlap")
    assert plain.outer.overlap is False and overlap.outer.overlap is True
    assert plain.replace(outer=dict(overlap=True), run_id=overlap.run_id) == overlap
    assert wan.arm_spec(base, "DiLoCo").outer.dense_dtype == "fp16"
    assert plain.model == base.model and plain.data == base.data and plain.seed == base.seed
