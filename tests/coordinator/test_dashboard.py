"""The dashboard's view, loss history, JSON API and metrics, with fake progress records (no DHT, no processes)."""

from __future__ import annotations

import json
import math
import urllib.request
from dataclasses import dataclass, replace
from typing import Dict, List

import pytest

from coordinator.dashboard import WebServer, dashboard_url, make_app
from coordinator.history import HistoryKeeper, LossSeries, sample
from coordinator.metrics import MAX_PEER_SERIES, make_registry, render
from coordinator.run_view import MAX_PEERS_SHOWN, RunInfo, Tally, Totals, build_snapshot, median_loss, swarm_round
from protocol.chain.records import ChainAssignment
from protocol.chain.stages import make_chain
from protocol.dht.history import HistoryPoint, HistoryRecord
from protocol.dht.records import Progress
from swarm.jsonout import loads_strict

SPEC = "0123456789abcdef"
INFO = RunInfo(run_id="test", spec=SPEC, strategy="sparseloco", params=900_000, inner_steps=20, slices=1,
               heartbeat_period=0.5)
NOW = 10_000.0
TTL = 10.0


@dataclass
class View:  # what swarm.records.read_progress returns
    peer_id: str
    progress: Progress
    expires: float


def prog(rnd: int = 3, **kw) -> Progress:
    base = Progress(round=rnd, step=4, state="training", spec=SPEC, loss=2.5, val_loss=2.6, tokens=1000,
                    tokens_per_s=5000.0, bytes_sent=100, bytes_received=200, params_hash="", part=-1,
                    device="cpu", util=0.75, reach="public")
    return replace(base, **kw)


def view(peer: str, seen_ago: float = 1.0, **kw) -> View:
    return View(peer, prog(**kw), expires=NOW - seen_ago + TTL)


def snapshot(views: List[View], assignments=None, candidates=None, totals=None, history=None) -> Dict:
    return build_snapshot(INFO, views, assignments or {}, candidates or {}, NOW, TTL, totals, history, wall_time=1.0)


# ---- the view ---------------------------------------------------------------------------------
def test_snapshot_of_two_peers():
    snap = snapshot([view("A", rnd=3, loss=2.0, val_loss=float("nan")), view("B", seen_ago=4.0, rnd=3, loss=3.0,
                                                                            val_loss=2.2, part=0, util=0.25)])
    run = snap["run"]
    assert run["round"] == 3 and run["members"] == ["A", "B"] and run["peers"] == 2
    assert run["loss"] == 2.5 and run["val_loss"] == 2.2 and run["best_val_loss"] == 2.2
    assert run["tokens_total"] == 2000 and run["bytes_sent_total"] == 200 and run["tokens_per_s"] == 10_000.0
    rows = {r["peer_id"]: r for r in snap["peers"]["rows"]}
    assert rows["A"]["role"] == "full" and rows["B"]["role"] == "slice owner 0"
    assert rows["B"]["last_seen_s"] == 4.0 and rows["B"]["util"] == 0.25 and rows["A"]["reach"] == "public"
    assert math.isnan(rows["A"]["val_loss"])  # the API writes it as null


def test_one_liar_moves_neither_the_round_nor_the_loss():
    liar = view("Z", rnd=2**62, loss=-5.0, val_loss=0.0)
    snap = snapshot([view("A", rnd=7, val_loss=2.0), view("B", rnd=7, val_loss=2.1), liar])
    assert snap["run"]["round"] == 7 and snap["run"]["members"] == ["A", "B"]
    assert snap["run"]["val_loss"] == pytest.approx(2.05)
    assert snap["run"]["best_val_loss"] == pytest.approx(2.05)  # not the liar's 0.0: the best of the medians
    history = {"stride": 1, "points": [{"round": 5, "val_loss": 1.9}, {"round": 6, "val_loss": float("nan")}]}
    assert snapshot([view("A", rnd=7, val_loss=2.0), liar], history=history)["run"]["best_val_loss"] == 1.9
    assert swarm_round([5]) == 5 and swarm_round([]) == -1 and swarm_round([1, 9, 2]) == 2
    assert math.isnan(median_loss([float("inf"), -1.0, 1e9, float("nan")]))  # none of them is a loss
    assert median_loss([1.0, float("nan"), 3.0, -2.0]) == 2.0


def test_other_specs_and_stopped_peers():
    snap = snapshot([view("A"), view("B", state="stopped"), view("C", spec="other")])
    run = snap["run"]
    assert run["peers"] == 1 and run["peers_stopped"] == 1 and run["foreign_records"] == 1
    assert [r["peer_id"] for r in snap["peers"]["rows"]] == ["A", "B"]  # stopped last, the foreign one not at all


def test_chain_stages_and_candidates():
    chain = make_chain([("S1", 0, 1), ("S2", 1, 2)])
    a = ChainAssignment(SPEC, 3, chain)
    snap = snapshot([view("S1", loss=float("nan")), view("S2"), view("W", part=-2)],
                    assignments={"S1": a, "S2": a}, candidates={"W": object()})
    rows = {r["peer_id"]: r for r in snap["peers"]["rows"]}
    assert rows["S1"]["role"] == f"chain stage 1/2 of {chain.chain_id}" and rows["S2"]["stage"] == 2
    assert rows["W"]["role"] == "waiting for a chain"
    (c,) = snap["chains"]
    assert c["chain_id"] == chain.chain_id and c["epoch"] == 3
    assert [(s["stage"], s["peer_id"], s["blocks"]) for s in c["stages"]] == [(1, "S1", [0, 1]), (2, "S2", [1, 2])]
    assert snap["run"]["chains"] == 1 and snap["run"]["candidates"] == 1


def test_the_peers_table_is_bounded():
    snap = snapshot([view(f"P{i:04d}", tokens_per_s=float(i)) for i in range(MAX_PEERS_SHOWN + 10)])
    peers = snap["peers"]
    assert peers["total"] == MAX_PEERS_SHOWN + 10 and peers["shown"] == len(peers["rows"]) == MAX_PEERS_SHOWN
    assert peers["rows"][0]["peer_id"] == f"P{MAX_PEERS_SHOWN + 9:04d}"  # the busiest first
    run = snap["run"]  # the round's members are bounded too (a page of chips, not thousands)
    assert len(run["members"]) == MAX_PEERS_SHOWN and run["members_total"] == MAX_PEERS_SHOWN + 10


def test_totals_keep_peers_that_left_and_a_restored_floor():
    totals = Totals()
    snapshot([view("A", tokens=100), view("B", tokens=50)], totals=totals)
    snap = snapshot([view("A", tokens=120)], totals=totals)  # B left: its tokens still count
    assert snap["run"]["tokens_total"] == 170
    totals.tokens.floor = 10_000  # what a restored history had counted
    assert snapshot([view("A", tokens=130)], totals=totals)["run"]["tokens_total"] == 10_000
    t = Tally()
    for i in range(5000):
        t.see(f"p{i}", 1)
    assert len(t.by_peer) <= 4096 and t.total == 5000


# ---- the loss history ---------------------------------------------------------------------------
def point(r: int, loss: float = 2.0) -> HistoryPoint:
    return HistoryPoint(round=r, tokens=r * 10, bytes=r, peers=2, loss=loss, val_loss=loss + 0.1, time=1.0)


def test_series_is_bounded_evenly_spaced_and_keeps_the_newest():
    s = LossSeries(max_points=16)
    for r in range(1000):
        s.add(point(r))
    rounds = [p.round for p in s.points]
    assert len(rounds) <= 16 and rounds[-1] == 999 and rounds[0] == 0
    steps = {b - a for a, b in zip(rounds[:-2], rounds[1:-1])}
    assert steps == {s.stride}  # evenly spaced, but for the newest point
    assert not s.add(point(5))  # the past is ignored
    assert s.add(point(999, loss=1.0)) and s.points[-1].loss == 1.0  # the current round is updated in place


def test_series_merges_an_earlier_coordinators_points():
    old = LossSeries(max_points=16)
    for r in range(40):
        old.add(point(r))
    s = LossSeries(max_points=16)
    for r in range(30, 50):
        s.add(point(r, loss=1.0))
    s.merge(old.record(SPEC))
    rounds = [p.round for p in s.points]
    assert len(rounds) <= 16 and rounds[0] == 0 and rounds[-1] == 49 and rounds == sorted(set(rounds))
    assert all(p.loss == 1.0 for p in s.points if p.round >= 30)  # this coordinator's points win


def test_keeper_restores_before_it_stores():
    stored: List[HistoryRecord] = []
    clock = [0.0]
    earlier = HistoryRecord(SPEC, 1, [point(r) for r in range(5)])
    answers = [None, earlier]  # the DHT finds the earlier copy at the second pass
    keeper = HistoryKeeper(SPEC, stored.append, lambda: answers.pop(0) if answers else None, clock=lambda: clock[0])
    run = snapshot([view("A", rnd=8), view("B", rnd=8)])["run"]
    keeper.observe(run)
    assert stored == [] and keeper.restored is None  # it would have replaced the earlier copy
    clock[0] = 2.0
    keeper.observe(run)
    assert keeper.restored == 5 and [p.round for p in stored[-1].points] == [0, 1, 2, 3, 4, 8]
    assert keeper.floor["tokens"] == run["tokens_total"]
    assert sample({**run, "peers": 0}) is None


def test_keeper_stores_alone_after_the_restore_window():
    stored: List[HistoryRecord] = []
    clock = [0.0]
    keeper = HistoryKeeper(SPEC, stored.append, lambda: None, restore_for=10.0, clock=lambda: clock[0])
    run = snapshot([view("A", rnd=1)])["run"]
    keeper.observe(run)
    clock[0] = 11.0
    keeper.observe(run)
    assert len(stored) == 1 and stored[0].points[0].round == 1 and stored[0].spec == SPEC


# ---- the API and metrics ------------------------------------------------------------------------
def strict_json(text: str):
    return loads_strict(text)  # raises on NaN / Infinity


@pytest.fixture
def server():
    history = LossSeries()
    for r in range(4):
        history.add(point(r))
    snap = snapshot([view("A", val_loss=float("nan"), tokens_per_s=float("inf")),
                     view("B", device="<script>x</script>")], history=history.as_json())
    srv = WebServer(make_app(lambda: snap), "127.0.0.1", 0).start()
    yield srv
    srv.stop()


def get(srv: WebServer, path: str):
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}{path}", timeout=10) as r:
        return r.status, dict(r.headers), r.read().decode()


def test_api_serves_strict_json(server):
    for path in ("/api/snapshot", "/api/run", "/api/peers", "/api/chains", "/api/history"):
        status, headers, body = get(server, path)
        assert status == 200 and headers["Content-Type"].startswith("application/json")
        assert "NaN" not in body and "Infinity" not in body
        strict_json(body)
    peers = strict_json(get(server, "/api/peers")[2])
    rows = {r["peer_id"]: r for r in peers["rows"]}
    assert rows["A"]["val_loss"] is None and rows["A"]["tokens_per_s"] is None
    assert rows["B"]["device"] == "<script>x</script>"  # data, for the page to render as text
    assert len(strict_json(get(server, "/api/history")[2])["points"]) == 4


def test_the_page_and_its_static_files(server):
    status, headers, body = get(server, "/")
    assert status == 200 and "script-src 'self'" in headers["Content-Security-Policy"]
    assert '<script src="/static/dashboard.js"' in body and "<script>" not in body  # no inline script
    js = get(server, "/static/dashboard.js")[2]
    assert "innerHTML" not in js and "insertAdjacentHTML" not in js and "document.write" not in js
    assert "http://" not in js.replace("http://www.w3.org/2000/svg", "")  # nothing from another origin
    assert get(server, "/static/dashboard.css")[0] == 200
    with pytest.raises(urllib.error.HTTPError):
        get(server, "/static/../dashboard.py")


def test_metrics(server):
    status, headers, body = get(server, "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    assert 'voloco_peers{run="test"} 2.0' in body and 'voloco_round{run="test"} 3.0' in body
    assert 'voloco_tokens_total{run="test"} 2000.0' in body
    assert 'voloco_peer_utilization{peer="A"} 0.75' in body
    assert 'device="<script>x</script>"' in body  # a label value: escaped for the format, harmless as text


def test_metrics_bound_the_per_peer_series():
    snap = snapshot([view(f"P{i}") for i in range(MAX_PEER_SERIES * 2)])
    text = render(make_registry(lambda: snap)).decode()
    assert text.count("voloco_peer_round{") == MAX_PEER_SERIES
    assert render(make_registry(lambda: None)) == b""


def test_dashboard_url():
    assert dashboard_url("0.0.0.0", 8080) == "http://localhost:8080/"
    assert dashboard_url("10.0.0.2", 81) == "http://10.0.0.2:81/"
    assert dashboard_url("::1", 81) == "http://[::1]:81/"


def test_a_port_in_use_is_an_os_error(server):
    with pytest.raises(OSError):
        WebServer(make_app(lambda: None), "127.0.0.1", server.port).start()


def test_api_before_the_first_snapshot():
    srv = WebServer(make_app(lambda: None), "127.0.0.1", 0).start()
    try:
        assert json.loads(get(srv, "/api/snapshot")[2])["run"] is None
        assert "voloco_peers" not in get(srv, "/metrics")[2]
    finally:
        srv.stop()


def test_a_busy_dashboard_port_does_not_stop_the_coordinator(server, caplog):
    from coordinator.dashboard import Dashboard
    from protocol.spec import RunSpec

    dash = Dashboard(dht=None, spec=RunSpec())
    with caplog.at_level("WARNING", logger="voloco.coordinator"):
        assert dash.serve("127.0.0.1", server.port) is None
    assert "--dashboard-port" in caplog.text and dash.server is None
    url = dash.serve("127.0.0.1", 0)
    try:
        assert url.startswith("http://127.0.0.1:") and json.loads(get(dash.server, "/api/run")[2]) is None
    finally:
        dash.server.stop()


def test_a_peer_claiming_huge_counts_leaves_the_stored_history_readable():
    from protocol.dht.history import MAX_COUNT, parse_history

    totals = Totals()
    huge = (1 << 64) - 1  # the most a msgpack int (a progress record) can claim
    run = snapshot([view("A", tokens=huge, bytes_sent=huge), view("B", tokens=huge, bytes_sent=huge)],
                   totals=totals)["run"]
    assert run["tokens_total"] > MAX_COUNT
    p = sample(run)
    assert p.tokens == MAX_COUNT and p.bytes == MAX_COUNT
    s = LossSeries()
    s.add(p)
    assert parse_history(s.record(SPEC).to_bytes()).points == [p]  # a restarted coordinator reads it back
    assert sample({**run, "round": MAX_COUNT + 1}) is None
