"""Serving and fetching a set's list of its payloads, and one payload of a set, so a peer that may take
only K contributions a round downloads only those (docs/scale.md).

A mixin of peer/exchange/gatherer.py's ``PayloadGatherer``, beside ``SetServer``:

- ``rpc_fetch_manifest`` serves the list (protocol/round/set_manifests.py) of a set one of our recent
  groups agreed, of a set we fetched whole, or one we fetched as a list;
- ``rpc_fetch_member`` serves one owner's envelope of such a set (``fetch_members`` asks for
  several at once) (of a list we fetched, only the
  envelopes we fetched too: we serve on what we hold).

Both are streamed by ``SetServer._serve_packed``.

Both answer any peer the run admits, through the same call limiter as every gather RPC, streamed
in chunks and read with the size limit of a list or of one envelope. What comes back is only bytes:
``open_manifest`` and ``open_member`` check it in the host process before anything counts. What we
keep to serve on is bounded (``KEEP_LISTS`` lists, ``KEEP_MEMBERS`` envelopes within
``KEEP_MEMBER_BYTES``), and kept only once checked, as the asker checks it.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, List, Optional, Sequence, Tuple

from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MPFuture, get_logger

from peer.exchange.bounds import keep_bounded, read_bounded_stream
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
    ``_run``, and ``_fetched_lists``, ``_opened_lists``, ``_fetched_members``, ``_served_members``, ``_packed_lists`` (empty
    OrderedDicts)."""

    # ---- host-process API ---------------------------------------------------------------------
    def fetch_manifest(self, peer: str, digest: str, timeout: float) -> Optional[bytes]:
        """The list of the set ``digest`` from ``peer`` (base58), unchecked; None if none came in time."""
        return self._ask_list_server("_fetch_manifest", dict(peer=peer, digest=digest), timeout)

    def fetch_members(self, asks: Sequence[Tuple[str, str, bytes]], timeout: float) -> List[Optional[bytes]]:
        """For each (peer, set digest, owner) of ``asks``: that owner's envelope in that set from that
        peer, unchecked, or None; all asked at once, each answer awaited at most ``timeout``."""
        if not asks:
            return []
        got = self._ask_list_server("_fetch_members", dict(asks=list(asks)), timeout)
        return list(got) if got is not None else [None] * len(asks)

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
        held = self._manifest_of(digest.encode())  # one a merge's answer carried (ready_notices.py), checked here
        if held is not None:
            future.set_result(held)
            return
        await self._fetch_into(future, peer, "rpc_fetch_manifest", digest.encode(),
                               set_manifests.max_manifest_bytes(self._max_group_size), timeout,
                               lambda raw: self._keep_list(digest, raw))

    async def _fetch_members(self, asks: List[Tuple[str, str, bytes]], timeout: float, future: MPFuture) -> None:
        async def one(peer: str, digest: str, owner: bytes) -> Optional[bytes]:
            try:
                raw = await self._fetch_raw(peer, "rpc_fetch_member", digest.encode() + owner,
                                            self._max_payload_bytes + ENVELOPE_OVERHEAD, timeout)
            except Exception as e:
                logger.debug(f"envelope of {owner!r} in set {digest} from {peer}: {e!r}")
                return None
            self._keep_member(digest, owner, raw)
            return raw

        try:
            future.set_result(await asyncio.gather(*(one(*ask) for ask in asks)))
        except Exception as e:
            future.set_exception(e)

    async def _fetch_into(self, future: MPFuture, peer: str, rpc: str, ask: bytes, limit: int, timeout: float, keep) -> None:
        try:
            raw = await self._fetch_raw(peer, rpc, ask, limit, timeout)
            keep(raw)
            future.set_result(raw)
        except Exception as e:
            future.set_exception(e)

    async def _fetch_raw(self, peer: str, rpc: str, ask: bytes, limit: int, timeout: float) -> bytes:
        request = averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=ask))
        self._count(sent=request.ByteSize())
        handle = type(self)._get_handle_name(self.prefix, rpc)
        raw, wire = await asyncio.wait_for(
            read_bounded_stream(self._p2p, PeerID.from_base58(peer), handle, request, limit=limit, chunk=SET_CHUNK_BYTES),
            timeout=timeout,
        )
        self._count(received=wire)
        return raw

    def _opened_list(self, digest: str, raw: bytes, asked: Optional[int] = None) -> Optional[set_manifests.SetManifest]:
        """``raw`` checked as the list of the set ``digest`` of this run (its round read from it: the
        name commits to the round; where ``asked`` is given, only a list of that round); None if it is not."""
        try:
            round_no = bounded_unpack(raw, ProtocolError, "list", max_array_len=max(6, self._max_group_size),
                                      max_map_len=0)[2]
            if not isinstance(round_no, int) or isinstance(round_no, bool) or (asked is not None and round_no != asked):
                return None  # the list's own check would refuse it; a float round (inf) is no round
            return set_manifests.open_manifest(raw, self._run, round_no, digest, self._max_group_size)
        except (ProtocolError, TypeError, ValueError, IndexError, KeyError):
            return None

    def _keep_list(self, digest: str, raw: bytes, asked: Optional[int] = None) -> None:
        """Serve on a fetched list, once it checks out (a garbled answer must not push good ones out;
        ``asked``: only a list of that round, for one that came unasked with an answer); the checked
        list is kept too, so that the envelopes fetched against it do not check every signature of the
        list again, once each (tests/exchange/test_set_lists.py)."""
        manifest = self._opened_list(digest, raw, asked)
        if manifest is not None:
            keep_bounded(self._fetched_lists, digest.encode(), raw, KEEP_LISTS, None)
            keep_bounded(self._opened_lists, digest.encode(), manifest, KEEP_LISTS, None)

    def _keep_member(self, digest: str, owner: bytes, raw: bytes) -> None:
        """Serve on a fetched envelope, once it checks out against the list we hold of its set."""
        manifest = self._opened_lists.get(digest.encode())
        try:
            if manifest is not None and set_manifests.open_member(manifest, owner, raw, self._max_payload_bytes):
                keep_bounded(self._fetched_members, (digest.encode(), owner), raw, KEEP_MEMBERS, KEEP_MEMBER_BYTES)
        except ProtocolError:
            pass

    def _whole_envelope(self, digest: bytes, owner: Optional[bytes] = None):
        """Of a set we hold whole (one of our groups', or one fetched whole and checked by the host):
        ``owner``'s envelope, or with no owner (binding,
        owner -> envelope); None if we hold no such set (or entry)."""
        group = self._group_of_set(digest)
        if group is not None:
            agreement = group.agreement
            payloads = agreement.outcome().payloads
            if owner is not None:
                return agreement.serve(owner, payload_digest(payloads[owner])) if owner in payloads else None
            return agreement.binding, {o: agreement.serve(o, payload_digest(p)) for o, p in payloads.items()}
        raw = self._fetched.get(digest)
        if raw is None:
            return None
        try:
            _, run, round_no, group_id, members, items = bounded_unpack(
                raw, ProtocolError, "set", max_array_len=max(6, self._max_group_size), max_map_len=0)
            envelopes = {o: envelope for o, envelope in items}
            if owner is not None:
                return envelopes.get(owner)
            return Binding(run, round_no, group_id, tuple(members)), envelopes
        except (ProtocolError, TypeError, ValueError):
            return None

    def _manifest_of(self, digest: bytes) -> Optional[bytes]:
        """The list of a set we hold: packed once per set (``_packed_lists``), not once per asker."""
        packed = self._packed_lists.get(digest)
        if packed is None:
            whole = self._whole_envelope(digest)
            if whole is not None:
                try:
                    packed = set_manifests.pack_manifest(*whole)
                except Exception as e:  # a garbled set fetched whole: served as nothing
                    logger.debug(f"the list of set {digest!r}: {e!r}")
                    return None
                keep_bounded(self._packed_lists, digest, packed, KEEP_LISTS, None)
        return packed if packed is not None else self._fetched_lists.get(digest)

    def _member_of(self, digest: bytes, owner: bytes) -> Optional[bytes]:
        """``owner``'s envelope in the set ``digest``: made once per (set, owner) and the one copy served
        to every asker (each request hashed and packed the payload anew, a copy per asker; a set's name
        commits to its envelopes, so what is kept never changes: tests/exchange/test_set_lists.py)."""
        key = (digest, owner)
        envelope = self._served_members.get(key)
        if envelope is None:
            envelope = self._whole_envelope(digest, owner)
            if envelope is not None:
                keep_bounded(self._served_members, key, envelope, KEEP_MEMBERS, KEEP_MEMBER_BYTES)
        return envelope if envelope is not None else self._fetched_members.get(key)

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
