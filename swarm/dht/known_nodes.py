"""The nodes a peer met, remembered for its next start: more doors into the swarm than ``--join``.

A peer that stops writes the addresses of up to ``MAX_KNOWN`` nodes it is connected to into a file
beside its ``--identity`` (``IDENTITY.nodes``, one multiaddr with its /p2p/ id per line). When it
starts again and its join nodes answer late (a busy coordinator), it joins through those too
(swarm/dht/node.py), so a restarted swarm does not queue at one node. What the file holds is only a
hint: it is read bounded, a malformed line is skipped, and a node named there gets no trust it
would not get as a ``--join`` address. Guarded by tests/swarm/test_known_nodes.py.
"""

from __future__ import annotations

import logging
import os
import random
import time
from pathlib import Path
from typing import List, Optional

from multiaddr import Multiaddr

logger = logging.getLogger("voloco.swarm")

MAX_KNOWN = 16
LISTED_FOR_S = 2.0  # the daemon's list of connected peers is asked for at most this often (any stranger asks it)
REMEMBER_TIMEOUT_S = 5.0  # how long a stopping peer waits for its DHT to list the nodes it is connected to
MAX_FILE_BYTES = 16 * 256


def nodes_file(identity: Optional[os.PathLike]) -> Optional[Path]:
    """Where a peer with this ``--identity`` keeps the nodes it met (None: a temporary identity)."""
    return None if identity is None else Path(f"{identity}.nodes")


def recall(path: Optional[Path]) -> List[Multiaddr]:
    """The nodes remembered in ``path`` (well-formed multiaddrs with a /p2p/ id), in random order."""
    if path is None or not path.is_file():
        return []
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_FILE_BYTES).decode("utf-8", "replace")
    except OSError as e:
        logger.debug(f"could not read {path}: {e!r}")
        return []
    found = []
    for line in text.splitlines()[:MAX_KNOWN]:
        try:
            maddr = Multiaddr(line.strip())
            maddr.value_for_protocol("p2p")
            found.append(maddr)
        except Exception:
            continue
    random.shuffle(found)
    return found


async def connected_nodes(p2p, skip=None, limit: int = MAX_KNOWN) -> List[str]:
    """Up to ``limit`` of the nodes ``p2p`` is connected to (``skip`` aside), chosen at random, each
    as a multiaddr ending in its /p2p/ id: what a peer remembers, and what a busy join node hands
    out (swarm/access/join_probe.py)."""
    out = [f"{info.addrs[0]}/p2p/{info.peer_id.to_base58()}" for info in await _listed(p2p)
           if info.addrs and info.peer_id != skip]
    random.shuffle(out)
    return out[:limit]


async def _listed(p2p):
    """``p2p.list_peers()``, asked of the daemon at most every ``LISTED_FOR_S`` (each asking opens a
    control connection to it, and every run-access request of a stranger asks:
    tests/swarm/test_known_nodes.py)."""
    at, infos = getattr(p2p, "_voloco_listed", (float("-inf"), None))
    if infos is None or time.monotonic() - at >= LISTED_FOR_S:
        infos = await p2p.list_peers()
        p2p._voloco_listed = (time.monotonic(), infos)
    return infos


async def _connected(_dht, node) -> List[str]:
    return await connected_nodes(node.p2p)


def remember(dht, path: Optional[Path]) -> None:
    """Write up to ``MAX_KNOWN`` of the nodes ``dht`` is connected to into ``path``; never raises."""
    if path is None:
        return
    try:
        nodes = dht.run_coroutine(_connected, return_future=True).result(timeout=REMEMBER_TIMEOUT_S)
        if nodes:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(f"{n}\n" for n in nodes if len(n) < 256))
            os.replace(tmp, path)
    # a hint for the next start, never a reason not to stop: GeneratorExit is what the answer is when the
    # DHT process is closing its loop as we ask (a 32-peer bench's peer exited with an error on it)
    except (Exception, GeneratorExit) as e:
        logger.debug(f"could not remember the nodes met: {e!r}")
