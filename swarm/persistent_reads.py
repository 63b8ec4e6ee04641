"""hivemind's reader of the p2p daemon's persistent connection, kept alive past a late answer.

Every unary call a process makes or serves through hivemind's p2p daemon (a DHT ping, find or store,
hivemind's matchmaking and join-probe requests) travels on one persistent connection, read by one task
(``ControlClient._read_from_persistent_conn``). When a call's caller gives up (a timeout cancels it),
its future is cancelled at once but leaves ``_pending_calls`` only when the caller next runs; an answer
read in between is set on the cancelled future, which raises ``InvalidStateError``, and the reading
task dies. The connection stays open, so the daemon keeps writing into it and nobody reads: the process
answers no unary call again, and its own calls time out, while its streams still work. A coordinator
flooded by 32 joining peers ended so: 6 peers never joined it (bench/RESULTS.md, "A join node whose DHT
stopped answering newcomers for good").

``install()`` wraps that method: the answer to a call already given up is dropped, as hivemind drops
one that comes after the call left ``_pending_calls``, and reading goes on with the next message.
Installed before a process starts its DHT node, so the forked DHT and averager processes inherit it.
Guarded by tests/swarm/test_persistent_reads.py.
"""

from __future__ import annotations

import asyncio
import logging

from hivemind.p2p.p2p_daemon_bindings.control import ControlClient

logger = logging.getLogger("voloco.swarm")

_original = ControlClient._read_from_persistent_conn


async def _read_on(self: ControlClient, reader: asyncio.StreamReader) -> None:
    """hivemind's read loop, entered again where an answer for a cancelled call stopped it."""
    while True:
        try:
            return await _original(self, reader)
        except asyncio.InvalidStateError:  # (the message is consumed: the next read is the next message)
            logger.debug("dropped a p2p daemon answer to a call given up a moment before")


def install() -> None:
    """Wrap hivemind's reader (idempotent)."""
    ControlClient._read_from_persistent_conn = _read_on
