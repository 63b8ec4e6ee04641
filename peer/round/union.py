"""A set of the last round that arrives after the round ended: the union grows, θ is recomputed.

θ of round r + 1 is a deterministic function of θ of round r and the union of the signed sets of
round r (protocol/group_sets.py: ``union``, in canonical order). A member that concluded round r
before it saw every group's set (its merge stopped waiting, or a group gathered late) holds a θ
apart from the members that saw it. So a member keeps what it needs to conclude round r again
(``LastRound``: θ and the strategy's shared state before the round's outer step, and the sets it
held), and before it gathers round r + 1 it looks in the view for sets of round r that it lacks
(``repair``): it fetches them, checks every envelope, and, if the union grew, concludes round r again
from the larger union. Members that hold the same sets then hold the same θ, whichever waited
longest; the round's local buffers (what this peer sent) are not touched again. The fetches of one
repair take at most ``Timing.set_fetch_s`` together: a set named by a peer that never serves it
delays the next round's gather by that, once.

A state installed since (a download) makes the kept round stale: it is not repaired. A set that
cannot be fetched or does not check leaves the round as it was (the next round's start-hash check
repairs a split as before). Guarded by tests/round/test_union.py.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Dict, Optional

from peer.round.merge import _fetch
from protocol import group_sets

logger = logging.getLogger("voloco.peer")

MAX_LATE_SETS = 16  # sets of the last round one repair fetches at most (a round has few groups)


@dataclass
class LastRound:
    """What concluding round ``round`` again takes."""

    round: int
    snapshot: object  # RoundEngine.snapshot(): θ and the shared state before the round's outer step
    sets: Dict[str, Dict[str, bytes]]  # set name -> sender -> payload, every set the union holds
    after_hash: str = ""  # θ's hash once the round was concluded (a state installed since changes it)


def repair(peer, last: Optional[LastRound]) -> bool:
    """Conclude ``last.round`` again if the view names sets of it that ``last`` lacks and they add
    payloads to its union; True if θ changed. Never raises: a failure leaves θ as it was."""
    engine = peer.engine
    if last is None or engine.round != last.round + 1 or engine.params_hash() != last.after_hash:
        return False
    try:
        return _repair(peer, last)
    except Exception as e:  # the round stays as it was concluded
        logger.warning(f"round {last.round}: could not take a late set into its union: {e!r}")
        return False


def _repair(peer, last: LastRound) -> bool:
    membership, gatherer, engine = peer.membership, peer.gatherer, peer.engine
    part, timing = peer.role.progress_part, membership.timing
    named: Dict[str, list] = {}
    for v in membership.view():
        name = v.progress.set_of(last.round)
        if v.peer_id != peer.peer_id and v.progress.part == part and name and name not in last.sets:
            named.setdefault(name, []).append(v.peer_id)
    if not named:
        return False
    before, _ = group_sets.union(last.sets[d] for d in sorted(last.sets))
    grew = False
    deadline = time.monotonic() + timing.set_fetch_s  # all the late sets together: a round starts late by at most this
    for name, sources in sorted(named.items())[:MAX_LATE_SETS]:
        for source in sources[:3]:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            got = _fetch(gatherer, peer.spec, source, name, last.round, left)
            if got is not None:
                last.sets[name] = got
                grew = True
                break
    if not grew:
        return False
    payloads, excluded = group_sets.union(last.sets[d] for d in sorted(last.sets))
    if payloads == before:
        return False  # the late sets held nothing new (their members' payloads were ours already)
    old = engine.params_hash()
    with engine.lock:
        decoded, invalid = engine.decode_at(payloads, last.round)
        engine.redo(last.snapshot, decoded, {**excluded, **invalid})
        last.after_hash = engine.params_hash()
    logger.info(f"round {last.round}: took {len(last.sets)} sets into its union ({len(payloads)} payloads, "
                f"{len(payloads) - len(before)} more): θ {old} -> {last.after_hash}")
    history = peer.totals.history
    if history and history[-1].round == last.round + 1:
        history[-1].params_hash, history[-1].sets = last.after_hash, len(last.sets)
        history[-1].contributors = len(decoded)
    return True
