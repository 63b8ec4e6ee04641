"""The coordinator's chain former: groups the chain candidates it sees in the DHT into pipeline
chains and publishes each assignment.

A chain stays while every member reports itself ``assigned``; when a member disappears (its
record has been missing from the reads for ``MISSED_S``), returns to ``waiting`` (its chain broke) or
says it is ``leaving`` (it stops: the chain ended, logged as such), the chain's record is no longer
refreshed and the waiting members are grouped again under a newer epoch, which supersedes the old
chain for every reader.

A chain that breaks young (its stages could not connect, or one died at once) is not formed again
from the same members in the same order for a while: 30 s, doubling with every such failure up to
10 min. Meanwhile its members stay in the pool, so a chain of other members, or of these with new
candidates, is formed as soon as capacity allows; the members themselves log why they could not
connect (peer/chain/stage.py).
"""

from __future__ import annotations

import logging
import time
from typing import Dict, List, Set, Tuple

from protocol.chain.formation import form_chains
from protocol.chain.records import ASSIGNMENT_TTL, ChainAssignment
from protocol.spec import RunSpec
from swarm.records import publish_assignment, read_assignments, read_candidates

logger = logging.getLogger("voloco.coordinator")

GRACE = 20.0  # seconds a new chain's members may still report "waiting" before it counts as broken
MISSED_S = 20.0  # seconds a member's record may be missing from the reads (a read that missed it) before it counts as gone
YOUNG = 300.0  # a chain that breaks within this many seconds of forming counts as a failed formation
BACKOFF_S, MAX_BACKOFF_S = 30.0, 600.0  # a failed formation is not repeated for this long, doubling
FORGET_FAILURES_S = 3600.0  # a back-off that ended this long ago is forgotten (candidates come and go)


class ChainFormer:
    def __init__(self, dht, spec: RunSpec):
        self.dht, self.spec = dht, spec
        self.published: Dict[str, float] = {}  # chain id -> when this coordinator last stored it
        self.formed_at: Dict[str, float] = {}  # chain id -> when it was formed (or first seen)
        self.dead: Set[str] = set()  # chains seen broken
        self.failures: Dict[Tuple[str, ...], Tuple[int, float]] = {}  # members -> (failed formations, retry after)
        self.seen: Dict[str, float] = {}  # a live chain's member -> when a read last found its record

    def step(self) -> List[ChainAssignment]:
        """One pass: keep live chains alive, group waiting candidates into new ones; returns the new ones."""
        now = time.monotonic()
        candidates = read_candidates(self.dht, self.spec)
        current = {a.chain.chain_id: a for a in read_assignments(self.dht, self.spec).values()}
        busy = set()
        for chain_id, a in current.items():
            if chain_id in self.dead:  # broke; its record lingers in the DHT until it expires
                continue
            self.formed_at.setdefault(chain_id, now)
            young = now - self.formed_at[chain_id] < GRACE
            for p in a.chain.members:
                if p in candidates:
                    self.seen[p] = now
            # a record missing from one read is a read that missed it (a loaded host), not a member that left
            # (tests/chain/test_stage_endpoints.py::test_a_member_missing_from_a_read_does_not_break_its_chain)
            states = [candidates[p].state if p in candidates else None for p in a.chain.members]
            leaving = [p for p, s in zip(a.chain.members, states) if s == "leaving"]
            if leaving:  # a member stops as asked: the chain ends, said at INFO
                self._note_broken(chain_id, a, now, leaving)
                continue
            missed = [now - self.seen.get(p, self.formed_at[chain_id]) < MISSED_S for p in a.chain.members]
            alive = all(s == "assigned" or (young and s == "waiting") or (s is None and m) for s, m in zip(states, missed))
            if not alive:
                self._note_broken(chain_id, a, now)
                continue
            busy.update(a.chain.members)
            if now - self.published.get(chain_id, 0.0) > ASSIGNMENT_TTL / 3:
                publish_assignment(self.dht, self.spec, a, ASSIGNMENT_TTL)
                self.published[chain_id] = now
        # bounded: members seen lately (a read that missed a chain's assignment keeps its members' times),
        # back-offs of the last hour
        self.seen = {p: t for p, t in self.seen.items() if now - t < 4 * MISSED_S}
        self.failures = {k: v for k, v in self.failures.items() if now - v[1] < FORGET_FAILURES_S}
        pool = [rec.candidate(p) for p, rec in sorted(candidates.items()) if rec.state == "waiting" and p not in busy]
        if not pool:
            return []
        chains, waiting = form_chains(self.spec, pool)
        epoch = int(time.time() * 1000)  # survives coordinator restarts: a newer chain always wins
        formed = []
        for chain in chains:
            retry_at = self.failures.get(tuple(chain.members), (0, 0.0))[1]
            if now < retry_at:
                logger.debug(f"not forming again the chain of {', '.join(p[-6:] for p in chain.members)} for "
                             f"{retry_at - now:.0f} s (it broke right after forming)")
                continue
            assignment = ChainAssignment(self.spec.digest(), epoch, chain)
            publish_assignment(self.dht, self.spec, assignment, ASSIGNMENT_TTL)
            self.published[chain.chain_id] = self.formed_at[chain.chain_id] = now
            self.dead.discard(chain.chain_id)  # the same members and ranges make the same id
            stages = ", ".join(f"{p[-6:]} blocks {s}-{e - 1}" for p, s, e in chain.ranges())
            logger.info(f"formed chain {chain.chain_id} of {len(chain.stages)} stages: {stages}")
            formed.append(assignment)
        if waiting:
            logger.info(f"{len(waiting)} chain candidate(s) wait for more capacity: {', '.join(p[-6:] for p in waiting)}")
        return formed

    def _note_broken(self, chain_id: str, a: ChainAssignment, now: float, leaving: List[str] = ()) -> None:
        """A chain that is no longer alive: once, remember a young one's members to back off from.
        ``leaving``: its members that said they stop; the chain ended rather than broke (INFO, no
        warning), but a young one still counts as a failed formation, so a member that leaves right
        after every formation cannot pull an honest candidate into chain after chain
        (tests/chain/test_stage_endpoints.py)."""
        self.dead.add(chain_id)
        formed = self.formed_at.pop(chain_id, now)
        self.published.pop(chain_id, None)
        if leaving:
            logger.info(f"chain {chain_id} ended {now - formed:.0f} s after forming: {', '.join(p[-6:] for p in leaving)} stopped")
        if now - formed > YOUNG:
            return
        key = tuple(a.chain.members)
        count = self.failures.get(key, (0, 0.0))[0] + 1
        wait = min(BACKOFF_S * 2 ** (count - 1), MAX_BACKOFF_S)
        self.failures[key] = (count, now + wait)
        if leaving:
            logger.debug(f"not forming chain {chain_id}'s members together again for {wait:.0f} s (failure {count})")
            return
        logger.warning(f"chain {chain_id} ({', '.join(p[-6:] for p in key)}) broke {now - formed:.0f} s after forming "
                       f"(failure {count}): not forming it from the same members for {wait:.0f} s")
