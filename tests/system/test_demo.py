"""``voloco demo``: what it prints while peers start, its strict JSON, its children's environment."""

from __future__ import annotations

import math

import pytest

from swarm.jsonout import dumps, loads_strict, write
from voloco.demo import child_env, dashboard_address, peer_phase, progress_line, settled, summarize, wait_until_settled

NAMES = ["peer0", "peer1", "peer2 (chain)"]


def status(phase, round_=0, rounds=0, val=float("nan")):
    return {"peer_id": "Qm" + "x" * 44, "phase": phase, "round": round_, "rounds": rounds, "val_loss": val,
            "initial_val_loss": 5.5, "tokens": 100, "bytes_sent": 1, "bytes_received": 2, "params_hash": "ab" * 8,
            "strategy": "sparseloco", "history": []}


def test_start_up_shows_each_peers_phase_not_nan():
    line = progress_line(12, NAMES, [None, status("loading data"), status("waiting for a chain")], [None, None, None])
    assert line == "[   12 s] peer0: starting | peer1: loading data | peer2 (chain): waiting for a chain"
    assert "nan" not in line.lower() and "'-'" not in line


def test_a_peer_that_trains_shows_its_round_beside_those_still_starting():
    line = progress_line(40, NAMES, [status("training", 2, 2, 4.25), status("training", 2, 2, 4.5),
                                     status("linking the chain")], [None, None, None])
    assert "peer0: round 2" in line and "peer2 (chain): linking the chain" in line and "val loss 4.250" in line


def test_live_line_once_every_peer_trains():
    line = progress_line(90, NAMES, [status("training", 3, 3, 4.0), status("training", 3, 3, 3.9),
                                     status("training", 2, 1)], [None, None, None])
    assert line == "[   90 s] rounds 3 3 2 | val loss 3.900"


def test_an_exited_peer_says_so():
    assert peer_phase(status("loading data"), 2) == "exited (2)"
    assert peer_phase(None, None) == "starting"
    assert peer_phase({"round": 4, "rounds": 4}, None) == "round 4"  # a status without a phase (an older peer)


def test_dashboard_address_from_the_coordinator_log(tmp_path):
    log = tmp_path / "coordinator.log"
    assert dashboard_address(log) is None  # no log yet
    log.write_text("run test (spec ab)\njoin this run with:\n")
    assert dashboard_address(log) is None  # no dashboard (yet, or turned off)
    log.write_text("run test\ndashboard: http://localhost:8080/  (JSON: http://localhost:8080/api/snapshot)\n")
    assert dashboard_address(log) == "http://127.0.0.1:8080/"


def _strict(text):
    return loads_strict(text)


def test_summary_json_is_strict_with_unknown_losses(tmp_path):
    statuses = [status("training", 3, 3, float("nan")), None, status("training", 3, 3, float("inf"))]
    summary = summarize(statuses, 12.3)
    assert summary["final_val_loss"] is None
    path = tmp_path / "summary.json"
    write(path, summary, indent=2)
    parsed = _strict(path.read_text())
    assert parsed["peers"][0]["val_loss"] is None and parsed["peers"][1]["val_loss"] is None


def test_strict_json_helper():
    value = {"a": float("nan"), "b": [float("inf"), -float("inf"), 1.5], "c": {"d": (float("nan"),)}}
    text = dumps(value)
    assert _strict(text) == {"a": None, "b": [None, None, 1.5], "c": {"d": [None]}}
    with pytest.raises(ValueError):
        loads_strict('{"a": NaN}')
    import json
    with pytest.raises(ValueError):
        json.loads("[Infinity]", parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    assert math.isnan(json.loads('{"a": NaN}')["a"])  # what a lenient reader would have accepted


def test_peer_status_file_is_strict_json(tmp_path):
    from peer.round.report import write_status

    path = tmp_path / "status.json"
    write_status(path, {"val_loss": float("nan"), "history": [{"loss": float("nan")}]})
    assert _strict(path.read_text()) == {"val_loss": None, "history": [{"loss": None}]}


def test_children_get_no_voloco_variables(monkeypatch):
    monkeypatch.setenv("VOLOCO_ANNOUNCE_MADDRS", "/ip4/203.0.113.5/tcp/1")
    monkeypatch.setenv("VOLOCO_SETTINGS", "/nowhere.toml")
    env = child_env()
    assert not [k for k in env if k.startswith("VOLOCO_")] and "PATH" in env


def test_a_peer_still_starting_has_a_full_status(capsys):
    """The status written at each start-up phase has every key readers index (demo, tests, benches)."""
    import threading
    from types import SimpleNamespace

    from peer.host.lifecycle import set_phase, startup_status
    from voloco.demo import print_summary

    fake = SimpleNamespace(state="starting", stop_event=threading.Event(), opts=SimpleNamespace(status_file=None), engine=None)
    set_phase(fake, "joining the DHT")
    status = startup_status(fake)
    assert status["phase"] == "joining the DHT" and status["history"] == [] and status["round"] == 0
    assert peer_phase(loads_strict(dumps(status)), None) == "joining the DHT"
    summary = summarize([status, None], 3.0)
    print_summary(summary)
    assert loads_strict(dumps(summary))["final_val_loss"] is None
    assert "joining" not in capsys.readouterr().err


def test_summary_names_a_stage_whose_neighbour_stopped_first(capsys):
    """At the demo's end a stage whose neighbour stopped first is waiting for a new chain: its status
    has no chain, only the one it last trained in (``last_chain``); the summary still shows it as a
    stage of that chain, and a slice owner as its slice."""
    from voloco.demo import print_summary

    base = dict(round=3, rounds=3, tokens=10, val_loss=None, util=0.9, bytes_sent=1, bytes_received=1,
                params_hash="ab", link_bytes_sent=100, link_bytes_received=100, link_tokens=10, strategy="sparseloco")
    statuses = [dict(base, peer_id="p-first-stage", part=[0, 2], chain="ch-1", last_chain="ch-1"),
                dict(base, peer_id="p-second-stg", part=[2, 4], chain=None, last_chain="ch-1"),
                dict(base, peer_id="p-slice-owner", part=1, chain=None),
                dict(base, peer_id="p-whole-model", part=-1, chain=None)]
    summary = summarize(statuses, 1.0)
    (chain,) = summary["chains"]
    assert [st["blocks"] for st in chain["stages"]] == [[0, 2], [2, 4]]
    print_summary(summary)
    out = capsys.readouterr().out
    assert "blocks 2-3" in out and "slice 1" in out and out.count("full") == 1


def test_the_demo_stops_its_peers_between_rounds_when_all_hold_one_theta():
    a, b = {"round": 16, "params_hash": "a7f6"}, {"round": 15, "params_hash": "2edc"}
    assert not settled([a, a, b])  # a stage still in round 16's exchange: stopping now splits the summary
    assert settled([a, a, dict(a), None])  # a peer with no status yet does not hold the stop up
    assert not settled([None, None])
    assert not settled([a, {"round": 16, "params_hash": "ffff"}])


def test_the_demo_stops_its_peers_right_after_a_round_has_ended_on_all():
    """One θ when the time runs out is not enough: the next round's exchange may be in flight (its
    inner steps overlap the exchange before), and a stop then split the summary 3 / 2. The demo waits
    for the next round to end on every peer; where none ends in time, one θ will do."""
    r13, r14 = {"round": 13, "params_hash": "5bfd"}, {"round": 14, "params_hash": "747f"}
    t = [0.0]

    def clock():
        return t[0]

    def sleep(s):
        t[0] += s

    def script(steps):  # the statuses read at each call, the last one repeated
        calls = iter(steps)
        last = [steps[-1]]

        def read():
            last[0] = next(calls, last[0])
            return last[0]
        return read

    # settled on round 13 when the time ran out: waits for round 14 to end on all three, then stops
    read = script([[r13, r13, r13], [r13, r13, r13], [r14, r14, r13], [r14, r14, r14]])
    assert wait_until_settled(read, 60.0, clock, sleep) and read() == [r14, r14, r14] and t[0] < 1.0
    # a round in flight on some when the time ran out: the first moment all hold one θ
    t[0] = 0.0
    assert wait_until_settled(script([[r14, r13, r13], [r14, r14, r14]]), 60.0, clock, sleep) and t[0] < 1.0
    # no round ends in time (the peers stalled): one θ still will do, once the limit is reached
    t[0] = 0.0
    assert wait_until_settled(script([[r13, r13]]), 60.0, clock, sleep) and t[0] >= 60.0
    t[0] = 0.0
    assert not wait_until_settled(script([[r13, r14]]), 5.0, clock, sleep)
