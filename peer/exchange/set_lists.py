"""Serving and fetching a set's list of its payloads, and one payload of a set, so a peer that may take
only K contributions a round downloads only those (docs/scale.md).

A mixin of peer/exchange/gatherer.py's ``PayloadGatherer``, beside ``SetServer``:

- ``rpc_fetch_manifest`` serves the list (protocol/round/set_manifests.py) of a set one of our recent
  groups agreed, of a set we fetched whole, or one we fetched as a list;
- ``rpc_fetch_member`` serves one owner's envelope of such a set (of a list we fetched, only the
  envelopes we fetched too: we serve on what we hold).

Both are streamed by ``SetServer._serve_packed``.

Both answer any peer the run admits, through the same call limiter as every gather RPC, streamed
in chunks and read with the size limit of a list or of one envelope. What comes back is only bytes:
``open_manifest`` and ``open_member`` check it in the host process before anything counts. What we
keep to serve on is bounded (``KEEP_LISTS`` lists, ``KEEP_MEMBERS`` envelopes within
``KEEP_MEMBER_BYTES``).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import AsyncIterator, Optional, Tuple

from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MPFuture, get_logger

from peer.exchange.bounds import read_bounded_stream
from peer.exchange.set_server import SET_CHUNK_BYTES
from protocol.round import group_sets, set_manifests
from protocol.wire.bounded_unpack import bounded_unpack
from protocol.wire.signed import ENVELOPE_OVERHEAD, MAX_ID_BYTES, Binding, payload_digest
from protocol.errors import ProtocolError

logger = get_logger(__name__)

KEEP_LISTS = 64  # lists fetched that we serve on (a round's other groups: a few each round)
KEEP_MEMBERS = 64  # envelopes fetched that we serve on
KEEP_MEMBER_BYTES = 64 << 20  # and the most bytes they may take together


class ListServer:
    """Needs of its host class: ``SetServer`` (``_group_of_set``, ``_serve_packed``) with what it needs,
    and ``_fetched_lists``, ``_fetched_members`` (empty OrderedDicts)."""

    # ---- host-process API ---------------------------------------------------------------------
    def fetch_manifest(self, peer: str, digest: str, timeout: float) -> Optional[bytes]:
        """The list of the set ``digest`` from ``peer`` (base58), unchecked; None if none came in time."""
        return self._ask_list_server("_fetch_manifest", dict(peer=peer, digest=digest), timeout)

    def fetch_member(self, peer: str, digest: str, owner: bytes, timeout: float) -> Optional[bytes]:
        """``owner``'s envelope in the set ``digest`` from ``peer``, unchecked; None if none came in time."""
        return self._ask_list_server("_fetch_member", dict(peer=peer, digest=digest, owner=owner), timeout)

    def _ask_list_server(self, method: str, kwargs: dict, timeout: float) -> Optional[bytes]:
        future = MPFuture()
        self._outer_pipe.send((method, [], dict(kwargs, timeout=timeout, future=future)))
        try:
            return future.result(timeout=timeout + self.timing.pipe_slack_s)
        except Exception as e:
            logger.debug(f"{method[1:]} {kwargs.get('digest')} from {kwargs.get('peer')}: {e!r}")
            return None

    # ---- averager-process side ----------------------------------------------------------------
    async def _fetch_manifest(self, peer: str, digest: str, timeout: float, future: MPFuture) -> None:
        await self._fetch_into(future, peer, "rpc_fetch_manifest", digest.encode(),
                               set_manifests.max_manifest_bytes(self._max_group_size), timeout,
                               lambda raw: self._keep(self._fetched_lists, digest.encode(), raw, KEEP_LISTS, None))

    async def _fetch_member(self, peer: str, digest: str, owner: bytes, timeout: float, future: MPFuture) -> None:
        await self._fetch_into(future, peer, "rpc_fetch_member", digest.encode() + owner,
                               self._max_payload_bytes + ENVELOPE_OVERHEAD, timeout,
                               lambda raw: self._keep(self._fetched_members, (digest.encode(), owner), raw,
                                                      KEEP_MEMBERS, KEEP_MEMBER_BYTES))

    async def _fetch_into(self, future: MPFuture, peer: str, rpc: str, ask: bytes, limit: int, timeout: float, keep) -> None:
        try:
            request = averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=ask))
            self._count(sent=request.ByteSize())
            handle = type(self)._get_handle_name(self.prefix, rpc)
            raw, wire = await asyncio.wait_for(
                read_bounded_stream(self._p2p, PeerID.from_base58(peer), handle, request, limit=limit, chunk=SET_CHUNK_BYTES),
                timeout=timeout,
            )
            self._count(received=wire)
            keep(raw)  # unchecked here: whoever fetches it from us checks it, as we do
            future.set_result(raw)
        except Exception as e:
            future.set_exception(e)

    @staticmethod
    def _keep(kept: OrderedDict, key, raw: bytes, most: int, most_bytes: Optional[int]) -> None:
        kept[key] = raw
        kept.move_to_end(key)
        while len(kept) > most or (most_bytes is not None and len(kept) > 1 and sum(map(len, kept.values())) > most_bytes):
            kept.popitem(last=False)

    def _whole_set(self, digest: bytes) -> Optional[Tuple[Binding, dict, dict]]:
        """(binding, owner -> payload, owner -> envelope) of a set we hold whole: one of our groups'
        or one fetched whole (its envelopes unchecked here, as when we serve the set itself)."""
        group = self._group_of_set(digest)
        if group is not None:
            agreement = group.agreement
            payloads = agreement.outcome().payloads
            envelopes = {owner: agreement.serve(owner, payload_digest(p)) for owner, p in payloads.items()}
            return agreement.binding, payloads, envelopes
        raw = self._fetched.get(digest)
        if raw is None:
            return None
        try:
            _, run, round_no, group_id, members, items = bounded_unpack(
                raw, ProtocolError, "set", max_array_len=max(6, self._max_group_size), max_map_len=0)
            envelopes = {owner: envelope for owner, envelope in items}
            payloads = {owner: bounded_unpack(e, ProtocolError, "envelope", max_array_len=4, max_map_len=0)[3]
                        for owner, e in envelopes.items()}
            return Binding(run, round_no, group_id, tuple(members)), payloads, envelopes
        except (ProtocolError, TypeError, ValueError, IndexError, KeyError):
            return None

    def _manifest_of(self, digest: bytes) -> Optional[bytes]:
        whole = self._whole_set(digest)
        if whole is not None:
            binding, payloads, _ = whole
            return set_manifests.pack_manifest(binding, payloads)
        return self._fetched_lists.get(digest)

    def _member_of(self, digest: bytes, owner: bytes) -> Optional[bytes]:
        whole = self._whole_set(digest)
        if whole is not None:
            return whole[2].get(owner)
        return self._fetched_members.get((digest, owner))

    async def rpc_fetch_manifest(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Serve the list of a set we hold, by the set's name."""
        def answer(ask: bytes) -> Optional[bytes]:
            return self._manifest_of(ask) if len(ask) == group_sets.DIGEST_CHARS else None

        async for msg in self._serve_packed(context, request, answer):
            yield msg

    async def rpc_fetch_member(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Serve one owner's envelope of a set we hold: asked as the set's name, then the owner's id."""
        def answer(ask: bytes) -> Optional[bytes]:
            name, owner = ask[:group_sets.DIGEST_CHARS], ask[group_sets.DIGEST_CHARS:]
            if len(name) != group_sets.DIGEST_CHARS or not 0 < len(owner) <= MAX_ID_BYTES:
                return None
            return self._member_of(name, owner)

        async for msg in self._serve_packed(context, request, answer):
            yield msg
