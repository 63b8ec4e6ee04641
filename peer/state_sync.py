"""State sync: serve our state to late joiners, download the swarm's, check what we install.

The state is θ, its round and the strategy's shared state (DiLoCo's outer momentum), served
through hivemind's state sharing (``DecentralizedAverager.load_state_from_peers``). A downloaded
state is untrusted: it must name this run spec and exactly this run's tensors, with their shapes
and finite values, and be of at least the round we need.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, List, Sequence, Tuple

import torch

from peer.round_engine import RoundEngine
from protocol.errors import ProtocolError
from protocol.spec import RunSpec

logger = logging.getLogger("voloco.peer")


class StateSync:
    """Serving and downloading the replica state of one peer."""

    def __init__(self, spec: RunSpec, engine: RoundEngine, gatherer, membership, peer_id: str,
                 set_state: Callable[[str], str], on_installed: Callable[[int], None]):
        """``set_state(s)``: shows state ``s`` in the progress record, returns the previous one;
        ``on_installed(nbytes)``: θ changed (load it into the model) and ``nbytes`` were received."""
        self.spec, self.engine, self.gatherer, self.membership = spec, engine, gatherer, membership
        self.peer_id = peer_id
        self.layout = spec.param_shapes()
        self.consistent = True  # False after a round whose group started from other parameters than ours
        self._set_state, self._on_installed = set_state, on_installed

    # ---- serving --------------------------------------------------------------------------------
    def shareable_state(self) -> Tuple[dict, List[torch.Tensor]]:
        meta, tensors = self.engine.shareable()
        meta["spec"] = self.spec.digest()
        return meta, tensors

    def enable_sharing(self) -> None:
        # late joiners download from the most advanced peer, and never from one that left its group's consensus
        self.gatherer.state_sharing_priority = float(2 * self.engine.round + (1 if self.consistent else 0))
        self.gatherer.allow_state_sharing = True

    # ---- downloading ----------------------------------------------------------------------------
    def catch_up(self, even_at_same_round: bool = False) -> None:
        """Download the current state if live peers are ahead of us (round 0 is the seed's, everywhere).

        ``even_at_same_round``: this peer ended a round off its group's parameters and must take a
        state of at least its own (new) round, even if no groupmate has published that round yet:
        a groupmate still evaluating it serves an older state, which is refused and asked again."""
        others = self.membership.others(excluding=("stopped",))
        ahead = max((v.progress.round for v in others), default=-1)
        if even_at_same_round:
            if not others:
                return
            ahead = max(ahead, self.engine.round)
        elif ahead <= self.engine.round:
            return
        min_round = ahead
        previous = self._set_state("syncing")
        try:
            for attempt in range(3):
                logger.info(f"downloading the state of round {ahead} from a live peer")
                got = self.gatherer.load_state(timeout=self.spec.swarm.gather_timeout)
                if got is not None:
                    try:
                        self.install(*got, min_round=min_round)
                        self.consistent = True
                        self.enable_sharing()
                        return
                    except ProtocolError as e:
                        logger.warning(f"rejected a downloaded state: {e}")
                time.sleep(1.0 + attempt)
            logger.warning("could not download the current state; continuing from our own")
        finally:
            self._set_state(previous)

    def install(self, meta: Any, tensors: Sequence[torch.Tensor], min_round: int = 0) -> None:
        """Check a downloaded state and make it ours; ProtocolError (nothing changed) if it does not fit."""
        if not isinstance(meta, dict) or meta.get("spec") != self.spec.digest():
            raise ProtocolError("state is from another run spec")
        names, shared_names = meta.get("names"), meta.get("shared")
        if names != list(self.layout) or not isinstance(shared_names, list) or len(tensors) != len(names) + len(shared_names):
            raise ProtocolError("state does not list this run's tensors")
        round_no = meta.get("round")
        if isinstance(round_no, bool) or not isinstance(round_no, int) or round_no < 0:
            raise ProtocolError("state has no valid round")
        if round_no < min_round:  # a peer that has not finished the round yet: try again
            raise ProtocolError(f"state of round {round_no} is older than the swarm's round {min_round}")
        theta = {}
        for name, t in zip(names, tensors):
            if tuple(t.shape) != tuple(self.layout[name]) or not torch.isfinite(t).all():
                raise ProtocolError(f"state tensor {name} has a wrong shape or non-finite values")
            theta[name] = t.to(torch.float32).clone()
        shared = {k: t.to(torch.float32) for k, t in zip(shared_names, tensors[len(names):])}
        try:
            self.engine.install(theta, round_no, shared)
        except ValueError as e:
            raise ProtocolError(str(e)) from None
        self._on_installed(sum(t.numel() * t.element_size() for t in tensors))
        logger.info(f"installed the state of round {round_no} (θ {self.engine.params_hash()})")
