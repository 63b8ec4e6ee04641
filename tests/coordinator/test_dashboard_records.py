"""What the dashboard reads and peers publish for it: the progress record's device, util and reach,
the loss-history record in the DHT (only the run key's counts), a peer's utilization and metrics."""

from __future__ import annotations

import urllib.request
from dataclasses import replace
from types import SimpleNamespace
from typing import Dict, Tuple

import msgpack
import pytest
from hivemind.utils import MSGPackSerializer, ValueWithExpiration, get_dht_time

from peer.host.metrics import MetricsServer
from peer.host.utilization import Utilization, device_label, progress_extras
from protocol.errors import ProtocolError
from protocol.dht.history import MAX_POINTS, HistoryPoint, HistoryRecord, history_key, parse_history
from protocol.dht.keys import owned_subkey
from protocol.dht.records import REACH, Progress, encode_body, parse_progress, seal
from protocol.spec import RunSpec
from swarm import records
from swarm.console import UsageError
from swarm.access.identity import NodeTrust, prepare_identity, register

SPEC = RunSpec().replace(run_id="test")


def progress(**kw) -> Progress:
    p = Progress(1, 0, "training", SPEC.digest(), 1.0, 0.5, 0, 0.0, 0, 0, "hash", -1, "cuda:0 NVIDIA H100", 0.5, "client")
    return replace(p, **kw)


# ---- the progress record --------------------------------------------------------------------------
def test_progress_round_trips_with_device_util_reach():
    p = progress()
    assert parse_progress(encode_body(p.to_dict())) == p
    old = Progress(1, 0, "training", SPEC.digest(), 1.0, 0.5, 0, 0.0, 0, 0, "hash", -1)  # the defaults
    assert (old.device, old.util, old.reach) == ("", 0.0, "unknown") and parse_progress(old.to_dict()) == old
    assert REACH == ("unknown", "public", "client")


@pytest.mark.parametrize("field,value", [
    ("util", 1.5), ("util", -0.1), ("util", float("nan")), ("util", float("inf")), ("util", "0.5"), ("util", True),
    ("device", "x" * 65), ("device", 5), ("device", "cpu\n<b>"), ("device", "\x1b[31mred"),
    ("reach", "maybe"), ("reach", ""), ("reach", None),
    ("gathered", "ab" * 15), ("gathered_before", "AB" * 16), ("gathered_before", "ab" * 17), ("gathered_before", None),
    ("gathered_from", "0:4"), ("gathered_from", "abc"), ("gathered_from", "ab" * 33), ("gathered_from", None),
])
def test_progress_refuses_bad_device_util_reach(field, value):
    d = progress().to_dict()
    d[field] = value
    with pytest.raises(ProtocolError):
        parse_progress(encode_body(d))


def test_a_record_names_the_set_of_its_last_round_and_of_the_one_before():
    p = progress(gathered_round=7, gathered="ab" * 16, gathered_before="cd" * 16)
    assert parse_progress(encode_body(p.to_dict())) == p
    assert (p.set_of(7), p.set_of(6), p.set_of(5), p.set_of(8)) == ("ab" * 16, "cd" * 16, "", "")
    assert progress(gathered_round=7, gathered="ab" * 16).set_of(6) == ""  # none the round before


def test_progress_refuses_a_record_without_the_new_fields():
    d = progress().to_dict()
    del d["util"]
    with pytest.raises(ProtocolError):
        parse_progress(d)


def test_the_wire_form_is_positional_with_digests_as_bytes_and_reads_back_the_same():
    p = progress(gathered_round=7, gathered="ab" * 16, gathered_before="cd" * 16, params_hash="0f" * 8)
    wire = p.to_wire()
    assert wire[3] == bytes.fromhex(SPEC.digest()) and wire[10] == bytes.fromhex("0f" * 8)
    assert parse_progress(encode_body(wire)) == p
    assert len(encode_body(wire)) < 0.5 * len(encode_body(p.to_dict()))
    assert parse_progress(encode_body(progress().to_wire())) == progress()  # "hash": not hex, kept a string
    assert parse_progress(encode_body(progress(device="cafe").to_wire())).device == "cafe"  # only digests turn to bytes


def test_a_record_says_what_a_chain_stage_sends_and_one_from_before_that_field_still_reads():
    p = progress(sends="0:4")
    assert parse_progress(encode_body(p.to_wire())) == p and parse_progress(encode_body(p.to_dict())) == p
    old = progress().to_wire()[:-2]  # a writer from before ``sends``: every field but the last two
    assert parse_progress(encode_body(old)) == progress()
    d = progress().to_dict()
    del d["sends"], d["gathered_from"]
    assert parse_progress(encode_body(d)) == progress()


def test_a_record_says_what_theta_its_last_set_was_applied_to_and_one_from_before_that_still_reads():
    p = progress(gathered_round=7, gathered="ab" * 16, gathered_from="0f" * 8)
    wire = p.to_wire()
    assert wire[-1] == bytes.fromhex("0f" * 8)  # a digest: its bytes on the wire
    assert parse_progress(encode_body(wire)) == p and parse_progress(encode_body(p.to_dict())) == p
    assert parse_progress(encode_body(progress(sends="0:4").to_wire()[:-1])) == progress(sends="0:4")


def test_a_record_from_a_newer_writer_reads_without_the_fields_it_added():
    p = progress(gathered_round=7, gathered="ab" * 16, gathered_from="0f" * 8)
    assert parse_progress(encode_body(p.to_wire() + [b"new", 5])) == p  # a run's peers need not upgrade at once


@pytest.mark.parametrize("change", [
    lambda w: w[:-3], lambda w: w + [""] * 9, lambda w: [],
    lambda w: w[:-2] + ["0:4:8", ""], lambda w: w[:-2] + ["x" * 9, ""],  # not a chain stage's blocks
    lambda w: w[:-1] + ["0:4"], lambda w: w[:-1] + [b"\x00" * 33],  # not a parameter hash
    lambda w: w[:3] + [b"\x00" * 33] + w[4:],  # a digest longer than any
    lambda w: w[:2] + [b"tr"] + w[3:],  # bytes where a state's name goes
    lambda w: w[:12] + [b"\xca\xfe"] + w[13:],  # bytes for the device
    lambda w: w[:16] + [b"\xab" * 15] + w[17:],  # not a set's name
])
def test_the_wire_form_refuses_a_malformed_list(change):
    with pytest.raises(ProtocolError):
        parse_progress(encode_body(change(progress().to_wire())))


# ---- the loss-history record ----------------------------------------------------------------------
def hist(n: int = 3, **kw) -> HistoryRecord:
    pts = [HistoryPoint(r, r * 100, r * 10, 2, 2.0, float("nan") if r == 0 else 2.1, 1.7e9) for r in range(n)]
    return HistoryRecord(**{"spec": SPEC.digest(), "stride": 1, "points": pts, **kw})


def test_history_round_trips_within_a_record_body():
    h = hist(MAX_POINTS)
    body = h.to_bytes()
    assert len(body) < 1 << 16  # fits the envelope
    back = parse_history(body)
    assert back.spec == h.spec and back.stride == 1 and len(back.points) == MAX_POINTS
    assert back.points[1] == h.points[1]


def _mutate(d, key, fn):
    d = dict(d)
    d[key] = fn(d[key])
    return d


@pytest.mark.parametrize("change", [
    lambda d: {**d, "v": 2},
    lambda d: {**d, "extra": 1},
    lambda d: {k: v for k, v in d.items() if k != "time"},
    lambda d: {**d, "stride": 3},
    lambda d: {**d, "stride": 0},
    lambda d: {**d, "spec": "x" * 65},
    lambda d: _mutate(d, "round", lambda c: [2, 1, 3]),
    lambda d: _mutate(d, "round", lambda c: c[:2]),
    lambda d: _mutate(d, "tokens", lambda c: [-1] + c[1:]),
    lambda d: _mutate(d, "tokens", lambda c: [True] + c[1:]),
    lambda d: _mutate(d, "loss", lambda c: [float("inf")] + c[1:]),
    lambda d: _mutate(d, "loss", lambda c: [-1.0] + c[1:]),
    lambda d: _mutate(d, "val_loss", lambda c: ["2"] + c[1:]),
    lambda d: _mutate(d, "time", lambda c: [float("nan")] + c[1:]),
    lambda d: {**d, **{c: list(range(MAX_POINTS + 1)) for c in ("round", "tokens", "bytes", "peers", "loss",
                                                                     "val_loss", "time")}},
])
def test_history_refuses_malformed_records(change):
    with pytest.raises(ProtocolError):
        parse_history(msgpack.packb(change(hist().to_dict()), use_bin_type=True))


class FakeDHT:
    """A store that returns what was put in it, unvalidated (what a hostile node could return)."""

    def __init__(self, store: Dict[str, Dict[bytes, Tuple[object, float]]]):
        self.records = store

    def store(self, key, value, expiration_time, subkey, return_future=False, **search):  # search: beam_size
        self.records.setdefault(key, {})[subkey] = (MSGPackSerializer.loads(MSGPackSerializer.dumps(value)), expiration_time)
        return True

    def get(self, key, latest=True, return_future=False, **search):
        items = self.records.get(key)
        return None if not items else ValueWithExpiration(
            {k: ValueWithExpiration(v, e) for k, (v, e) in items.items()}, max(e for _, e in items.values()))

    def add_validators(self, validators):
        pass


@pytest.fixture(scope="module")
def ids(tmp_path_factory):
    d = tmp_path_factory.mktemp("ids")
    return {name: prepare_identity(str(d / f"{name}.key"))[0] for name in ("coord", "peer", "evil")}


@pytest.fixture
def swarm(ids):
    shared: Dict = {}
    coord = FakeDHT(shared)
    register(coord, NodeTrust(ids["coord"]))
    assert records.publish_run(coord, SPEC)
    peer = FakeDHT(shared)
    register(peer, NodeTrust(ids["peer"], run_key=ids["coord"].fingerprint))
    assert records.fetch_spec(peer, timeout=0) == SPEC
    return SimpleNamespace(shared=shared, coord=coord, peer=peer)


def test_history_is_read_back_only_from_the_run_key(swarm, ids):
    assert records.read_history(swarm.coord, SPEC) is None
    records.publish_history(swarm.coord, SPEC, hist(5))
    got = records.read_history(swarm.peer, SPEC)
    assert got is not None and [p.round for p in got.points] == [0, 1, 2, 3, 4]
    # a restarted coordinator with the same key reads its predecessor's copy
    again = FakeDHT(swarm.shared)
    register(again, NodeTrust(ids["coord"]))
    records.publish_run(again, SPEC)
    assert len(records.read_history(again, SPEC).points) == 5


def test_forged_histories_are_ignored(swarm, ids):
    evil = ids["evil"]
    key = history_key(SPEC.run_id)
    until = get_dht_time() + 60
    fake = hist(3, points=[HistoryPoint(0, 0, 0, 1, 0.001, 0.001, 1.7e9)])
    swarm.shared.setdefault(key, {})[owned_subkey(evil.public_key)] = (seal(evil.peer_id, fake.to_bytes()), until)
    assert records.read_history(swarm.peer, SPEC) is None  # signed by another key
    coord = ids["coord"]
    swarm.shared[key] = {owned_subkey(coord.public_key): (seal(coord.peer_id, b"\xc1junk"), until)}
    assert records.read_history(swarm.peer, SPEC) is None  # malformed
    other = hist(2, spec="f" * 16)
    swarm.shared[key] = {owned_subkey(coord.public_key): (seal(coord.peer_id, other.to_bytes()), until)}
    assert records.read_history(swarm.peer, SPEC) is None  # another spec's history
    swarm.shared[key] = {owned_subkey(coord.public_key): (seal(coord.peer_id, hist(2).to_bytes()), until + 10 ** 6)}
    assert records.read_history(swarm.peer, SPEC) is None  # expires too far ahead


# ---- the peer's side --------------------------------------------------------------------------
def test_utilization():
    now = [0.0]
    u = Utilization(clock=lambda: now[0])
    assert u.value == 0.0
    now[0] = 2.0
    u.busy(1.0)
    assert u.value == 0.5  # before any round ended: the window so far
    now[0] = 4.0
    u.busy(1.0)
    assert u.round_done() == 0.5 and u.value == 0.5
    now[0] = 5.0
    u.busy(3.0)  # more than the wall time: clamped
    assert u.round_done() == 1.0
    u.busy(-1.0)
    assert 0.0 <= u.value <= 1.0


def test_progress_extras_always_publish_a_valid_record():
    peer = SimpleNamespace(opts=SimpleNamespace(device="cpu"), util=Utilization(), reach="public")
    assert progress_extras(peer)["device"] == "cpu" and progress_extras(peer)["reach"] == "public"
    peer.reach = "<b>nonsense</b>"
    assert progress_extras(peer)["reach"] == "unknown"
    assert len(device_label("cuda:9\n" + "x" * 200)) <= 64 and device_label("cuda:9\n").isprintable()
    extras = progress_extras(SimpleNamespace())
    assert parse_progress(replace(progress(), **extras).to_dict()).reach == "unknown"


def test_peer_metrics_server():
    state = {"p": progress(tokens=1234, util=0.25)}
    srv = MetricsServer(lambda: state["p"], lambda: "12D3KooWpeer", 0, host="127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert 'voloco_peer_tokens_total{peer="12D3KooWpeer"} 1234.0' in text
        assert 'voloco_peer_utilization{peer="12D3KooWpeer"} 0.25' in text
        assert 'voloco_peer_state{peer="12D3KooWpeer",state="training"} 1.0' in text
        assert 'voloco_peer_val_loss{peer="12D3KooWpeer"} 0.5' in text
        with pytest.raises(UsageError, match="--metrics-port"):
            MetricsServer(lambda: state["p"], lambda: "x", srv.port, host="127.0.0.1")

        def starting():
            raise AttributeError("no spec yet")

        state["p"] = None
        srv2 = MetricsServer(starting, lambda: "x", 0, host="127.0.0.1")
        with urllib.request.urlopen(f"http://127.0.0.1:{srv2.port}/metrics", timeout=10) as r:
            assert "voloco_peer_round" not in r.read().decode()
        srv2.shutdown()
    finally:
        srv.shutdown()



def test_peer_metrics_server_drops_silent_connections(monkeypatch):
    import socket

    from peer.host import metrics

    assert metrics._Quiet.timeout is not None and 0 < metrics._Quiet.timeout <= 60
    monkeypatch.setattr(metrics._Quiet, "timeout", 0.5)
    srv = MetricsServer(lambda: progress(), lambda: "12D3KooWpeer", 0, host="127.0.0.1")
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:  # connects, never asks
            assert s.recv(1) == b""  # the server hung up on it (its thread is free again)
    finally:
        srv.shutdown()
