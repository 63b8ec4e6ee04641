"""A peer's start-up phases, as it reports them, and its clean stop.

Start-up takes a while (the DHT, the run spec, the corpus, a chain assignment, the swarm's state),
so the peer says where it is: its status file (``--status-file``) is written at each phase with a
``phase`` field, and keeps one afterwards, derived from its state:

    starting -> joining the DHT -> loading data -> [waiting for a chain] -> getting the swarm's state
    -> [waiting for peers] -> [linking the chain] -> training -> stopping -> stopped

A running peer whose role abandoned a round goes back to a phase of its own until it has another:
"waiting for a chain" (a stage whose chain broke; its status names no chain meanwhile) or
"recovering", then "linking the chain" or "training" again.

Until the first round ends the status has every key a full one has, with neutral values (round 0,
no history, ``null`` losses), so readers need no special case.

Stopping (Ctrl+C, SIGTERM): the round in progress is abandoned (its parameters stay those of the
round's start; a gather under way ends within its own timeout), the peer writes a checkpoint when
the last one is not of its current parameters (e.g. it stopped during its first round, or after
downloading the swarm's state), says "stopped" in the DHT and its status file, and shuts down
hivemind's averager and DHT processes, which stop their p2pd daemon; the wire meter stops last.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from typing import Any, Dict, Optional, Tuple

from peer.checkpoints.schedule import final_checkpoint
from peer.round.report import write_status
from protocol.round.timing import Timing
from swarm.wire.meter import WireMeter, wire_report

logger = logging.getLogger("voloco.peer")


# the start-up phases, and what the peer's state means once it runs
STATE_PHASES = {"waiting": "waiting for peers", "linking": "linking the chain", "stopped": "stopped"}


def set_phase(peer, phase: str) -> None:
    """Enter a start-up phase: log it and write the status file with it."""
    peer.phase = phase
    logger.debug(f"phase: {phase}")
    try:
        write_status(peer.opts.status_file, peer.status() if getattr(peer, "engine", None) is not None else startup_status(peer))
    except OSError as e:  # a status file that cannot be written must not stop the peer
        logger.warning(f"could not write the status file {peer.opts.status_file}: {e}")


def report_phase(peer) -> None:
    """Once the peer runs: write the status file when its phase changes (training, linking, ...)."""
    phase = phase_of(peer)
    if getattr(peer, "started", False) and phase != getattr(peer, "_reported_phase", None):
        peer._reported_phase = phase
        set_phase(peer, phase)


def phase_of(peer) -> str:
    """The phase to report: the start-up phase until the peer runs, then its state's."""
    if peer.state in STATE_PHASES:
        return STATE_PHASES[peer.state]
    if getattr(peer, "started", False):
        if peer.stop_event.is_set():
            return "stopping"
        # "starting" once running: the role abandoned a round and is getting another (peer/host/runtime.py)
        return getattr(peer, "phase", "recovering") if peer.state == "starting" else "training"
    return getattr(peer, "phase", "starting")


def startup_status(peer) -> Dict[str, Any]:
    """The status before the peer has a model: every key of ``Peer.status()``, neutral values."""
    spec = getattr(peer, "spec", None)
    return {
        "peer_id": getattr(peer, "peer_id", ""),
        "run_id": spec.run_id if spec is not None else None,
        "spec": spec.digest() if spec is not None else None,
        "strategy": spec.outer.strategy if spec is not None else None,
        "state": peer.state,
        "phase": phase_of(peer),
        "round": 0,
        "initial_val_loss": None,
        "val_loss": None,
        "tokens": 0,
        "rounds": 0,
        "util": None,
        "bytes_sent": 0,
        "bytes_received": 0,
        "wire": wire_status(peer),
        "cpu_by_thread": None,
        "params_hash": "",
        "state_digest": "",
        "history": [],
    }


def meter_wire(peer) -> None:
    """Count every byte on the peer's wire from now on (swarm/wire/meter.py: the TCP sockets of its
    process tree, p2pd's included); ``shutdown`` stops the meter."""
    peer.wire = WireMeter().start()


def wire_status(peer) -> Optional[Dict[str, Any]]:
    """The peer's wire bytes (read whole once the peer has stopped), and what they were: its payloads as it counted them
    (exchange, state download), its chain links' activations, the control plane (the rest).
    None when unknown (no meter yet, or the kernel's counters cannot be read here)."""
    meter = getattr(peer, "wire", None)
    if meter is None:
        return None
    role, totals = getattr(peer, "role", None), getattr(peer, "totals", None)
    links = role.status() if role is not None else {}
    payload = (totals.bytes_sent, totals.bytes_received) if totals is not None else (0, 0)
    # while the peer runs, the meter's last dump and a lookup of the sockets it follows: no dump a status
    return wire_report(meter.totals(fresh=getattr(peer, "state", "") == "stopped"), payload,
                       (links.get("link_bytes_sent", 0), links.get("link_bytes_received", 0)))


def shutdown(peer, closers: Tuple[Optional[Any], ...]) -> None:
    """Checkpoint, then stop hivemind's processes (and with them p2pd): the chain's links, the
    averager, the DHT, in that order; then write the status once more, with the wire's final count
    (the closed connections' last bytes included)."""
    peer.stop_event.set()
    final_checkpoint(peer)
    if not getattr(peer, "started", False) and peer.state != "stopped":  # stopped during start-up
        peer.state = "stopped"
        set_phase(peer, "stopped")
    meter = getattr(peer, "wire", None)
    with meter.closely() if meter is not None else nullcontext():  # p2pd's connections' last bytes
        if meter is not None and getattr(peer, "started", False):
            # p2pd closes its connections abortively (SO_LINGER 0), which zeroes the kernel's counters at
            # both ends: the last moment's bytes (the "stopped" record, replies in flight) are let through first
            time.sleep(Timing.settle_s)
        for closer in closers:
            if closer is not None:
                try:
                    closer.shutdown()
                except Exception as e:
                    logger.debug(f"shutdown: {e!r}")
    if meter is not None:
        meter.shutdown()
        if peer.state == "stopped":
            set_phase(peer, phase_of(peer))
    logger.info("stopped")
