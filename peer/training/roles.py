"""What a peer trains: its role in the run, behind one small interface.

- ``FullReplica``: the whole model;
- ``SliceOwner``: the whole model, of which it trains one fixed slice (partial updates,
  protocol/model/partial.py): the rest has no gradients and no optimizer state;
- ``ChainStage``: a block range of the model, one stage of a pipeline chain (peer/chain/stage.py) that
  counts as one replica with its other stages.

Every role builds its share of the model, names the tensors it sends (its strategy's layout),
loads θ into its model, runs an inner step and says whether its tokens count. The round loop
(peer/round/loop.py) trains through this interface; it asks the kind of role only where a chain
stage's round differs (no overlap, "linking" until its links are up). A role whose round cannot go
on (a chain that broke) raises ``RoundAbandoned``; ``recover`` then gets the peer back to a trainable
role, or None when the peer is stopping. Early close (peer/round/early_close.py): a role that
``decides_close`` may end its round before H steps (``close_early``); a chain's first stage does so
for the whole chain, and its later stages' ``inner_step`` raise ``RoundClosedEarly`` where the
round ended.
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, Optional

import torch

from peer.chain.errors import RoundClosed
from peer.chain.stage import ChainBroken, ChainMember
from peer.training.data import Corpus, TrainStream
from peer.training.inner import InnerTrainer, evaluate
from peer.outer.strategies import OuterStrategy, Tensors, make_strategy
from protocol.model.partial import FULL, describe
from protocol.round.eligibility import part_key
from protocol.round.round_policy import min_steps
from protocol.wire.payload import Part
from protocol.spec import RunSpec
from protocol.chain.subspace_constraint import constrain_to_subspace_
from swarm.console import human_bytes

logger = logging.getLogger("voloco.peer")

__all__ = ["Role", "FullReplica", "SliceOwner", "ChainStage", "RoundAbandoned", "RoundClosedEarly"]


class RoundAbandoned(Exception):
    """This round's work cannot be completed (e.g. a neighbour of the chain died)."""


class RoundClosedEarly(Exception):
    """The round ended before this step (a chain's first stage closed it early): the steps taken
    so far are the round's; this step's batch was not used and is drawn again next round."""


class Role:
    """Base of every role: a model on the device, its inner trainer, its batch stream and the
    outer strategy for the tensors it sends."""

    kind = "role"

    def __init__(self, spec: RunSpec, part: Part, model: torch.nn.Module, device: torch.device, corpus: Corpus, shard: str,
                 compile: bool = False):
        self.spec, self.part, self.device = spec, part, device
        self.model = model.to(device)
        self.params: Dict[str, torch.nn.Parameter] = dict(self.model.named_parameters())
        self.strategy: OuterStrategy = make_strategy(spec, part=part)
        for name, p in self.params.items():  # partial updates: no gradients, no optimizer state for the rest
            p.requires_grad_(name in self.strategy.layout)
        self.trainer = InnerTrainer(self.model, spec.inner, device, compile=compile)
        self.trainable = sum(p.numel() for p in self.trainer.params)
        self.stream = TrainStream(corpus, spec.model.seq_len, spec.data.batch_size, spec.seed, shard=shard)
        logger.info(
            f"training {self.describe()}: {self.trainable / 1e6:.3f}M of {spec.model.num_params() / 1e6:.3f}M parameters "
            f"trainable, AdamW state {human_bytes(8 * self.trainable)}, inner steps in {self.trainer.precision} on {device}"
            + (" through torch.compile (the first steps compile it)" if compile else "")
            + (", each block recomputed in the backward" if getattr(self.model, "recompute_blocks", False) else "")
        )

    # ---- the interface the round loop uses -----------------------------------------------------
    def describe(self) -> str:
        return describe(self.spec, self.part)

    @property
    def counts_tokens(self) -> bool:
        """Whether this peer's tokens count in the swarm's total (a chain's count once)."""
        return True

    @property
    def reports_loss(self) -> bool:
        """Whether this role can evaluate the whole model (a chain stage cannot)."""
        return True

    @property
    def checkpointed(self) -> bool:
        """Whether a restart resumes this role from its checkpoint."""
        return True

    def load_theta(self, theta: Tensors) -> None:
        """θ (the global parameters of this round) into the model."""
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(theta[name].to(p.device, p.dtype))

    def begin_round(self, theta: Tensors, sync: Callable[[], int]) -> Tensors:
        """Get ready for the round's inner steps; the parameters the round starts from."""
        return theta

    def inner_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        return self.trainer.step(x, y)

    @property
    def decides_close(self) -> bool:
        """Whether this role may close a round early by itself (a chain's later stages follow the first)."""
        return True

    def close_early(self) -> None:
        """The round ends here, before H steps (peer/round/early_close.py)."""

    def lockstep_peers(self) -> tuple:
        """Peers that step with this one (a chain's other stages): early close does not count them."""
        return ()

    def end_round(self) -> None:
        """The inner steps are over (or were interrupted)."""

    def evaluate(self, val) -> float:
        return evaluate(self.model, val, self.device, self.trainer.autocast_dtype)

    def heartbeat(self) -> None:
        """Called every heartbeat period (from the heartbeat thread)."""

    def recover(self, corpus: Corpus) -> Optional["Role"]:
        """After ``RoundAbandoned``: a role to go on with (None: the peer is stopping)."""
        return self

    def release_device(self) -> None:
        """Give this role's device memory back before another role is built on the device: its
        weights and gradients, AdamW's moments, the strategy's local buffers (moved to the CPU, or
        dropped where they are only this role's). A GPU sized for one chain stage then holds the next
        one too (tests/training/test_roles.py)."""
        self.trainer.optimizer.state.clear()
        self.trainer.optimizer.zero_grad(set_to_none=True)
        self.model.to("cpu")
        self.strategy.to_host()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def status(self) -> Dict[str, object]:
        return {"part": self.part, "chain": None, "link_bytes_sent": 0, "link_bytes_received": 0, "link_tokens": 0}

    @property
    def progress_part(self) -> int:
        """The part this peer shows in its progress record (a chain stage counts as a replica's share)."""
        return self.part if isinstance(self.part, int) else FULL

    @property
    def progress_sends(self) -> str:
        """The part its payloads carry, for its progress record, where ``progress_part`` does not say it
        (a chain stage's blocks, protocol/round/eligibility.py ``part_key``); "" otherwise."""
        return "" if isinstance(self.part, int) else part_key(self.part)

    def shutdown(self) -> None:
        pass


class FullReplica(Role):
    kind = "full"

    def __init__(self, spec: RunSpec, model: torch.nn.Module, device: torch.device, corpus: Corpus, peer_id: str,
                 compile: bool = False):
        super().__init__(spec, FULL, model, device, corpus, shard=peer_id, compile=compile)


class SliceOwner(Role):
    kind = "slice"

    def __init__(self, spec: RunSpec, slice_index: int, model: torch.nn.Module, device: torch.device, corpus: Corpus, peer_id: str,
                 compile: bool = False):
        super().__init__(spec, slice_index, model, device, corpus, shard=peer_id, compile=compile)


class ChainStage(Role):
    """One stage of a chain: blocks [start, end) of the model, trained with its neighbours."""

    kind = "stage"

    def __init__(self, spec: RunSpec, chain: ChainMember, device: torch.device, corpus: Corpus):
        self.chain = chain
        self._T: Optional[torch.Tensor] = None
        self._close_from = 0
        # every stage of a chain draws the same batches: the chain id is the shard
        super().__init__(spec, chain.stage_range(), chain.build_stage(), device, corpus, shard=chain.assignment.chain.chain_id)

    def describe(self) -> str:
        start, end = self.part
        return f"blocks {start}-{end - 1} of a chain"

    @property
    def counts_tokens(self) -> bool:
        return self.part[0] == 0  # a chain's tokens count once, at its first stage

    @property
    def reports_loss(self) -> bool:
        return False  # one stage cannot run the whole model: full replicas report the loss

    @property
    def checkpointed(self) -> bool:
        return False  # a restarted stage waits for a chain and downloads the state

    def load_theta(self, theta: Tensors) -> None:
        super().load_theta(theta)
        if self.chain.U is not None:
            # the lossless variant, chain-local: this round starts from θ with every output
            # projection in span(U) (the embedding's drift from T is zero at a round's start)
            with torch.no_grad():
                T = theta["embed.weight"].to(self.device)
                constrain_to_subspace_(self.model.named_parameters(), self.chain.codec.basis_on(self.device), T, exact=True)

    def begin_round(self, theta: Tensors, sync: Callable[[], int]) -> Tensors:
        try:
            self.chain.open_links(sync, deadline_s=self.spec.swarm.round_wait)
        except ChainBroken as e:
            raise RoundAbandoned(str(e)) from e
        self._T = theta["embed.weight"].to(self.device)
        floor = min_steps(self.spec.outer.inner_steps, self.spec.outer.min_inner_fraction)
        self._close_from = self.trainer.step_count + floor  # a close of this round before that step breaks the chain
        return {n: p.detach().to("cpu", torch.float32).clone() for n, p in self.params.items()}

    def inner_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        try:
            loss = self.chain.inner_step(self.model, self.trainer, self._T, (x, y), close_from=self._close_from)
        except ChainBroken as e:
            raise RoundAbandoned(str(e)) from e
        except RoundClosed as e:
            self.stream.batches -= 1  # not trained: every stage draws it again, in step with the first
            raise RoundClosedEarly(str(e)) from e
        return float("nan") if loss is None else loss

    @property
    def decides_close(self) -> bool:
        return self.part[0] == 0  # the first stage: the others learn it from its close frame

    def close_early(self) -> None:
        try:
            self.chain.close_round(self.trainer.step_count)
        except ChainBroken as e:
            raise RoundAbandoned(str(e)) from e

    def lockstep_peers(self) -> tuple:
        return self.chain.mates()

    def end_round(self) -> None:
        self.chain.close_links()

    def evaluate(self, val) -> float:
        return float("nan")

    def heartbeat(self) -> None:
        self.chain.publish()  # the coordinator keeps a chain only while its members report in

    def recover(self, corpus: Corpus) -> Optional[Role]:
        """Wait for a new chain and build the stage it assigns."""
        if self.chain.wait_for_assignment() is None:
            return None
        self.release_device()  # stages are sized to the GPU: the old one's memory must be free for the new one
        return ChainStage(self.spec, self.chain, self.device, corpus)

    def status(self) -> Dict[str, object]:
        chain = self.chain
        return {
            "part": list(self.part),
            "chain": chain.assignment.chain.chain_id if chain.assignment else None,
            "last_chain": chain.last_chain_id,  # still there once the chain broke (a neighbour stopped first)
            "link_bytes_sent": chain.bytes_sent,
            "link_bytes_received": chain.bytes_received,
            "link_tokens": chain.tokens,
        }

    def shutdown(self) -> None:
        self.chain.shutdown()

