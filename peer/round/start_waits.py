"""A peer's waits at the start of a run: the slice of a partial run it owns, and the start quorum.

A mixin of peer/round/membership.py's ``Membership``: both read its view of the run's progress records
(``others``), its ``timing``, ``peer_id`` and ``stop``. Guarded by tests/round/test_control_plane.py.
"""

from __future__ import annotations

import logging
import time
from typing import Iterable

from protocol.dht.records import CHOOSING
from protocol.model.partial import choose_part
from protocol.round.peer_states import IN_ROUND, LINKING, NOT_IN_ROUNDS

# a chain stage "linking" is past its own quorum: it counts as started, and as going (``wait_for_quorum``)
NOT_STARTED = NOT_IN_ROUNDS - {LINKING}

logger = logging.getLogger("voloco.peer")


class StartWaits:
    """``Membership``'s waits before round 0 (see the module docstring)."""

    def choose_slice(self, slices: int) -> int:
        """The slice of a partial run to own: peers that start together see each other choosing
        and spread over the slices."""
        time.sleep(self.timing.empty_view_wait())
        view = self.others(excluding=("stopped",))
        owners = [v.progress.part for v in view if v.progress.part >= 0]
        waiting = [v.peer_id for v in view if v.progress.part == CHOOSING]
        part = choose_part(slices, owners, waiting, self.peer_id)
        counts = {s: owners.count(s) for s in range(slices)}
        logger.info(f"took slice {part} of {slices} (live owners per slice before: {counts})")
        return part

    def wait_for_quorum(self, n: int) -> None:
        """A coordinated start: hold round 0 until ``n`` peers (this one included) have started.

        Peers that are still starting do not count (they may still be loading data). A peer already
        training ends the wait: it saw the quorum (or the run is under way, and this peer caught up
        with it at start); so does a chain stage bringing its links up ("linking"), which it does only
        past its own quorum: its next stage, still waiting here, would otherwise never listen for it,
        and the others, that never saw it waiting, would wait for it for ever
        (``test_a_chain_stage_linking_past_its_quorum_ends_the_wait``). Each peer's view is partial
        on a loaded host, so the peers of one swarm can reach their own count minutes apart, and the
        first to reach it would train round 0 alone beside peers still waiting; following the first
        starts everyone within a read of each other
        (tests/round/test_control_plane.py,
        ``test_the_start_quorum_ends_when_another_peer_began_training_on_its_own_count``)."""
        t0 = last_log = time.monotonic()
        started = {self.peer_id}  # a peer seen started counts until it is seen stopped (a read may miss it)
        while not self.stop.is_set():
            every = self.others(excluding=())
            view = [v for v in every if v.progress.state not in NOT_STARTED]
            started = (started | {v.peer_id for v in view}) - {v.peer_id for v in every if v.progress.state == "stopped"}
            if len(started) >= n:
                logger.info(f"{len(started)} peers have started")
                return
            going = [v for v in view
                     if v.progress.round > 0 or v.progress.state in IN_ROUND or v.progress.state == LINKING]
            if going:
                logger.info(f"{names(v.peer_id for v in going[:3])} began training (round {going[0].progress.round}): "
                            f"starting with them ({len(started)} of {n} peers seen started)")
                return
            if time.monotonic() - last_log >= 10.0:
                last_log = time.monotonic()
                logger.info(f"waiting for {n} peers to start ({len(started)} so far, {last_log - t0:.0f} s)")
            time.sleep(self.timing.view_poll_s)


def names(peers: Iterable[str]) -> str:
    return ", ".join(sorted(peers))
