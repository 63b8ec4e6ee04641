"""A restarted coordinator reads the loss history back from the DHT and its chart goes on.

Real hivemind DHT nodes in this process: a coordinator (with a kept identity: the run's key) and a
peer that publishes progress; the coordinator stops, a new one with the same key joins the peer.
"""

from __future__ import annotations

import time

import pytest

from coordinator.dashboard import Dashboard
from protocol.dht.records import Progress
from protocol.spec import RunSpec
from swarm import records
from swarm.dht.node import start_dht
from swarm.access.identity import trust_of

pytestmark = pytest.mark.slow

SPEC = RunSpec().replace(run_id="test")
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def progress(rnd: int) -> Progress:
    return Progress(rnd, 0, "training", SPEC.digest(), 3.0 - rnd / 10, 3.1 - rnd / 10, rnd * 1000, 900.0, rnd * 10,
                    rnd * 20, "", -1, "cpu", 0.5, "public")


def test_history_survives_a_coordinator_restart(tmp_path):
    key = str(tmp_path / "coordinator.key")
    coord = start_dht((), LOOPBACK, identity_path=key, run_ids=[SPEC.run_id])
    nodes = [coord]
    try:
        assert records.publish_run(coord, SPEC)
        fingerprint = trust_of(coord).identity.fingerprint
        peer = start_dht(coord.get_visible_maddrs(), LOOPBACK, identity_path=str(tmp_path / "peer.key"), run_key=fingerprint)
        nodes.append(peer)
        assert records.fetch_spec(peer, timeout=20) == SPEC
        me = peer.peer_id.to_base58()

        dash = Dashboard(coord, SPEC, restore_for=0.0)  # a new run: nothing to restore
        for rnd in range(1, 6):
            assert records.publish_progress(peer, SPEC.run_id, me, progress(rnd), ttl=30).result()
            dash.refresh()
        assert [p["round"] for p in dash.snapshot["history"]["points"]] == [1, 2, 3, 4, 5]
        dash.stop()  # stores the points not stored yet (at most one store per 5 s while it runs)
        stored = records.read_history(peer, SPEC)
        assert stored is not None and [p.round for p in stored.points] == [1, 2, 3, 4, 5]
        coord.shutdown()
        nodes.remove(coord)

        again = start_dht(peer.get_visible_maddrs(), LOOPBACK, identity_path=key, run_ids=[SPEC.run_id])
        nodes.append(again)
        assert records.publish_run(again, SPEC)
        dash2 = Dashboard(again, SPEC)
        deadline = time.monotonic() + 30
        while True:
            records.publish_progress(peer, SPEC.run_id, me, progress(7), ttl=30).result()  # False while it rejoins
            dash2.refresh()
            if dash2.keeper.restored and dash2.snapshot["run"]["round"] == 7:
                break
            assert time.monotonic() < deadline, "the restarted coordinator never read the history back"
            time.sleep(0.5)
        points = dash2.snapshot["history"]["points"]
        assert [p["round"] for p in points] == [1, 2, 3, 4, 5, 7]
        assert points[0]["loss"] == pytest.approx(2.9) and points[-1]["tokens"] == 7000
        dash2.refresh()
        assert dash2.snapshot["run"]["tokens_total"] >= 7000 and dash2.snapshot["run"]["best_val_loss"] == pytest.approx(2.4)
    finally:
        for n in nodes:
            n.shutdown()
