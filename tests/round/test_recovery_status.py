"""A running peer whose role abandoned a round says so in its status file at once: a chain stage
whose chain broke names no chain and is "waiting for a chain" while it waits for a new one (a
low-memory host once kept its broken chain's status, "exchanging" in it, for minutes)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from peer.host import lifecycle
from peer.training.roles import ChainStage
from peer.host.runtime import Peer
from swarm.jsonout import loads_strict


def _running_peer(tmp_path, role):
    peer = SimpleNamespace(role=role, state="exchanging", started=True, stop_event=threading.Event(),
                           phase="getting the swarm's state", opts=SimpleNamespace(status_file=tmp_path / "status.json"),
                           membership=SimpleNamespace(publish=lambda: None), _load_theta=lambda: None, corpus=None,
                           engine=object())
    peer.status = lambda: {"state": peer.state, "phase": lifecycle.phase_of(peer), **role.status()}
    peer._set_state = lambda state: Peer._set_state(peer, state)
    lifecycle.report_phase(peer)
    return peer


def test_a_stage_whose_chain_broke_reports_waiting_for_a_chain_and_no_chain(tmp_path):
    waits = []
    stage = ChainStage.__new__(ChainStage)  # its state after ChainMember.broken(): no assignment
    stage.part = (1, 2)
    stage.chain = SimpleNamespace(assignment=None, bytes_sent=10, bytes_received=20, tokens=30, last_chain_id="ch-1",
                                  wait_for_assignment=lambda: waits.append(1))  # None: the peer is stopping
    peer = _running_peer(tmp_path, stage)
    assert loads_strict((tmp_path / "status.json").read_text())["phase"] == "training"
    Peer._recover(peer)
    status = loads_strict((tmp_path / "status.json").read_text())
    assert waits == [1]  # the status was written before the wait, not after it
    assert status["phase"] == "waiting for a chain" and status["chain"] is None and status["state"] == "starting"
    assert status["last_chain"] == "ch-1"  # what it trained in, for readers that summarise a run
    peer.state = "training"  # a new chain linked and trains: the phase follows the state again
    assert lifecycle.phase_of(peer) == "training"
    peer.stop_event.set()
    assert lifecycle.phase_of(peer) == "stopping"


def test_a_full_peer_that_abandoned_a_round_reports_recovering(tmp_path):
    role = SimpleNamespace(recover=lambda corpus: None, status=lambda: {"chain": None})
    peer = _running_peer(tmp_path, role)
    Peer._recover(peer)
    assert loads_strict((tmp_path / "status.json").read_text())["phase"] == "recovering"
