"""The asking side of a group's agreement (protocol/round/reconcile.py): each member's own payload fetched
from it (round 1), then rounds 2..R, in which every member asks every other member for the signed
values it lacks (``rpc_relay``) and fetches the bytes of a new value from a member that offered it.

A mixin of peer/exchange/gatherer.py's ``PayloadGatherer``, run in the averager process; the serving
side (``rpc_fetch_payload``, ``rpc_relay``) and the bounds on what a member is served stay there. Each
round has a deadline counted from the group's start; round 1 cuts a sender that sent nothing a grace
after the others' payloads (peer/exchange/side_by_side.py). A later round waits for a member we know
(seen to come, or with standing) to its deadline: an honest member answers round k only once its own
round k - 1 is over, which may run to that round's deadline for a sender streaming to it alone, and a
member cut earlier could then decide apart from us (an equivocator that streams its second payload
slowly to that member alone: bench/RESULTS.md). A stranger (``cuttable``; in a run's first round,
every member) is no longer waited for a grace after the members we know have answered, where we can
lose nothing by it (protocol/round/reconcile.py ``Agreement.may_stop_asking``: only the stranger can
then decide apart from us); it gets no strike for it, since an honest newcomer on a slow link answers
only once its own first round, fetching every payload, is over, but what it cost is charged to the
strangers' budget (``Group.lagged``, peer/round/no_show_views.py ``came_in``). A new identity that served its payload to one member and held that member's round-2
request used to keep that member's whole exchange to the deadline (bench/RESULTS.md, "A stranger that
holds a later agreement round"). Guarded by tests/exchange/test_exchange_bounds.py,
tests/exchange/test_side_by_side.py and tests/system/test_hostile_consensus.py.
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Callable, Dict, FrozenSet, List, Optional, Tuple

from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import get_logger

from peer.exchange.bounds import read_bounded_stream, refused, retry_until
from peer.exchange.groups import Group
from peer.exchange.results import base58
from peer.exchange.side_by_side import Unanswered, ask_each
from protocol.round import reconcile
from protocol.wire.signed import ENVELOPE_OVERHEAD

logger = get_logger(__name__)

CHUNK_BYTES = 1 << 18  # an envelope is streamed in chunks of this size
CANDIDATES_PER_OWNER = 4  # new values of one owner whose bytes one round tries to fetch


def cuttable(members: FrozenSet[str], known: Optional[FrozenSet[str]]) -> FrozenSet[str]:
    """The other members (base58) that later agreement rounds may stop waiting for a grace after the
    others' answers: those outside ``known`` (no strangers to us; in a run's first round, every member);
    with ``known`` None, none
    (tests/exchange/test_side_by_side.py::test_only_strangers_may_be_cut_in_later_rounds)."""
    return members - known if known is not None else frozenset()


def unasked(sending: List[PeerID], others: List[PeerID], mute: set) -> set:
    """The senders the agreement's later rounds do not ask: the only other sender, when it sent not a
    byte of its payload by round 1's deadline and other members are there to relay whatever it sent
    them. With no others' payloads there is no grace to cut it from (protocol/round/fetch_clock.py),
    and asking it again cost every later round's wait too: a peer named by two groups held one such
    group 45 s at 32 peers (bench/RESULTS.md, 2026-12-01). It is not thereby ``held``: no strike, no
    matchmaking refusal (tests/exchange/test_side_by_side.py::test_only_a_sole_mute_sender_is_left_unasked)."""
    return set(mute) if len(sending) == 1 and len(others) > 1 else set()


class AgreementRounds:
    """``PayloadGatherer``'s calls to the other members of a group (see the module docstring)."""

    async def _agree(self, group: Group, others: List[PeerID], patient: FrozenSet[str] = frozenset(),
                     strangers: FrozenSet[str] = frozenset()) -> None:
        """Rounds 1..R of the agreement; round k ends at most k deadlines after the group formed (round 1
        a grace after the others' payloads: side_by_side.py). ``patient`` (base58): never cut. ``strangers``
        (base58): the members that later rounds may cut (see the module docstring)."""
        agreement, gid = group.agreement, group.group_id
        t0, slot = asyncio.get_running_loop().time(), self.gather_timeout
        sending = [p for p in others if p.to_bytes() in agreement.senders]
        mute: set = set()
        got = await ask_each(
            lambda p, deadline, began: retry_until(deadline, partial(self._fetch, p, gid, p.to_bytes(), b"", deadline, began)),
            sending, t0 + slot, self.timing.answer_grace, [p for p in sending if p.to_base58() in patient], group.held,
            "payload", self._round_no, self.waiting_for_silent, mute=mute)
        for peer, envelope in got.items():
            try:
                if isinstance(envelope, BaseException):
                    raise envelope
                agreement.take_envelope(peer.to_bytes(), envelope)
            except Exception as e:
                logger.info(f"round {self._round_no}: no valid payload from {peer} itself: {e!r}")
        group.done[1].set()
        # one that held its payload would hold its answers too
        skipped = group.held | unasked(sending, others, mute)
        live = [p for p in others if p not in skipped]
        for k in range(2, agreement.rounds + 1):
            start = t0 + (k - 1) * slot
            request = agreement.request(k)
            deadline = start + slot / 2
            # a stranger that holds this request can then set only itself apart from us (may_stop_asking): it is
            # no longer waited for a grace after the others' answers; no strike (an honest newcomer on a slow
            # link answers only once its own round 1, fetching every payload, is over), only a charge (lagged)
            # (otherwise every member is awaited, and so none is cut)
            awaited = [p for p in live if p.to_base58() not in strangers] if agreement.may_stop_asking() else live
            got = await ask_each(
                lambda p, deadline, began, request=request: retry_until(deadline, partial(self._relay, p, gid, request, deadline)),
                live, deadline, self.timing.answer_grace, [p for p in live if p.to_base58() in patient], group.lagged,
                f"agreement round {k} answer", self._round_no, awaited=awaited)
            offered: Dict[bytes, Dict[bytes, Tuple[reconcile.Value, List[PeerID]]]] = {}
            still = []
            for peer in live:
                answer = got[peer]
                try:
                    if isinstance(answer, BaseException):
                        raise answer
                    for value in agreement.offers(answer, k):
                        offered.setdefault(value.owner, {}).setdefault(value.digest, (value, []))[1].append(peer)
                    still.append(peer)
                except Exception as e:  # late, gone or malformed: not asked again in this group
                    logger.info(f"round {self._round_no}: agreement round {k}: stop asking {peer}: {e!r}")
                    if isinstance(e, asyncio.TimeoutError) and not isinstance(e, Unanswered):
                        group.held.add(peer)  # held it to the deadline: its merge answer may be held too
            live = still
            await asyncio.gather(*(self._take(agreement, gid, list(c.values()), start + slot) for c in offered.values()))
            group.done[k].set()

    async def _take(self, agreement: reconcile.Agreement, gid: bytes, candidates, deadline: float) -> None:
        """Accept an owner's new values, their bytes fetched from every member that offered them at
        once (a stalling member must not hold up an honest one); the first that verifies counts."""
        for value, holders in candidates[:CANDIDATES_PER_OWNER]:
            if agreement.holds(value.owner) >= 2:
                return
            if not agreement.needs_bytes(value):
                agreement.accept(value)
                continue
            fetches = [
                asyncio.ensure_future(retry_until(deadline, partial(self._fetch, h, gid, value.owner, value.digest, deadline)))
                for h in holders
            ]
            try:
                for fetched in asyncio.as_completed(fetches):
                    try:
                        agreement.accept(value, await fetched)
                        break
                    except Exception as e:
                        logger.debug(f"bytes of {base58(value.owner)}'s offered payload: {e!r}")
            finally:
                for fetch in fetches:
                    fetch.cancel()

    async def _fetch(self, peer: PeerID, group_id: bytes, owner: bytes, digest: bytes, deadline: float,
                     began: Optional[Callable[[], None]] = None) -> bytes:
        """An envelope (``owner``'s own when ``digest`` is empty) from ``peer``, by ``deadline``;
        ``began()`` is called when its first bytes arrive."""
        request = averaging_pb2.AveragingData(group_id=group_id, peer_id=owner, tensor_part=runtime_pb2.Tensor(buffer=digest))
        self._count(sent=request.ByteSize())
        handle = type(self)._get_handle_name(self.prefix, "rpc_fetch_payload")  # the class serves it under its name
        envelope, wire = await asyncio.wait_for(
            read_bounded_stream(
                self._p2p, peer, handle, request, limit=self._max_payload_bytes + ENVELOPE_OVERHEAD, chunk=CHUNK_BYTES,
                began=began,
            ),
            timeout=max(0.0, deadline - asyncio.get_running_loop().time()),
        )
        self._count(received=wire)
        return envelope

    async def _relay(self, peer: PeerID, group_id: bytes, request: bytes, deadline: float) -> bytes:
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        message = averaging_pb2.AveragingData(group_id=group_id, tensor_part=runtime_pb2.Tensor(buffer=request))
        self._count(sent=message.ByteSize())
        answer = await asyncio.wait_for(
            stub.rpc_relay(message), timeout=max(0.0, deadline - asyncio.get_running_loop().time())
        )
        self._count(received=answer.ByteSize())
        if answer.code != averaging_pb2.NO_CODE:
            raise refused(peer, answer.code)
        return answer.tensor_part.buffer
