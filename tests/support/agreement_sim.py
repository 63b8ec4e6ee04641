"""A group's agreement (protocol/round/reconcile.py) without the network, for unit tests.

``run_group`` plays the exchange's loop (peer/exchange/gatherer.py ``_agree``) in lock-step rounds for
every honest member: round 1 fetches each owner's envelope from the owner, each later round asks
every other member for what it lacks and fetches the bytes of new values from a member that
offered them. Members are ``Member`` objects; a hostile one overrides what it sends to whom.
Keys are made once per test session (an RSA key takes about 0.1 s).
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from protocol.errors import ProtocolError
from protocol.round.reconcile import Agreement, Outcome, Value, parse_request
from protocol.wire.signed import Binding, Signer

MAX_PAYLOAD = 1 << 16
RUN = b"run-digest"


@functools.lru_cache(maxsize=None)
def signer(i: int) -> Signer:
    return Signer.generate()


def binding_of(members: Sequence[bytes], round_no: int = 7, group_id: bytes = b"group-1", run: bytes = RUN) -> Binding:
    return Binding(run, round_no, group_id, tuple(members))


class Member:
    """An honest member: it sends what the protocol says to everyone."""

    def __init__(self, key: Signer, binding: Binding, payload: bytes, senders=None):
        """``senders``: the members that send a payload this round (None: all); a member outside
        them seals nothing."""
        self.key, self.id = key, key.peer_id
        self.agreement = Agreement(binding, key, MAX_PAYLOAD, senders)
        self.envelope = self.agreement.seal(payload) if self.id in self.agreement.senders else None

    def envelope_for(self, asker: bytes) -> Optional[bytes]:
        return self.envelope

    def answer_for(self, asker: bytes, request: bytes, round_no: int) -> Optional[bytes]:
        _, have = parse_request(request, len(self.agreement.members))
        return self.agreement.answer(have)

    def serve_for(self, asker: bytes, owner: bytes, digest: bytes) -> Optional[bytes]:
        return self.agreement.serve(owner, digest)


def run_group(members: Sequence[Member], honest: Sequence[Member], log: Optional[List[Tuple]] = None,
              cut: Optional[Callable[[bytes, bytes, int], bool]] = None,
              stopped: Optional[Set[Tuple[bytes, bytes]]] = None) -> Dict[bytes, Outcome]:
    """Every honest member's outcome; ``log`` collects (asker, server, owner) of every byte fetch.
    ``cut(h, m, k)``: whether honest member ``h`` stops asking member ``m`` from round ``k`` on, as
    peer/exchange/agreement_rounds.py does, which it may only while ``Agreement.may_stop_asking``;
    ``stopped`` collects the pairs (h, m) so cut."""
    log = log if log is not None else []
    stopped = stopped if stopped is not None else set()
    everyone = {m.id: m for m in members}
    for h in honest:
        for m in members:
            if m is h:
                continue
            envelope = m.envelope_for(h.id)
            if envelope is not None:
                try:
                    h.agreement.take_envelope(m.id, envelope)
                except ProtocolError:
                    pass
    rounds = honest[0].agreement.rounds
    for k in range(2, rounds + 1):
        # every answer of round k is made before anyone accepts anything in round k: lock-step
        answers: Dict[Tuple[bytes, bytes], Optional[bytes]] = {}
        for h in honest:
            request = h.agreement.request(k)
            for m in members:
                if m is not h:
                    answers[(h.id, m.id)] = m.answer_for(h.id, request, k)
        for h in honest:
            if cut is not None and h.agreement.may_stop_asking():
                stopped.update((h.id, m.id) for m in members if m is not h and cut(h.id, m.id, k))
            offered: Dict[Tuple[bytes, bytes], Tuple[Value, List[bytes]]] = {}
            for m in members:
                answer = None if (h.id, m.id) in stopped else answers.get((h.id, m.id))
                if answer is None:
                    continue
                try:
                    for value in h.agreement.offers(answer, k):
                        offered.setdefault(value.key, (value, []))[1].append(m.id)
                except ProtocolError:
                    continue
            for value, servers in offered.values():
                if h.agreement.holds(value.owner) >= 2:
                    continue
                if not h.agreement.needs_bytes(value):
                    h.agreement.accept(value)
                    continue
                for server in servers:
                    log.append((h.id, server, value.owner))
                    try:
                        if h.agreement.accept(value, everyone[server].serve_for(h.id, value.owner, value.digest)):
                            break
                    except ProtocolError:
                        pass
    return {h.id: h.agreement.outcome() for h in honest}


def agreed(outcomes: Dict[bytes, Outcome]) -> Outcome:
    """The one outcome every honest member reached; AssertionError if two differ."""
    first = next(iter(outcomes.values()))
    for outcome in outcomes.values():
        assert outcome.payloads == first.payloads, "honest members kept different payloads"
        assert set(outcome.excluded) == set(first.excluded), "honest members excluded different owners"
    return first


def owners(outcome: Outcome) -> Set[bytes]:
    return set(outcome.payloads)
