"""The round engine: what every member of a group computes once a round's payloads are agreed.

No I/O: the engine holds the global parameters θ, the round number and the outer strategy (its
shared and local buffers), and turns a round's agreed payloads into the next θ:

1. ``encode``: Δ = θ_round_start − θ_local for the tensors this peer sends; the strategy folds it
   into its local buffers and encodes the payload;
2. ``decode``: every agreed payload, validated and decoded in the canonical order (by sender); a
   payload that fails validation is excluded, with the reason;
3. ``conclude``: check every contribution, clip a tensor past 1.5x the median norm, aggregate in
   that order, take the outer step on θ only if it leaves θ finite (peer/outer/robust.py), settle the
   local buffers (what was sent leaves them only if our payload counted), advance the round.

The live peer (peer/host/runtime.py), the in-process simulation (peer/round/simulate.py) and the benchmarks
call this one engine, so the simulation computes what the swarm computes by construction.
Every operation that reads or changes θ, the round or the strategy's state holds ``lock``
(a peer serves its state to late joiners from another thread).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple

import torch

from peer.outer.robust import Contributions, robust_step, sender_names, steps_of
from protocol.round import choice, eligibility, standing
from protocol.round.round_policy import min_steps
from peer.checkpoints.files import params_hash, state_digest
from peer.outer.strategies import OuterStrategy, Pending, Tensors, canonical_order, pseudo_gradient
from protocol.errors import ProtocolError
from protocol.wire.payload import Part, claimed_part

__all__ = ["RoundEngine", "Settled", "Snapshot"]


@dataclass
class Settled:
    """What one settled round did, for the record."""

    round: int  # the round that was settled (θ is now that of round + 1)
    contributors: int  # payloads that went into the aggregate
    excluded: Dict[str, str] = field(default_factory=dict)  # sender -> why its payload did not count
    delivered: bool = False  # our own payload counted
    clipped: Dict[str, float] = field(default_factory=dict)  # sender -> the smallest scale its update was clipped by
    scores: Dict[str, float] = field(default_factory=dict)  # sender -> its direction's agreement with the others (z)
    passed: List[str] = field(default_factory=list)  # senders not chosen this round (protocol/round/choice.py)
    copies: Dict[str, str] = field(default_factory=dict)  # sender -> the sender whose copy of its update counted
    weighed: Dict[str, float] = field(default_factory=dict)  # sender -> its weight where below 1 (a fresh sender)
    dropped: Dict[str, List[str]] = field(default_factory=dict)  # sender -> its tensors left out (robust.against)
    short: Dict[str, int] = field(default_factory=dict)  # sender -> the steps its payload covered, where fewer than H


class Snapshot(NamedTuple):
    """What concluding a round again starts from (``RoundEngine.snapshot``), copied."""

    round: int
    theta: Tensors
    shared: Tensors  # the strategy's shared state
    standing: Dict[str, int]
    eligibility: Dict[str, int]
    evidence: Dict[str, standing.Evidence]


class RoundEngine:
    """θ, the round number and the outer strategy of one replica (or of one part of it)."""

    def __init__(self, strategy: OuterStrategy, theta: Tensors, round_no: int = 0):
        self.strategy = strategy
        self.round = round_no
        self.lock = threading.RLock()
        self._theta = theta
        self._hash: Optional[str] = None
        self._digest: Optional[str] = None  # state_digest's cache, cleared with _hash
        self._reported: Tuple[int, str, str] = (round_no, "", "")  # reported()'s last (round, hash, digest)
        self.standing: Dict[str, int] = {}  # rounds counted per sender in this lineage (protocol/round/standing.py)
        self.evidence: Dict[str, standing.Evidence] = {}  # fresh senders' pooled scores (the same module)
        # p per part of who sends a payload at all when a round takes at most K (protocol/round/eligibility.py)
        self.eligibility: Dict[str, int] = {}
        # round -> its draw's candidates per part (name, weight at the draw), until concluded
        self._candidates: Dict[int, Dict[str, List[Tuple[str, int]]]] = {}
        self._open: Optional[Pending] = None  # our payload encoded and not settled yet (``encode``)
        self._own: Optional[Tuple[int, bool]] = None  # (round, whether our payload counted) of the last one settled
        self._since = 0  # settles since that one (each carried the buffers one encode further)
        self._owed: List[Tuple[Tensors, int]] = []  # ``redo``'s corrections, due once ``_open`` settles

    # ---- θ ------------------------------------------------------------------------------------
    @property
    def theta(self) -> Tensors:
        return self._theta

    def params_hash(self) -> str:
        """The hash of θ (cached until θ changes; consistent with concurrent updates)."""
        with self.lock:
            if self._hash is None:
                self._hash = params_hash(self._theta)
            return self._hash

    def state_digest(self) -> str:
        """The digest of the shared state and the standing table (peer/checkpoints/files.py
        ``state_digest``), cached like ``params_hash``: peers report it with θ's hash, so a served
        state's table and momentum are checked as θ is."""
        with self.lock:
            if self._digest is None:
                self._digest = state_digest(self.strategy.shared_state(), self.standing, self.eligibility, self.evidence)
            return self._digest

    def hashes(self) -> Tuple[str, str]:
        """(``params_hash``, ``state_digest``) of one moment."""
        with self.lock:
            return self.params_hash(), self.state_digest()

    def reported(self, waits: bool = True) -> Tuple[int, str, str]:
        """(round, ``params_hash``, ``state_digest``) of one moment: what a progress record reports.
        ``waits`` False (a training peer's record: its inner steps must not wait while the exchange
        holds θ): where the lock is held elsewhere, the last one reported if it is of this round, else
        no hash (tests/outer/test_round_engine.py)."""
        if self.lock.acquire(blocking=waits):
            try:
                self._reported = (self.round, self.params_hash(), self.state_digest())
            finally:
                self.lock.release()
            return self._reported
        last = self._reported  # still θ's only while θ's hash is cached (a change clears it)
        return last if last[0] == self.round and last[1] == self._hash else (self.round, "", "")

    def install(self, theta: Tensors, round_no: int, shared: Optional[Mapping[str, torch.Tensor]] = None,
                forget_local: bool = False, standing: Optional[Mapping[str, int]] = None,
                eligibility: Optional[Mapping[str, int]] = None,
                evidence: Optional[Mapping[str, standing.Evidence]] = None) -> None:
        """Take a state from elsewhere (a checkpoint, a groupmate): θ, its round and, if given, the
        strategy's shared state, the lineage's standing, evidence and eligibility tables (checked by the caller:
        protocol/round/standing.py, eligibility.py); ``forget_local``: zero the strategy's local buffers too. Raises
        ValueError (nothing changed) if the shared state does not fit."""
        with self.lock:
            if shared is not None:
                self.strategy.load_shared_state(shared)
            if forget_local:
                self.strategy.forget_local_state()
                self._own, self._owed = None, []  # buffers of a lineage left: nothing of them to recount
            if standing is not None:
                self.standing = dict(standing)
                # taken with the standing table only (the two move together); none: a state from before evidence
                self.evidence = dict(evidence or {})
            if eligibility is not None:
                self.eligibility = dict(eligibility)
            self._theta, self.round, self._hash, self._digest = theta, round_no, None, None

    def shareable(self) -> Tuple[Dict[str, object], List[torch.Tensor]]:
        """(metadata, tensors) of what every replica holds identically: θ and the shared state."""
        with self.lock:
            shared = self.strategy.shared_state()
            meta = {"round": self.round, "names": list(self._theta), "shared": sorted(shared),
                    "standing": dict(self.standing), **({"eligibility": dict(self.eligibility)} if self.eligibility else {}),
                    **({"evidence": {s: list(e) for s, e in self.evidence.items()}} if self.evidence else {})}
            tensors = [t.clone() for t in self._theta.values()] + [shared[k].clone() for k in sorted(shared)]
        return meta, tensors

    # ---- a round ------------------------------------------------------------------------------
    def encode(self, round_start: Mapping[str, torch.Tensor], trained: Mapping[str, torch.Tensor],
               steps: Optional[int] = None) -> Tuple[bytes, Pending]:
        """The payload of this round from the parameters it started from and those it trained, in
        ``steps`` inner steps (None: H; fewer where the round closed early)."""
        delta = pseudo_gradient(dict(round_start), trained, self.strategy.layout)
        data, pending = self.strategy.encode(delta, self.round, steps=steps)
        with self.lock:  # (encode and redo both run on the exchange's thread, one after the other)
            self._open = pending
        return data, pending

    def choose(self, payloads: Mapping[str, bytes], round_no: int, base: str, standing: Optional[Mapping[str, int]] = None,
               table: Optional[Mapping[str, int]] = None) -> Tuple[Dict[str, bytes], Dict[str, str], List[str]]:
        """(the payloads that enter θ, the senders whose payload claims no part of this run with why,
        the senders passed over): ``draw`` over the parts the payloads' headers claim. Every payload
        when the round takes every contribution (tests/outer/test_choice_engine.py)."""
        if getattr(self.strategy, "max_contributions", 0) <= 0:  # every payload: no header read
            return dict(payloads), {}, []
        limit = self.strategy.max_payload_bytes
        chosen, invalid, passed = self.draw({s: claimed_part(p, limit) for s, p in payloads.items()}, round_no, base,
                                            standing, table)
        return {s: payloads[s] for s in chosen}, invalid, passed

    def draw(self, parts: Mapping[str, Optional[Part]], round_no: int, base: str, standing: Optional[Mapping[str, int]] = None,
             table: Optional[Mapping[str, int]] = None) -> Tuple[List[str], Dict[str, str], List[str]]:
        """(the senders whose contributions enter θ, those whose payload claims no part of this run
        with why, those passed over), from each sender's claimed part alone (``parts``: what a set's
        list names, protocol/round/set_manifests.py, so a peer draws before it fetches): at most
        ``outer.max_contributions`` per part, drawn by protocol/round/choice.py with the seed of round
        ``round_no`` from ``base``, the hash of the θ it starts from, from the senders the eligibility
        table let send (protocol/round/eligibility.py: a payload in the union from a member that was
        not to send, a lone peer's own set or a set made up by anyone, is passed over, alike on every
        member). Every sender when the round takes every contribution; the rest of a payload's header
        is checked when it is decoded. ``standing``, ``table``: the tables as of that round (a round
        concluded again: ``snapshot``'s), else the current ones."""
        k = getattr(self.strategy, "max_contributions", 0)
        if k <= 0:
            return sorted(parts), {}, []
        valid: Dict[str, Part] = {}
        invalid: Dict[str, str] = {}
        for sender in canonical_order(parts):
            part = parts[sender]
            if part is None or self.strategy.layout_of(part) is None:
                invalid[sender] = f"invalid payload: its header claims no part of this run ({part!r:.40})"
            else:
                valid[sender] = part
        seed = f"{base}:{round_no}"
        with self.lock:
            standing = dict(self.standing) if standing is None else standing
            table = dict(self.eligibility) if table is None else table
            sent = {s: part for s, part in valid.items()
                    if eligibility.eligible(seed, s, eligibility.probability(table, part), choice.weight(standing.get(s, 0)))}
            self._candidates = {r: c for r, c in self._candidates.items() if r >= self.round - 1}
            # what concluding this round moves the eligibility table by: each part's candidates, and their weight now
            by_part: Dict[str, List[Tuple[str, int]]] = {}
            for s, part in sent.items():
                by_part.setdefault(eligibility.part_key(part), []).append((s, choice.weight(standing.get(s, 0))))
            self._candidates[round_no] = by_part
        chosen = choice.choose(sent, k, seed, standing)
        picked = set(chosen)
        return chosen, invalid, [s for s in valid if s not in picked]

    def senders(self, parts: Mapping[str, Optional[Part]], round_no: int, base: str) -> Set[str]:
        """Of ``parts`` (sender -> the part it announced), those this lineage's eligibility table lets
        send in round ``round_no`` from θ ``base`` (protocol/round/eligibility.py): the payloads a
        round of at most K gathers; every sender where rounds take every contribution."""
        if getattr(self.strategy, "max_contributions", 0) <= 0:
            return set(parts)
        with self.lock:
            return eligibility.contributors(parts, f"{base}:{round_no}", self.eligibility, self.standing)

    def may_send(self, round_no: int, base: str) -> Optional[Callable[[str, int, str], bool]]:
        """Whether a peer (its name, and its progress record's ``part`` and ``sends``) may send in round
        ``round_no`` from θ ``base``, by this lineage's tables as they stand now: the peers whose
        payloads the round's draw can take (protocol/round/eligibility.py ``may_send``). None where
        rounds take every contribution: everyone may."""
        if getattr(self.strategy, "max_contributions", 0) <= 0:
            return None
        with self.lock:
            table, ranks = dict(self.eligibility), dict(self.standing)
        seed = f"{base}:{round_no}"
        return lambda peer, part, sends: eligibility.may_send(seed, table, ranks, peer, part, sends)

    def decode(self, payloads: Mapping[str, bytes]) -> Tuple[List[Tensors], Dict[str, str]]:
        """Every payload decoded in the canonical order, and the senders whose payload is invalid."""
        return self.decode_at(payloads, self.round)

    def decode_at(self, payloads: Mapping[str, bytes], round_no: int) -> Tuple[List[Tensors], Dict[str, str]]:
        """``decode`` for the payloads of round ``round_no`` (a round concluded again: peer/round/union.py)."""
        decoded = Contributions(senders=[], kinds=[], steps=[])
        invalid: Dict[str, str] = {}
        spec = self.strategy.spec
        floor = min_steps(spec.outer.inner_steps, spec.outer.min_inner_fraction)
        for sender in canonical_order(payloads):
            try:
                part, steps, tensors = self.strategy.decode_claimed(payloads[sender], round_no)
            except ProtocolError as e:
                invalid[sender] = f"invalid payload: {e}"
                continue
            decoded.append(tensors)
            decoded.senders.append(sender)
            decoded.kinds.append(self.strategy.kind_of(part))
            # below the early close's floor no honest round ends: a claim there counts as the floor, so a
            # liar's entry scales the others' clip by H / floor at most (peer/outer/robust.py ``medians_at_steps``)
            decoded.steps.append(max(steps, floor))
        return decoded, invalid

    def conclude(self, decoded: Sequence[Tensors], pending: Optional[Pending], delivered: bool,
                 excluded: Optional[Mapping[str, str]] = None, me: Optional[str] = None,
                 passed: Sequence[str] = ()) -> Settled:
        """Check and clip ``decoded`` (in canonical order), aggregate, apply the outer step, settle,
        next round. A contribution refused on the way is listed in ``excluded`` (by sender when
        ``decoded`` came from ``decode``); ours (sender ``me``) refused so, or ``passed`` over by
        ``choose``, settles as undelivered: what we sent goes back into our buffers
        (tests/outer/test_round_engine.py)."""
        with self.lock:
            outcome = robust_step(self.strategy, self._theta, decoded, self.round, standing=self.standing,
                                  evidence=self.evidence)
            delivered = delivered and (me is None or (me not in outcome.excluded and me not in passed))
            # a contribution that had a copy counts once, and earns none of its senders standing; nor
            # does one with tensors left out for pointing against the others', or one whose agreement
            # was too weak to count on its own (standing.advance)
            self.standing = standing.advance(
                self.standing, [s for s in sender_names(decoded) if s not in outcome.excluded and s not in outcome.copied
                                and s not in outcome.dropped], outcome.excluded,
                outcome.scores, getattr(self.strategy, "min_agreement", 0.0))
            self.evidence = standing.gather(self.evidence, outcome.scores, outcome.excluded, outcome.copied, self.standing,
                                            outcome.unconvinced)
            drawn = self._candidates.pop(self.round, None)
            if drawn is not None:  # the round's draw saw these candidates (K > 0): every member alike
                weighed = {key: [(w, choice.weight(self.standing.get(s, 0))) for s, w in cands] for key, cands in drawn.items()}
                self.eligibility = eligibility.update(self.eligibility, weighed, getattr(self.strategy, "max_contributions", 0))
            if pending is not None:
                self._settle(pending, delivered, ours=self.round)
            settled = Settled(self.round, outcome.contributors, {**(excluded or {}), **outcome.excluded}, delivered,
                              outcome.clipped, outcome.scores, sorted(passed), outcome.copies, outcome.weighed,
                              outcome.dropped, self._short(decoded))
            self.round += 1
            self._hash = self._digest = None
        return settled

    def _short(self, decoded: Sequence[Tensors]) -> Dict[str, int]:
        """Sender -> the inner steps its payload covered, for those of fewer than H (a round closed early)."""
        steps, H = steps_of(decoded), self.strategy.spec.outer.inner_steps
        return {} if steps is None else {s: n for s, n in zip(sender_names(decoded), steps) if n < H}

    def snapshot(self) -> Snapshot:
        """The round, θ, the strategy's shared state and the standing, eligibility and evidence
        tables, copied: what concluding this round again starts from."""
        with self.lock:
            theta = {n: t.clone() for n, t in self._theta.items()}
            shared = {k: v.clone() for k, v in self.strategy.shared_state().items()}
            return Snapshot(self.round, theta, shared, dict(self.standing), dict(self.eligibility), dict(self.evidence))

    def redo(self, snapshot: Snapshot, decoded: Sequence[Tensors], excluded: Optional[Mapping[str, str]] = None,
             me: Optional[str] = None, own: Optional[bytes] = None) -> Settled:
        """Conclude the round of ``snapshot`` again, from its θ and shared state, with ``decoded``:
        the same arithmetic as ``conclude``, so the same bits as a member that concluded it with
        these payloads the first time. Where our payload (``own``, sent as ``me``) counts now and did
        not then, or the other way round, the local buffers give it up or take it back (its tensors as
        receivers decode them), so it enters θ once. Raises as ``conclude`` does, with θ, the round,
        the tables and the buffers as they were (tests/outer/test_redo.py)."""
        round_no = snapshot.round
        with self.lock:
            # θ is not copied: install swaps the dict, so the conclusion below steps on the snapshot's clone
            now = Snapshot(self.round, self._theta, {k: v.clone() for k, v in self.strategy.shared_state().items()},
                           dict(self.standing), dict(self.eligibility), dict(self.evidence))
            candidates = dict(self._candidates)
            try:
                self._install_snapshot(snapshot._replace(theta={n: t.clone() for n, t in snapshot.theta.items()}))
                settled = self.conclude(decoded, None, delivered=False, excluded=excluded)
            except BaseException:
                self._install_snapshot(now)
                self._candidates = candidates
                raise
            settled.delivered = me is not None and me in sender_names(decoded) and me not in settled.excluded
            if self._own is not None and self._own[0] == round_no and self._own[1] != settled.delivered and own is not None:
                self._recount(own, round_no, settled.delivered)
            return settled

    def _install_snapshot(self, snap: Snapshot) -> None:
        self.install(snap.theta, snap.round, snap.shared, standing=snap.standing, eligibility=snap.eligibility,
                     evidence=snap.evidence)

    def _recount(self, own: bytes, round_no: int, counted: bool) -> None:
        """Our payload of ``round_no`` counts now (``counted``) or no longer: its tensors leave or
        re-enter the local buffers, at once, or once the round encoded since settles (a settle
        rewrites the buffers from what that round's encode read), decayed once per encode since
        (``_since``; tests/outer/test_redo.py)."""
        try:
            _, sent = self.strategy.decode_part(own, round_no)
        except ProtocolError:
            return  # not ours to recount: it never decoded, so it never counted
        sign = -1 if counted else 1
        if self._open is not None:
            self._owed.append((sent, sign))
        else:
            self.strategy.recount(sent, sign, since=self._since)
        self._own = (round_no, counted)

    def _settle(self, pending: Pending, delivered: bool, ours: Optional[int] = None) -> None:
        """Settle ``pending``; where it is the payload encoded last, the corrections ``redo`` left for it.
        ``ours``: the round it was our payload of (concluded, not deferred): a later redo recounts from it."""
        self.strategy.settle(pending, delivered=delivered)
        self._since += 1
        if pending is self._open:
            self._open = None
            for sent, sign in self._owed:
                self.strategy.recount(sent, sign, since=self._since)
            self._owed = []
        if ours is not None:
            self._own, self._since = (ours, delivered), 0

    def settle_round(self, payloads: Mapping[str, bytes], pending: Optional[Pending], me: str,
                     excluded: Optional[Mapping[str, str]] = None) -> Settled:
        """``choose``, ``decode`` then ``conclude``: the whole round from the agreed payloads (own included)."""
        chosen, bad, passed = self.choose(payloads, self.round, self.params_hash())
        decoded, invalid = self.decode(chosen)
        excluded = {**(excluded or {}), **bad, **invalid}
        return self.conclude(decoded, pending, delivered=me in payloads and me not in excluded, excluded=excluded, me=me,
                             passed=passed)

    def follow(self, leader: "RoundEngine", settled: Settled, pending: Optional[Pending], me: str) -> None:
        """Take the outcome of a round that ``leader`` concluded (``settled``) from the same θ with the
        same payloads, as ``conclude`` would compute it here, and settle our own buffers as it counted
        ``me``: the in-process simulation's shortcut once its first rounds checked every replica
        concluding alike (peer/round/simulate.py)."""
        with self.lock, leader.lock:
            if leader.round != self.round + 1:
                raise ValueError(f"the leader concluded round {leader.round - 1}, this engine is at round {self.round}")
            if pending is not None:
                self._settle(pending, me not in settled.excluded and me not in settled.passed, ours=self.round)
            self.strategy.load_shared_state(leader.strategy.shared_state())
            self._theta = {n: t.clone() for n, t in leader.theta.items()}
            self.standing, self.round, self._hash, self._digest = dict(leader.standing), leader.round, leader._hash, None
            self.eligibility, self.evidence = dict(leader.eligibility), dict(leader.evidence)

    def defer(self, pending: Pending) -> None:
        """The round found no group: keep all of this round's signal in the local buffers."""
        with self.lock:
            self._settle(pending, False)
