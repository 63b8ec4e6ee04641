"""protocol/round/timing.py: every wait of a round comes from one object, derived from the spec."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from protocol.spec import RunSpec
from protocol.round.timing import Timing

ROOT = Path(__file__).resolve().parents[2]
SPEC = RunSpec.from_toml('run_id = "t"\n[swarm]\nmatchmaking_time = 4.0\ngather_timeout = 12.0\nround_wait = 40.0\nheartbeat_period = 1.0\n')


def test_the_spec_sets_its_four_waits_and_the_rest_keep_their_defaults():
    t = Timing.from_spec(SPEC)
    assert (t.matchmaking_s, t.gather_slot_s, t.round_wait_s, t.heartbeat_s) == (4.0, 12.0, 40.0, 1.0)
    assert t.straggler_min_s == Timing().straggler_min_s and t.set_fetch_s == Timing().set_fetch_s


@pytest.mark.parametrize("records,interval", [(0, 0.5), (4, 0.5), (32, 4.0), (64, 8.0), (10_000, 8.0)])
def test_the_read_interval_grows_with_the_swarm_within_its_bounds(records, interval):
    assert Timing().read_interval(records) == interval


@pytest.mark.parametrize("train_s,allowance", [(0.0, 5.0), (4.0, 5.0), (30.0, 15.0), (1000.0, 40.0)])
def test_the_straggler_allowance_scales_with_training_and_never_passes_round_wait(train_s, allowance):
    assert Timing.from_spec(SPEC).straggler_allowance(train_s) == allowance


def test_the_merge_waits_combine_the_spec_and_the_measured_matchmaking():
    t = Timing.from_spec(SPEC)
    assert t.merge_allowance(straggler=5.0, matchmaking_wait=0.0) == 12.0 + 2 * 4.0
    assert t.merge_allowance(straggler=20.0, matchmaking_wait=9.0) == 20.0 + 2 * 9.0  # a loaded host's stretched matchmaking
    assert t.mate_merge_bound() == 40.0 + 3 * 12.0 + 10.0 > t.round_wait_s


def test_no_round_module_holds_a_wait_constant():
    """The round, the exchange and chain stages read their waits from a Timing: no module-level *_S
    constant and no sleep or wait on a number there."""
    found = []
    for path in sorted(p for sub in ("round", "exchange", "chain") for p in (ROOT / "peer" / sub).glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id.endswith("_S") for t in node.targets):
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node.targets[0])}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("sleep", "wait")
                    and node.args and isinstance(node.args[0], ast.Constant)):
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert found == []
