"""When a peer writes checkpoints: after the rounds the writer's cost rule picks, and on stop.

The functions take the peer for what it holds (``opts.checkpoint_dir``, ``spec``, ``engine``, ``role``,
``totals``, ``checkpoint_writer``) and remember the last (round, θ hash) written in
``peer._checkpointed``, so a stop right after a round's checkpoint does not write it again.
Guarded by tests/checkpoints/test_checkpoints.py and tests/checkpoints/test_checkpoint_writer.py.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Tuple

from peer.checkpoints import contents as checkpoints

logger = logging.getLogger("voloco.peer")


def _saved_key(peer) -> Tuple[int, str]:
    return peer.engine.round, peer.engine.params_hash()


def checkpointing(peer) -> bool:
    """Whether this peer writes checkpoints: --checkpoint-dir is given and its role has them."""
    return peer.role is not None and peer.role.checkpointed and peer.opts.checkpoint_dir is not None


def checkpoint_due(peer) -> bool:
    """Whether a round ending now gets a checkpoint (the writer's cost rule, peer/checkpoints/writer.py)."""
    return checkpointing(peer) and peer.checkpoint_writer.due()


def save_checkpoint(peer, trainer: Optional[Dict[str, Any]] = None) -> None:
    """A checkpoint written now, in this thread (the stop's), remembered so it is not repeated.
    ``trainer``: the training state to save (``checkpoints.trainer_snapshot``; None: as it is now)."""
    if not checkpointing(peer):
        return
    checkpoints.save(peer.opts.checkpoint_dir, peer.spec, peer.engine, peer.role, peer.totals.tokens, trainer)
    peer._checkpointed = _saved_key(peer)


def checkpoint_round(peer, trainer: Optional[Dict[str, Any]] = None) -> None:
    """The end-of-round checkpoint (when --checkpoint-dir): collected now, written by the peer's
    checkpoint writer in its own thread (peer/checkpoints/writer.py), so training goes on meanwhile.
    ``trainer``: as for ``save_checkpoint``."""
    if not checkpointing(peer):
        return
    tensors, meta = checkpoints.collect(peer.spec, peer.engine, peer.role, peer.totals.tokens, trainer)
    key, directory = _saved_key(peer), peer.opts.checkpoint_dir

    def saved() -> None:
        peer._checkpointed = key

    peer.checkpoint_writer.submit(lambda: checkpoints.save_checkpoint(directory, tensors, meta), saved)


def final_checkpoint(peer) -> None:
    """On stop: a checkpoint of the current parameters, unless the last one already is (after the
    write in progress, if any, has ended)."""
    engine = getattr(peer, "engine", None)
    if engine is None or not checkpointing(peer):
        return
    writer = getattr(peer, "checkpoint_writer", None)
    if writer is not None:
        writer.wait()
    if getattr(peer, "_checkpointed", None) == _saved_key(peer):
        return
    try:
        save_checkpoint(peer)
        logger.info(f"stopping: wrote a checkpoint of round {engine.round} to {peer.opts.checkpoint_dir}")
    except Exception as e:  # never lose the rest of the stop to a full disk
        logger.error(f"stopping: could not write a checkpoint: {e!r}")
