"""All-gather of opaque payloads in groups formed by hivemind's matchmaking.

hivemind's DecentralizedAverager finds groups (DHT-declared keys, leader election, timeouts) and
then runs a butterfly all-reduce whose results differ in the last bits from member to member.
Replicas that must stay bit-identical need every member to compute from the same bytes, so this
subclass keeps the matchmaking and replaces the all-reduce with an all-gather:

1. every member pulls every other member's payload (``rpc_fetch_payload``, streamed in chunks);
2. every member pulls every other member's digest table (``rpc_payload_digests``): the sha256 of
   each payload it holds;
3. a sender whose payload has two different digests among the members is excluded (it sent
   different bytes to different peers); a payload some member holds and another lacks (its sender
   died mid-send) is fetched from a member that holds it, checked against the digest.

Every decision of step 3 (and the parsing of tables and matchmaking announcements) is
protocol/reconcile.py's, a pure function of what arrived: this class only moves the bytes.

Members that survive end with the same set of payloads, which the caller decodes and aggregates
in a canonical order. The payloads are opaque here: validation is protocol/payload.py's job.

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
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.group_info import GroupInfo
from hivemind.dht import DHT
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MPFuture, get_logger

from protocol import reconcile

logger = get_logger(__name__)

CHUNK_BYTES = 1 << 18
ROUND_BITS = 20  # the round number, mod 2**20, is the matchmaking bucket
KEEP_GROUPS = 8  # recent groups whose payloads we keep serving to slower members
MAX_TABLE_ENTRIES = 4096  # owners a groupmate's digest table may list


@dataclass
class GatherResult:
    """What one member holds after a round's all-gather."""

    group: List[str]  # every member of the group, as base58 peer ids
    payloads: Dict[str, bytes]  # sender -> payload, own included
    excluded: Dict[str, str]  # sender -> why its payload is not in `payloads`
    start_hashes: Dict[str, str]  # member -> hash of the parameters it started the round from
    bytes_sent: int = 0
    bytes_received: int = 0


@dataclass
class _Group:
    payloads: Dict[bytes, bytes] = field(default_factory=dict)  # owner peer id bytes -> payload
    gathered: asyncio.Event = field(default_factory=asyncio.Event)  # phase 1 over: digests may be served
    registered: asyncio.Event = field(default_factory=asyncio.Event)  # our own payload is in `payloads`


class PayloadGatherer(DecentralizedAverager):
    """hivemind matchmaking + a digest-checked all-gather of one payload per member."""

    def __init__(
        self,
        dht: DHT,
        *,
        prefix: str,
        schema: bytes,
        min_group_size: int = 2,
        max_group_size: int = 16,
        matchmaking_time: float = 3.0,
        gather_timeout: float = 30.0,
        request_timeout: float = 1.0,
    ):
        self.gather_timeout = gather_timeout
        self._bytes_sent = mp.Value(ctypes.c_int64, 0)
        self._bytes_received = mp.Value(ctypes.c_int64, 0)
        super().__init__(
            averaged_tensors=(),
            dht=dht,
            start=False,
            prefix=prefix,
            target_group_size=max_group_size,
            min_group_size=min_group_size,
            min_matchmaking_time=matchmaking_time,
            request_timeout=request_timeout,
            allreduce_timeout=gather_timeout * 3,
            next_chunk_timeout=gather_timeout,
            declare_state_period=10.0,
        )
        # peers of different runs or specs never match: the schema is the spec digest
        self.schema_hash = hashlib.sha256(schema).digest()
        self._max_group_size = max_group_size
        self._groups: "OrderedDict[bytes, _Group]" = OrderedDict()
        self.state_provider: Optional[Callable[[], Tuple[Any, Sequence[torch.Tensor]]]] = None

    # ---- host-process API ---------------------------------------------------------------------
    @property
    def bytes_sent(self) -> int:
        return int(self._bytes_sent.value)

    @property
    def bytes_received(self) -> int:
        return int(self._bytes_received.value)

    def gather(
        self, round_no: int, payload: bytes, *, start_hash: str, expected_size: int, timeout: float
    ) -> Optional[GatherResult]:
        """Find a group of this round and all-gather payloads. None if no group formed in time."""
        sent0, recv0 = self.bytes_sent, self.bytes_received
        future = MPFuture()
        expected = max(1, min(expected_size, self._max_group_size))
        # the control pipe is non-blocking on the averager's side and drops large messages: hand the
        # payload over through a file in shared memory instead
        fd, path = tempfile.mkstemp(prefix="voloco-payload-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        self._outer_pipe.send(("_prepare_round", [], dict(round_no=round_no, path=path, expected=expected, future=future)))
        try:
            future.result(timeout=30)
        finally:
            if os.path.exists(path):
                os.unlink(path)
        try:
            result = self.step(gather=reconcile.announcement(round_no, start_hash), timeout=timeout, allow_retries=True)
        except Exception as e:  # matchmaking or gather failure: the caller defers this round
            logger.debug(f"round {round_no}: no group ({e!r})")
            return None
        if not isinstance(result, GatherResult):
            return None
        result.bytes_sent = self.bytes_sent - sent0
        result.bytes_received = self.bytes_received - recv0
        return result

    def get_current_state(self):
        """Called in this (host) process when a late joiner downloads our state."""
        if self.state_provider is None:
            raise RuntimeError("this peer has no state to share yet")
        return self.state_provider()

    def load_state(self, timeout: float) -> Optional[Tuple[Any, List[torch.Tensor]]]:
        """Download (metadata, tensors) from the live peer that declared the highest priority (round)."""
        return self.load_state_from_peers(timeout=timeout)

    # ---- averager-process side ----------------------------------------------------------------
    async def _prepare_round(self, round_no: int, path: str, expected: int, future: MPFuture):
        try:
            with open(path, "rb") as f:
                self._round_no, self._payload = round_no, f.read()
            mm = self._matchmaking
            mm.group_key_manager.group_bits = format(round_no % (1 << ROUND_BITS), f"0{ROUND_BITS}b")
            # close the group as soon as every live peer of the round has joined
            mm.target_group_size = mm.potential_leaders.target_group_size = expected
            future.set_result(None)
        except Exception as e:
            future.set_exception(e)

    def _group(self, group_id: bytes) -> _Group:
        groups = self._groups
        if group_id not in groups:
            groups[group_id] = _Group()
            while len(groups) > KEEP_GROUPS:
                groups.popitem(last=False)
        return groups[group_id]

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs) -> GatherResult:
        me = self.peer_id
        announced = reconcile.parse_announcements(
            [self.serializer.loads(self.serializer.loads(g)[2]) for g in group_info.gathered], self._round_no
        )
        start_hashes = {p.to_base58(): a[1] for p, a in zip(group_info.peer_ids, announced)}
        group = self._group(group_info.group_id)
        group.payloads[me.to_bytes()] = self._payload
        group.registered.set()
        others = [p for p in group_info.peer_ids if p != me]
        try:
            fetched = await asyncio.gather(
                *(self._fetch(p, group_info.group_id, owner=p) for p in others), return_exceptions=True
            )
            for peer, got in zip(others, fetched):
                if isinstance(got, bytes):
                    group.payloads[peer.to_bytes()] = got
            group.gathered.set()

            tables = await asyncio.gather(
                *(self._fetch_digests(p, group_info.group_id) for p in others), return_exceptions=True
            )
            plan = reconcile.reconcile(
                [p.to_bytes() for p in group_info.peer_ids],
                reconcile.digest_table(group.payloads),
                {p.to_bytes(): t if isinstance(t, dict) else None for p, t in zip(others, tables)},
            )
            for owner in plan.excluded:
                group.payloads.pop(owner, None)
            refetched: Dict[bytes, bytes] = {}
            for owner, want in plan.refetch.items():
                for holder in want.holders:
                    try:
                        got = await self._fetch(PeerID(holder), group_info.group_id, owner=PeerID(owner))
                    except Exception as e:
                        logger.debug(f"re-fetch of {_b58(owner)} from {_b58(holder)} failed: {e!r}")
                        continue
                    if want.accepts(got):
                        group.payloads[owner] = refetched[owner] = got
                        break
            outcome = reconcile.finalize(plan, refetched)
            return GatherResult(
                group=[p.to_base58() for p in group_info.peer_ids],
                payloads={_b58(k): v for k, v in group.payloads.items() if k in outcome.keep},
                excluded={_b58(k): why for k, why in outcome.excluded.items()},
                start_hashes=start_hashes,
            )
        finally:
            group.gathered.set()
            future = self._running_groups.get(group_info.group_id)
            if future is not None and not future.done():
                future.set_result(None)

    async def _fetch(self, peer: PeerID, group_id: bytes, owner: PeerID) -> bytes:
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)

        async def pull() -> bytes:
            stream = await stub.rpc_fetch_payload(averaging_pb2.AveragingData(group_id=group_id, peer_id=owner.to_bytes()))
            parts = []
            async for msg in stream:
                self._count(received=msg.ByteSize())
                if msg.code != averaging_pb2.NO_CODE:
                    raise KeyError(f"{peer} does not hold the payload of {owner}")
                parts.append(msg.tensor_part.buffer)
            if not parts:
                raise KeyError(f"{peer} sent no payload")
            return b"".join(parts)

        return await asyncio.wait_for(pull(), timeout=self.gather_timeout)

    async def _fetch_digests(self, peer: PeerID, group_id: bytes) -> Dict[bytes, bytes]:
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        msg = await asyncio.wait_for(
            stub.rpc_payload_digests(averaging_pb2.AveragingData(group_id=group_id)), timeout=self.gather_timeout
        )
        self._count(received=msg.ByteSize())
        return reconcile.parse_digest_table(msg.tensor_part.buffer, MAX_TABLE_ENTRIES)

    def _count(self, sent: int = 0, received: int = 0) -> None:
        with self._bytes_sent.get_lock():
            self._bytes_sent.value += sent
        with self._bytes_received.get_lock():
            self._bytes_received.value += received

    async def rpc_fetch_payload(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Serve the payload of ``request.peer_id`` (ours or a groupmate's) for one group."""
        group = self._group(request.group_id)
        waiter = group.registered if request.peer_id == self.peer_id.to_bytes() else group.gathered
        try:
            await asyncio.wait_for(waiter.wait(), timeout=self.gather_timeout)
        except asyncio.TimeoutError:
            pass
        payload = group.payloads.get(request.peer_id)
        if payload is None:
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        for start in range(0, max(1, len(payload)), CHUNK_BYTES):
            msg = averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=payload[start : start + CHUNK_BYTES]))
            self._count(sent=msg.ByteSize())
            yield msg

    async def rpc_payload_digests(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> averaging_pb2.AveragingData:
        """Which payloads this member holds for a group, by sha256: how members agree on one set."""
        group = self._group(request.group_id)
        try:
            await asyncio.wait_for(group.gathered.wait(), timeout=self.gather_timeout)
        except asyncio.TimeoutError:
            pass
        table = reconcile.encode_digest_table(reconcile.digest_table(group.payloads))
        msg = averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=table))
        self._count(sent=msg.ByteSize())
        return msg


def _b58(peer_id_bytes: bytes) -> str:
    return PeerID(peer_id_bytes).to_base58()
