"""All-gather of signed payloads in groups formed by hivemind's matchmaking.

hivemind's DecentralizedAverager finds groups (DHT-declared keys, leader election, timeouts) and
then runs a butterfly all-reduce whose results differ in the last bits from member to member.
Replicas that must stay bit-identical need every member to compute from the same bytes, so this
subclass keeps the matchmaking and replaces the all-reduce with an all-gather that any member may
try to subvert:

1. every member signs its payload for (run, round, group, itself) with its libp2p identity key
   (protocol/wire/signed.py) and pulls every other member's envelope from that member
   (``rpc_fetch_payload``, streamed in chunks, read with a size limit);
2. rounds 2..R of protocol/round/reconcile.py's agreement: every member asks every other member for the
   signed values it lacks (``rpc_relay``) and fetches the bytes of a new value from a member that
   offered it. Each round has a deadline, counted from the group's start, so a silent or slow
   member delays a round by at most that; a member that fails one round is not asked again (the
   asking side of both: peer/exchange/agreement_rounds.py; the serving side is here).

Every decision (what verifies, what is accepted, who is excluded) is protocol/round/reconcile.py's; this
class moves bytes and enforces the bounds: only members of a group get anything from the gather
RPCs for that group, groups exist only for the rounds this peer takes part in (an RPC naming an
unknown group waits a little for it, then gets nothing), one remote peer runs at most
``CALLS_PER_PEER`` calls here at once, and nothing read from a peer exceeds the payload limit plus
the envelope's overhead.

The matchmaking key carries the round number, so only peers of the same round ever meet.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import multiprocessing as mp
import os
import tempfile
from collections import OrderedDict
from typing import AsyncIterator, Callable, Iterable, Optional, Sequence, Tuple

import msgpack
from hivemind.averaging.averager import AveragingMode, DecentralizedAverager
from hivemind.averaging.group_info import GroupInfo
from hivemind.dht import DHT
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MPFuture, get_dht_time, get_logger

from peer.exchange.agreement_rounds import CHUNK_BYTES, AgreementRounds, cuttable
from swarm.call_limits import CallLimiter
from peer.exchange.groups import Group
from peer.exchange.identity import payload_signer
from peer.exchange.late_join import LateJoin
from peer.exchange.matchmaking import as_peer_ids, count_seats, describe_search, read_gathered, refuse_peers, senders_of, step_outcome
from peer.exchange.results import GatherResult, base58
from peer.exchange.ready_notices import ReadyNotices
from peer.exchange.set_lists import ListServer
from peer.exchange.set_server import SetServer
from peer.exchange.state_serving import StateServing
from protocol.round import group_sets, reconcile
from protocol.errors import ProtocolError
from protocol.wire.payload import Part
from protocol.wire.signed import Binding, Signer
from protocol.round.timing import Timing
from swarm.access.admission import Admitted
from swarm.dht.group_keys import LeanGroupKeyManager
from swarm.future_pipes import send_futures_lean

logger = get_logger(__name__)

ROUND_BITS = 20  # the round number, mod 2**20, is the matchmaking bucket
KEEP_GROUPS = 8  # recent groups of ours whose payloads we keep serving to slower members
CALLS_PER_PEER = 8  # gather RPCs one remote peer may have running here at once
# sets, lists and envelopes served to all peers at once: a stream whose reader stops holds a chunk of its
# answer (the packed set itself is shared), so new identities opening CALLS_PER_PEER streams each hold at
# most this many chunks (64 MiB), whatever their number
SERVING_AT_ONCE = 256
DEFAULT_MAX_PAYLOAD_BYTES = 16 << 20  # for tools without a spec; a peer passes its strategy's bound


class PayloadGatherer(Admitted, AgreementRounds, LateJoin, SetServer, ListServer, ReadyNotices, StateServing, DecentralizedAverager):  # Admitted: a private run's gate (swarm/access/admission.py)
    """hivemind matchmaking + a signed, agreed all-gather of one payload per member."""

    _round_no = -1  # the round being gathered, set as each round's matchmaking is prepared
    _known: Optional[frozenset] = None  # the peers (base58) no strangers to us this round (``gather``); None: unknown
    _senders = False  # a round of at most K a part: only members announcing a part send (matchmaking.senders_of)
    timing = Timing()  # every wait of the exchange; __init__ sets the run's (protocol/round/timing.py)

    def __init__(
        self,
        dht: DHT,
        *,
        prefix: str,
        schema: bytes,
        signer: Optional[Signer] = None,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        min_group_size: int = 2,
        max_group_size: int = 16,
        matchmaking_time: float = 3.0,
        gather_timeout: float = 30.0,
        request_timeout: float = 1.0,
        timing: Optional[Timing] = None,
    ):
        # every wait of the exchange (protocol/round/timing.py); the spec's matchmaking and gather times win
        self.timing = (timing or Timing()).with_(matchmaking_s=matchmaking_time, gather_slot_s=gather_timeout)
        self.gather_timeout = gather_timeout
        self.matchmaking_wait = matchmaking_time  # as stretched for the last round on this host (peer/round/merge.py)
        self._bytes_sent = mp.Value(ctypes.c_int64, 0)
        self._bytes_received = mp.Value(ctypes.c_int64, 0)
        # set while a group's first agreement round waits for members that sent nothing alone (side_by_side.py)
        self.waiting_for_silent = mp.Event()
        super().__init__(
            averaged_tensors=(),
            dht=dht,
            start=False,
            prefix=prefix,
            target_group_size=max_group_size,
            min_group_size=min_group_size,
            min_matchmaking_time=matchmaking_time,
            request_timeout=request_timeout,
            # every agreement round has its own deadline of gather_timeout: this only catches a bug
            allreduce_timeout=gather_timeout * (reconcile.agreement_rounds(max_group_size) + 2),
            next_chunk_timeout=gather_timeout,
        )
        signer = signer if signer is not None else payload_signer(dht)
        if signer.peer_id != self.peer_id.to_bytes():
            raise ValueError("the signing key is not this peer's libp2p identity")
        # peers of different runs or specs never match: the schema is the spec digest
        self.schema_hash = hashlib.sha256(schema).digest()
        self._run = bytes(schema)
        self._signer = signer
        self._max_payload_bytes = max_payload_bytes
        self._max_group_size = max_group_size
        self._groups: "OrderedDict[bytes, Group]" = OrderedDict()
        self._fetched: "OrderedDict[bytes, bytes]" = OrderedDict()  # sets fetched from other groups, checked (set_server.py)
        self._unchecked_sets: OrderedDict = OrderedDict()  # (set, source) -> a set fetched, until the host checked it
        self._merged: "OrderedDict[bytes, Tuple[frozenset, bytes]]" = OrderedDict()  # set -> (members, what we merged)
        self._fetched_lists: "OrderedDict[bytes, bytes]" = OrderedDict()  # sets' lists fetched (set_lists.py)
        self._opened_lists: OrderedDict = OrderedDict()  # the same lists as checked: set -> SetManifest
        self._fetched_members: "OrderedDict[Tuple[bytes, bytes], bytes]" = OrderedDict()  # (set, owner) -> envelope
        self._packed_lists: "OrderedDict[bytes, bytes]" = OrderedDict()  # lists of the sets we hold whole
        self._served_members: "OrderedDict[Tuple[bytes, bytes], bytes]" = OrderedDict()  # their envelopes, once made
        self._group_opened: Optional[asyncio.Event] = None
        self._calls = CallLimiter(CALLS_PER_PEER)
        self._stream_calls = CallLimiter(CALLS_PER_PEER, total=SERVING_AT_ONCE)  # set_server.py's streams
        self._packed_sets: "OrderedDict[bytes, bytes]" = OrderedDict()  # our groups' sets, packed once
        self._init_ready_notices()  # shared with the averager process: made before it starts
        send_futures_lean(self._outer_pipe)  # each caller's result pipe reaches the averager process once

    # ---- host-process API ---------------------------------------------------------------------
    @property
    def bytes_sent(self) -> int:
        return int(self._bytes_sent.value)

    @property
    def bytes_received(self) -> int:
        return int(self._bytes_received.value)

    def gather(
        self, round_no: int, payload: bytes, *, start_hash: str, expected_size: int, timeout: float,
        give_up: Optional[Callable[[], bool]] = None, read_latency: float = 0.0,
        last: Tuple[str, Sequence[str]] = ("", ()), refused: Sequence[str] = (),
        senders: bool = False, part: Optional[Part] = None, ready: Optional[Sequence[str]] = None,
        admitted: Optional[Iterable[str]] = None, leaders: Optional[Iterable[str]] = None,
        known: Optional[Iterable[str]] = None, lineage: str = "",
    ) -> Optional[GatherResult]:
        """Find a group of this round and all-gather payloads. None if no group formed in time, or
        if ``give_up`` (asked every ``Timing.give_up_poll_s`` while matchmaking is still looking) says that
        no group can form any more: every other peer of the round has gathered already.
        ``read_latency``: how long a DHT read takes here now (``Timing.matchmaking``). ``last``: the
        hash of θ before our last round's outer step and the sets it was concluded from, announced
        to the group (peer/round/union.py). ``refused``: peers (base58) this matchmaking shuns (``refuse_peers``).
        ``senders``: a round of at most K a part, where only the members that announce a ``part`` send a
        payload (we do if ``part`` is given: ``matchmaking.senders_of``); else every member sends.
        ``ready``: the peers (base58) the group's target is for, as the round's barrier found them; a
        member outside them that we lead adds a seat (``matchmaking.count_seats``); None: any member fills one.
        ``admitted``: the only peers (base58) this matchmaking accepts and follows, ``leaders`` the only ones it
        follows; None: anyone not refused. ``known``: the peers (base58) that are no strangers to us (seen to come,
        or with standing); a member outside them that holds a later agreement round's request is no longer
        waited for a grace after the answers of the members inside them, where we can lose nothing by it
        (``AgreementRounds._agree``, ``reconcile.Agreement.may_stop_asking``); None: no member is.
        ``lineage``: the start most of the round's peers we know hold, named to the group for its start
        vote (protocol/round/start_vote.py)."""
        sent0, recv0 = self.bytes_sent, self.bytes_received
        future = MPFuture()
        expected = max(1, min(expected_size, self._max_group_size))
        # the control pipe is non-blocking on the averager's side and drops large messages: hand the
        # payload (and the peers we know, up to thousands of names) over through a file in shared memory instead
        fd, path = tempfile.mkstemp(prefix="voloco-payload-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        with os.fdopen(fd, "wb") as f:
            msgpack.pack([payload, None if known is None else sorted(known)], f, use_bin_type=True)
        wait, request = self.timing.matchmaking(read_latency, timeout / 4)
        self.matchmaking_wait = wait  # the merge of this round's sets waits as long for late groups
        self._outer_pipe.send(("_prepare_round", [], dict(round_no=round_no, path=path, expected=expected, future=future,
                                                          senders=senders,
                                                          matchmaking_time=wait, request_timeout=request,
                                                          refused=sorted(refused),
                                                          admitted=None if admitted is None else sorted(admitted),
                                                          leaders=None if leaders is None else sorted(leaders),
                                                          ready=None if ready is None else sorted(ready))))
        try:
            future.result(timeout=self.timing.prepare_s)
        finally:
            if os.path.exists(path):
                os.unlink(path)
        try:
            control = self.step(gather=reconcile.announcement(round_no, start_hash, *last, part=part, lineage=lineage), timeout=timeout,
                                scheduled_time=get_dht_time() + wait, allow_retries=True, wait=False)
            result = step_outcome(control, give_up, self.timing.give_up_poll_s)
        except Exception as e:  # matchmaking or gather failure: the caller defers this round
            logger.debug(f"round {round_no}: no group ({e!r})")
            return None
        if not isinstance(result, GatherResult):
            return None
        result.bytes_sent = self.bytes_sent - sent0
        result.bytes_received = self.bytes_received - recv0
        return result

    # ---- averager-process side: one group's all-gather ----------------------------------------
    async def _prepare_round(self, round_no: int, path: str, expected: int, future: MPFuture,
                             matchmaking_time: float, request_timeout: float, refused: Sequence[str] = (),
                             senders: bool = False, ready: Optional[Sequence[str]] = None,
                             admitted: Optional[Sequence[str]] = None, leaders: Optional[Sequence[str]] = None):
        try:
            if self.client_mode and not getattr(self, "_client_handlers", False):
                # hivemind's client mode registers no handlers; members still pull this peer's payload
                # and relay answers over the connections it opened to them (it only leads no group)
                self._client_handlers = True
                await self.add_p2p_handlers(self._p2p, namespace=self.prefix)
            with open(path, "rb") as f:  # our own process wrote it (``gather``)
                self._payload, known = msgpack.unpackb(f.read(), raw=False)
            self._round_no, self._senders = round_no, senders
            self._known = None if known is None else frozenset(known)
            mm = self._matchmaking
            self._begin_round_search(mm)
            if mm.is_looking_for_group:
                logger.warning(f"round {round_no}: the last round's matchmaking has not ended: {describe_search(mm)}")
            if not isinstance(mm.group_key_manager, LeanGroupKeyManager):  # its DHT calls at a fraction of the bytes
                mm.group_key_manager = LeanGroupKeyManager.replacing(mm.group_key_manager)
            mm.group_key_manager.group_bits = format(round_no % (1 << ROUND_BITS), f"0{ROUND_BITS}b")
            # close the group as soon as the ready peers have joined (and a seat more for each other member: count_seats)
            mm.target_group_size = mm.potential_leaders.target_group_size = expected
            mm.min_matchmaking_time = mm.potential_leaders.min_matchmaking_time = matchmaking_time
            mm.request_timeout = request_timeout
            refuse_peers(mm, frozenset(PeerID.from_base58(p) for p in refused),
                         *(None if names is None else frozenset(as_peer_ids(names)) for names in (admitted, leaders)),
                         leaders_for=matchmaking_time)  # then newcomers left over pair with whoever leads
            if ready is None:  # every member fills a seat
                count_seats(mm, frozenset(), spare=self._max_group_size, largest=self._max_group_size)
            else:  # the target's seats are for the ready peers (and the pair's spare seat while peers still come)
                counted = frozenset(PeerID.from_base58(p) for p in ready)
                count_seats(mm, counted, spare=expected - 1 - len(counted), largest=self._max_group_size)
            future.set_result(None)
        except Exception as e:
            future.set_exception(e)

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs) -> GatherResult:
        gathered = [read_gathered(self.serializer, g) for g in group_info.gathered]  # hivemind's [bandwidth, mode, ours]
        kept, dropped = reconcile.members_of_round([g[2] if g else None for g in gathered], self._round_no)
        me = group_info.peer_ids.index(self.peer_id)
        if me not in kept:  # a matchmaking of ours that outlived its round: the others gather without us
            raise reconcile.GroupError(f"our own matchmaking was for another round: {dropped[me]}")
        for i, why in dropped.items():
            logger.warning(f"round {self._round_no}: left {group_info.peer_ids[i]} out of the group: {why}")
        peer_ids = [p for i, p in enumerate(group_info.peer_ids) if i in kept]
        if len(peer_ids) < 2:
            raise reconcile.GroupError(f"no other member of the group gathers for round {self._round_no}")
        start_hashes = {group_info.peer_ids[i].to_base58(): a.start_hash for i, a in kept.items()}
        last_sets = {group_info.peer_ids[i].to_base58(): (a.base, a.last_sets) for i, a in kept.items()}
        lineages = {group_info.peer_ids[i].to_base58(): a.lineage for i, a in kept.items() if a.lineage}
        clients = frozenset(group_info.peer_ids[i].to_base58() for i in kept if gathered[i][1] == AveragingMode.CLIENT.value)
        members = tuple(p.to_bytes() for p in peer_ids)
        binding = Binding(self._run, self._round_no, group_info.group_id, members)
        rule = senders_of({group_info.peer_ids[i]: a for i, a in kept.items()}) if self._senders else (None, None)
        agreement = reconcile.Agreement(binding, self._signer, self._max_payload_bytes, *rule)
        group = self._open_group(group_info.group_id, agreement, info=group_info)
        try:
            if self.peer_id.to_bytes() in agreement.senders:
                agreement.seal(self._payload)
            else:  # our update stays in our buffers (protocol/round/eligibility.py)
                logger.info(f"round {self._round_no}: this peer is not one of the round's senders: it sends no payload, "
                            f"its update waits ({len(agreement.senders)} of the group's {len(members)} send)")
            group.done[0].set()
            others = [p for p in peer_ids if p != self.peer_id]
            self._mates = frozenset(p.to_base58() for p in others)  # no strangers to our state serving (state_serving.py)
            strangers = cuttable(self._mates, self._known)
            await self._agree(group, others, patient=clients, strangers=strangers)
            outcome = group.agreement.outcome()
            group.set_digest = group_sets.set_name(binding, outcome.payloads)
            for owner, why in outcome.excluded.items():
                logger.warning(f"round {self._round_no}: excluded {base58(owner)}: {why}")
            return GatherResult(
                group=[p.to_base58() for p in peer_ids],
                payloads={base58(k): v for k, v in outcome.payloads.items()},
                excluded={base58(k): why for k, why in outcome.excluded.items()},
                start_hashes=start_hashes,
                last_sets=last_sets, lineages=lineages,
                set_digest=group.set_digest,
                unservable=clients,
                held=frozenset(p.to_base58() for p in group.held),
                lagged=frozenset(p.to_base58() for p in group.lagged - group.held),
            )
        finally:
            for event in group.done:
                event.set()
            future = self._running_groups.get(group_info.group_id)
            if future is not None and not future.done():
                future.set_result(None)

    def _count(self, sent: int = 0, received: int = 0) -> None:
        with self._bytes_sent.get_lock():
            self._bytes_sent.value += sent
        with self._bytes_received.get_lock():
            self._bytes_received.value += received

    # ---- averager-process side: groups and the RPCs -------------------------------------------
    def _open_group(self, group_id: bytes, agreement: reconcile.Agreement, info: Optional[GroupInfo] = None) -> Group:
        """Only our own rounds create groups; the oldest beyond KEEP_GROUPS is forgotten."""
        group = Group.opened(group_id, agreement, info, self._round_no)
        self._groups[group_id] = group
        while len(self._groups) > KEEP_GROUPS:
            self._groups.popitem(last=False)
        opened, self._group_opened = self._group_opened, asyncio.Event()
        if opened is not None:
            opened.set()
        return group

    async def _member_group(self, group_id: bytes, caller: PeerID) -> Optional[Group]:
        """The group ``caller`` asks about, if it is one of ours and ``caller`` is in it.

        A member may ask before matchmaking told us about the group: wait a little for it, and ask
        the leaders of this round whether it is one they assembled with us (peer/exchange/late_join.py). None
        once the wait is over, or as soon as a group of ours for this round is open (``_gathers_elsewhere``:
        the caller is then told GROUP_DISBANDED, ``_refusal``, and stops asking; a wait to the end of
        it held every member of that group a gather slot, and the whole round's merge with them:
        tests/exchange/test_late_join.py::test_a_member_gathering_elsewhere_is_refused_at_once)."""
        loop = asyncio.get_running_loop()
        asked = loop.time()
        deadline = asked + self.gather_timeout
        if group_id not in self._groups and not self._gathers_elsewhere(group_id):
            self._start_late_join(group_id, caller)
        while group_id not in self._groups:
            if self._gathers_elsewhere(group_id):
                return None
            if self._group_opened is None:
                self._group_opened = asyncio.Event()
            try:
                await asyncio.wait_for(self._group_opened.wait(), timeout=max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                # (what a member that cut us for "sent nothing in time" saw from our side: its one request
                # held here to its deadline, and refused)
                logger.info(f"round {self._round_no}: {caller} asked about a group this peer had not opened "
                            f"{self.gather_timeout:.1f} s later: refused")
                return None
        group = self._groups[group_id]
        if loop.time() - asked > self.gather_timeout / 4:
            logger.info(f"round {self._round_no}: {caller} asked about our group {loop.time() - asked:.1f} s before "
                        f"this peer opened it")
        return group if caller.to_bytes() in group.members else None

    def _refusal(self, group_id: bytes) -> int:
        """The code an RPC about a group we do not serve to the caller answers: GROUP_DISBANDED when
        we gather this round elsewhere (the caller stops asking: peer/exchange/bounds.py's NotInGroup)."""
        return averaging_pb2.GROUP_DISBANDED if self._gathers_elsewhere(group_id) else averaging_pb2.BAD_GROUP_ID

    async def rpc_fetch_payload(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Serve an envelope of one group: ours (empty digest) or a value we accepted and offered."""
        with self._calls.admit(context.remote_id) as admitted:
            group = await self._member_group(request.group_id, context.remote_id) if admitted else None
            envelope = None
            if group is not None:
                self._count(received=request.ByteSize())
                digest = request.tensor_part.buffer
                if request.peer_id == self.peer_id.to_bytes() and not digest:
                    await group.done[0].wait()  # set as soon as the group is opened, or when it ends
                    envelope = group.agreement.own_envelope()
                else:
                    envelope = group.agreement.serve(request.peer_id, digest)
            if envelope is None:
                yield averaging_pb2.AveragingData(code=self._refusal(request.group_id))
                return
            for start in range(0, len(envelope), CHUNK_BYTES):
                msg = averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=envelope[start : start + CHUNK_BYTES]))
                self._count(sent=msg.ByteSize())
                yield msg

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's all-reduce, which this class replaces: nobody gets anything from it."""
        yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)

    async def rpc_relay(self, request: averaging_pb2.AveragingData, context: P2PContext) -> averaging_pb2.AveragingData:
        """Answer a member's agreement round k once our round k - 1 is over: the values it lacks."""
        with self._calls.admit(context.remote_id) as admitted:
            group = await self._member_group(request.group_id, context.remote_id) if admitted else None
            if group is None:
                return averaging_pb2.AveragingData(code=self._refusal(request.group_id))
            self._count(received=request.ByteSize())
            try:
                k, have = reconcile.parse_request(request.tensor_part.buffer, len(group.members))
                if k >= len(group.done):
                    raise reconcile.GroupError(f"round {k} is past the agreement's {len(group.done) - 1}")
            except ProtocolError as e:
                logger.info(f"a relay request from {context.remote_id}: {e}")
                return averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            await group.done[k - 1].wait()  # set by its deadline at the latest, or when the group ends
            msg = averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=group.agreement.answer(have)))
            self._count(sent=msg.ByteSize())
            return msg
