"""Typed errors for everything that comes from outside the process: specs, frames, payloads.

Every decoder in protocol/ raises only subclasses of ProtocolError on bad input, so a caller
can reject a peer's bytes with one ``except`` and never let them reach the model.
"""


class ProtocolError(ValueError):
    """Bytes or fields from another process that do not follow the protocol."""


class SpecError(ProtocolError):
    """An invalid run spec: a missing, unknown or out-of-range field."""


class FrameError(ProtocolError):
    """A wire frame that cannot be decoded: truncated, oversized, wrong version or type."""


class PayloadError(ProtocolError):
    """A pseudo-gradient payload that fails validation against the run spec."""
