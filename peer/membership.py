"""Who is in the run, as this peer sees it: heartbeat, view, start quorum and the round barrier.

Every peer publishes a progress record (protocol/records.py) under the run's key every
``swarm.heartbeat_period`` and whenever its state changes, and reads everyone's to decide whom to
wait for. Records are read through ``swarm.records`` (hivemind's DHT); a slow DHT never stops
training (an unreadable view is an empty one).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Set

from protocol.partial import choose_part
from protocol.records import CHOOSING, Progress
from protocol.spec import RunSpec
from swarm.records import PeerView, publish_progress, read_progress

logger = logging.getLogger("voloco.peer")

# peers that take no part in rounds yet: booting, or waiting for a chain. A peer never waits for
# them; one that went ahead alone meanwhile is caught up with (downloaded) when they start.
NOT_IN_ROUNDS = ("stopped", "starting")


@dataclass
class Barrier:
    """What the wait before a round's exchange found."""

    expected: int  # group size to expect: this peer and every peer of its round that is ready
    alone: bool  # no other live peer at all
    behind: bool  # some peer is at a later round

    @property
    def nobody_to_meet(self) -> bool:
        return self.alone or (self.behind and self.expected == 1)


class Membership:
    """This peer's progress record in the DHT and its view of everyone else's."""

    def __init__(self, dht, spec: RunSpec, peer_id: str, progress: Callable[[], Progress], stop: threading.Event):
        self.dht, self.spec, self.peer_id, self.stop = dht, spec, peer_id, stop
        self._progress = progress
        self._thread: Optional[threading.Thread] = None

    # ---- our record -----------------------------------------------------------------------------
    def publish(self) -> None:
        try:
            ttl = max(3 * self.spec.swarm.heartbeat_period, 10.0)  # a busy peer's heartbeat may be late
            publish_progress(self.dht, self.spec.run_id, self.peer_id, self._progress(), ttl=ttl)
        except Exception as e:
            logger.debug(f"could not publish progress: {e!r}")

    def start_heartbeat(self, extra: Callable[[], None]) -> None:
        """Publish every heartbeat period from a thread of its own, then call ``extra``."""

        def loop() -> None:
            while not self.stop.wait(self.spec.swarm.heartbeat_period):
                self.publish()
                try:
                    extra()
                except Exception as e:
                    logger.debug(f"heartbeat: {e!r}")

        self._thread = threading.Thread(target=loop, daemon=True, name="heartbeat")
        self._thread.start()

    # ---- everyone's ---------------------------------------------------------------------------------
    def view(self) -> List[PeerView]:
        """Every progress record of this run spec (our own included)."""
        try:
            views = read_progress(self.dht, self.spec.run_id)
        except Exception as e:  # the DHT being slow must not stop training
            logger.debug(f"could not read progress records: {e!r}")
            return []
        return [v for v in views if v.progress.spec == self.spec.digest()]

    def others(self, excluding=NOT_IN_ROUNDS) -> List[PeerView]:
        return [v for v in self.view() if v.peer_id != self.peer_id and v.progress.state not in excluding]

    def swarm_is_empty(self) -> bool:
        return not self.others()

    def choose_slice(self, slices: int) -> int:
        """The slice of a partial run to own: peers that start together see each other choosing
        and spread over the slices."""
        time.sleep(max(2 * self.spec.swarm.heartbeat_period, 5.0))
        view = self.others(excluding=("stopped",))
        owners = [v.progress.part for v in view if v.progress.part >= 0]
        waiting = [v.peer_id for v in view if v.progress.part == CHOOSING]
        part = choose_part(slices, owners, waiting, self.peer_id)
        counts = {s: owners.count(s) for s in range(slices)}
        logger.info(f"took slice {part} of {slices} (live owners per slice before: {counts})")
        return part

    def wait_for_quorum(self, n: int) -> None:
        """A coordinated start: hold round 0 until ``n`` peers (this one included) have started.

        Peers that are still starting do not count (they may still be loading data); a peer already
        past round 0 ends the wait (the run is under way: this peer caught up with it at start)."""
        t0 = last_log = time.monotonic()
        while not self.stop.is_set():
            view = self.others()
            started = {v.peer_id for v in view} | {self.peer_id}
            if len(started) >= n or any(v.progress.round > 0 for v in view):
                logger.info(f"{len(started)} peers have started")
                return
            if time.monotonic() - last_log >= 10.0:
                last_log = time.monotonic()
                logger.info(f"waiting for {n} peers to start ({len(started)} so far, {last_log - t0:.0f} s)")
            time.sleep(0.25)

    def wait_for_round(self, round_no: int, mates: Set[str], first_round: bool) -> Barrier:
        """Wait (up to ``swarm.round_wait``) until every live peer of ``round_no`` is ready.

        ``mates``: last round's groupmates; those still finishing it (evaluating, checkpointing)
        will train this round with us, so the group must not close before they arrive.
        ``first_round``: peers still "waiting" for the start quorum are about to train it too."""
        deadline = time.monotonic() + self.spec.swarm.round_wait
        busy = ("training", "waiting") if first_round else ("training",)
        while True:
            view = self.view()
            mine = [v for v in view if v.progress.round == round_no and v.peer_id != self.peer_id]
            training = [v for v in mine if v.progress.state in busy]
            finishing = [
                v for v in view
                if v.peer_id in mates and v.progress.round == round_no - 1 and v.progress.state not in NOT_IN_ROUNDS
            ]
            if not (training or finishing) or time.monotonic() > deadline or self.stop.is_set():
                others = [v for v in view if v.peer_id != self.peer_id and v.progress.state not in NOT_IN_ROUNDS]
                ready = [v for v in mine if v.progress.state in ("ready", "exchanging")]
                behind = any(v.progress.round > round_no for v in others)
                return Barrier(expected=1 + len(ready), alone=not others, behind=behind)
            time.sleep(0.25)
