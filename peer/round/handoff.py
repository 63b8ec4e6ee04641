"""A round's inner steps, what they hand to its exchange, and how an overlapped round lands.

``InnerSteps`` (a mixin of peer/round/loop.py's ``RoundLoop``, using its exchange in flight and its
early close: peer/round/early_close.py) takes up to H inner steps on the role. A chain's first stage
closes the round for the whole chain, and its later stages stop where its ``close`` frame came
(``RoundClosedEarly``; tests/round/test_pause_for_no_shows.py,
tests/chain/test_chain_swarm.py::test_a_slow_chain_closes_its_rounds_early_as_one_replica_and_shares_them).

``Handoff`` is what the inner steps of a round hand to its exchange (in the loop's thread, or with
overlap in the exchange's own). ``continue_from`` is the one-step-delayed outer update: the model
continues from the new θ plus the steps taken while the exchange was in flight (docs/round.md,
"Overlap"; tests/outer/test_overlap.py). Used by peer/round/loop.py and peer/round/simulate.py."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from peer.training.progress_bar import ProgressBar
from peer.training.roles import RoundClosedEarly

__all__ = ["Handoff", "InnerSteps", "continue_from"]

logger = logging.getLogger("voloco.peer")


def continue_from(params: Dict[str, torch.Tensor], theta: Dict[str, torch.Tensor], sent: Dict[str, torch.Tensor]) -> None:
    """The one-step-delayed update, in place: ``params ← θ + (params − θ_send)``. With no step
    taken since ``sent`` the model is θ exactly, as in the sequential loop. A parameter ``sent`` lacks
    (a partial peer's frozen slice, which no step moves) becomes θ's."""
    with torch.no_grad():
        for name, param in params.items():
            if name in sent:
                param.sub_(sent[name]).add_(theta[name].to(param.device, param.dtype))
            else:
                param.copy_(theta[name].to(param.device, param.dtype))


@dataclass
class Handoff:
    """What the inner steps of a round hand to its exchange."""

    payload: Optional[bytes]  # None until encoded (with overlap, in the exchange's thread)
    pending: Any
    losses: List[float]
    t0: float  # when the round's inner steps began
    t_train: float  # when they ended
    t_encode: float  # when the payload was ready
    # the training state to checkpoint (checkpoints.trainer_snapshot), taken when the inner steps ended;
    # with overlap, None when no checkpoint is due this round (peer/checkpoints/writer.py)
    trainer: Optional[Dict[str, Any]] = None
    overlapped: int = 0  # inner steps taken while the previous round's exchange was in flight
    cpu0: float = 0.0  # time.thread_time() of the exchange's thread when its work began (the encode)


class InnerSteps:
    """``RoundLoop``'s inner steps (see the module docstring)."""

    def _pause_for_no_shows(self) -> None:
        """No step while the exchange in flight waits for peers that have not come, alone: its barrier for
        strangers (paid from the budget for strangers, a twentieth of wall time), or its group's first agreement
        round for members that sent nothing once the others' payloads came (a grace: peer/exchange/
        side_by_side.py). A step on the old θ meanwhile would turn such a peer's claim into loss as well as
        time (bench/RESULTS.md, "Stallers cost time, not loss"; tests/round/test_rejoin.py,
        tests/round/test_pause_for_no_shows.py)."""
        peer = self.peer
        strangers, silent = peer.membership.waiting_for_strangers, peer.gatherer.waiting_for_silent
        waiting = lambda: strangers.is_set() or silent.is_set()  # noqa: E731
        if waiting() and self._thread.is_alive():
            why = ("its barrier waits for peers never seen to come" if strangers.is_set()
                   else "its group waits for a member that sent nothing")
            logger.info(f"round {peer.round + 1}: pausing while round {peer.round}'s exchange runs: {why}")
        while waiting() and self._thread.is_alive() and not peer.stop_event.is_set():
            time.sleep(peer.membership.timing.pause_poll_s)

    def _inner_steps(self, H: int):
        """Up to H inner steps; (losses, the parameters the round started from), or (None, None)
        when the peer is stopping. Raises RoundAbandoned when the role cannot go on."""
        peer = self.peer
        role = peer.role
        round_start = None if self.overlap else role.begin_round(peer.engine.theta, peer._sync_round)
        if not self.in_flight:
            peer._set_state("training")  # a chain stage is "linking" until its links are up
        self.early.lockstep = frozenset(role.lockstep_peers())  # a chain's stages: one replica, not peers to wait for
        self.early.watch(self.rounds_started())
        floor = self.min_steps if role.decides_close else H
        bar = ProgressBar(H, f"round {self.rounds_started()}")
        losses: List[float] = []
        self._overlapped = 0
        try:
            while len(losses) < H:
                peer.step = len(losses) + 1
                if peer.stop_event.is_set():
                    return None, None
                if self.in_flight:
                    self._pause_for_no_shows()
                    if peer.stop_event.is_set():
                        return None, None
                ahead = 0 if self._hold else self.max_ahead
                if self.in_flight and (not self._thread.is_alive() or self._overlapped >= ahead):
                    if self._hold and self._thread.is_alive():
                        logger.info(f"round {peer.round + 1}: waiting for round {peer.round}'s exchange before its first "
                                    f"step: no round concluded yet, so its barrier may wait for every peer announced")
                    elif self._thread.is_alive():  # steps further ahead would train on a θ too stale
                        logger.info(f"round {peer.round + 1}: waiting for round {peer.round}'s exchange, {self._overlapped} steps ahead of it")
                    if not self.finish():
                        losses, self._overlapped = [], 0
                        bar.update(0)
                    self.early.watch(peer.round)
                if len(losses) >= floor and not self.in_flight:
                    self.early.arm()
                if len(losses) >= floor and not self.in_flight and self.early.due():
                    role.close_early()  # a chain's first stage: its other stages stop at the same step
                    self.closed_early += 1
                    logger.info(f"round {peer.round}: closing the round after {len(losses)} of {H} inner steps: "
                                f"most of its peers are ready")
                    break
                x, y = role.stream.next_batch()
                t = time.monotonic()
                try:
                    loss = role.inner_step(x, y)
                except RoundClosedEarly:
                    self.closed_early += 1
                    logger.info(f"round {peer.round}: closing the round after {len(losses)} of {H} inner steps, "
                                f"as the chain's first stage did")
                    break
                dt = time.monotonic() - t
                peer.util.busy(dt)
                tps = x.numel() / dt
                peer.tokens_per_s = 0.8 * peer.tokens_per_s + 0.2 * tps if peer.tokens_per_s else tps
                if role.counts_tokens:
                    peer.totals.tokens += x.numel()
                losses.append(loss)
                self._overlapped += self.in_flight
                peer.last_loss = loss
                bar.update(peer.step, f"loss {peer.last_loss:.3f} | {peer.tokens_per_s / 1e3:.1f}k tok/s")
        finally:
            bar.close()
            self.early.unwatch()
            role.end_round()
        return losses, round_start
