"""What can stop one inner step of a chain stage: the errors of ``peer.chain.links`` and
``peer.chain.gpipe``. None of them is fatal to the process: the step did not happen.

``StageError`` is the base: a chain member (``peer.chain.stage``) turns any of them into a broken
chain. ``LinkError`` and its subclasses say the link to a neighbour failed and has been closed,
with the reason that was logged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from protocol.errors import FrameError

if TYPE_CHECKING:  # pragma: no cover
    from peer.chain.links import StageLink

__all__ = [
    "StageError",
    "LinkError",
    "LinkProtocolError",
    "HandshakeRejected",
    "LinkTimeout",
    "LinkClosed",
    "BatchMismatch",
    "NonFiniteOutput",
    "NonFiniteGradients",
    "RoundClosed",
]


class StageError(Exception):
    """A pipeline step could not complete; the process is fine, the parameters and the optimizer
    state are untouched (the gradients are cleared)."""


class LinkError(StageError):
    """A link to a neighbour failed; it has been closed. ``reason`` is what was logged."""

    def __init__(self, reason: str, link: Optional["StageLink"] = None):
        self.reason = reason
        self.link = link
        super().__init__(f"{link.name}: {reason}" if link is not None else reason)


class LinkProtocolError(LinkError, FrameError):
    """The neighbour sent bytes that break the protocol (``__cause__`` is the decoder's
    FrameError when there is one); also a ``FrameError``, so ``except ProtocolError`` sees it."""


class HandshakeRejected(LinkProtocolError):
    """Our hello was refused by the listener (``reason`` is what it sent back)."""


class LinkTimeout(LinkError):
    """No complete frame from the neighbour within the read deadline (dead or stalled)."""


class LinkClosed(LinkError):
    """The neighbour closed the connection (or said bye) between frames."""


class BatchMismatch(LinkProtocolError):
    """The token ids that reached the last stage are not those of the batch it was given."""


class NonFiniteOutput(LinkError):
    """What this stage would send (activations or their gradients) is not finite in the link's
    wire dtype: a diverged model, or extreme values from a neighbour. The link is closed so the
    neighbour learns at once instead of waiting for its deadline."""


class NonFiniteGradients(StageError):
    """The gradients a step accumulated are not all finite (a diverged model, or extreme values
    from a neighbour): the update is skipped, the parameters and optimizer state stay as they were."""


class RoundClosed(Exception):
    """The first stage closed the round early: a ``close`` frame came where step ``step``'s first
    activations would have. Not a failure (not a ``StageError``): the step did not start, the links
    stay up, and this stage ends its round after the steps it took, as every stage of the chain
    does (peer/round/early_close.py; tests/chain/test_pipeline.py)."""

    def __init__(self, step: int):
        super().__init__(f"the first stage closed the round before step {step}")
        self.step = step
