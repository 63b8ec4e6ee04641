"""Serving and fetching the payload sets groups agreed, so several groups of one round make one θ.

A mixin of peer/exchange.py's ``PayloadGatherer`` (the averager process holds the agreements and
the libp2p streams): ``rpc_fetch_set`` serves the packed set (protocol/group_sets.py) one of our
recent groups agreed, by its name, to any peer the run admits; ``fetch_set`` fetches one from a
peer, from the host process, read with the size limit of a full group's set. What comes back is
only bytes: protocol/group_sets.py's ``open_set`` checks every signature before anything counts.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Optional

from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MPFuture, get_logger

from peer.exchange_io import read_bounded_stream
from protocol import group_sets
from protocol.signed import payload_digest

logger = get_logger(__name__)

SET_CHUNK_BYTES = 1 << 18


class SetServer:
    """Needs of its host class: ``_groups`` (group id -> group with ``agreement`` and ``set_digest``),
    ``_calls`` (a CallLimiter), ``_p2p``, ``prefix``, ``_count``, ``_outer_pipe``,
    ``_max_group_size`` and ``_max_payload_bytes``."""

    # ---- host-process API ---------------------------------------------------------------------
    @property
    def run_digest(self) -> bytes:
        """What every binding of this run names as its run (the spec digest the gatherer was made for)."""
        return self._run

    @property
    def max_payload_bytes(self) -> int:
        return self._max_payload_bytes

    def fetch_set(self, peer: str, digest: str, timeout: float) -> Optional[bytes]:
        """The packed set named ``digest`` from ``peer`` (base58), unchecked; None if it has none in time."""
        future = MPFuture()
        self._outer_pipe.send(("_fetch_set", [], dict(peer=peer, digest=digest, timeout=timeout, future=future)))
        try:
            return future.result(timeout=timeout + 5.0)
        except Exception as e:
            logger.debug(f"set {digest} from {peer}: {e!r}")
            return None

    # ---- averager-process side ----------------------------------------------------------------
    def _set_limit(self) -> int:
        return group_sets.max_set_bytes(self._max_group_size, self._max_payload_bytes)

    async def _fetch_set(self, peer: str, digest: str, timeout: float, future: MPFuture) -> None:
        try:
            request = averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=digest.encode()))
            self._count(sent=request.ByteSize())
            handle = type(self)._get_handle_name(self.prefix, "rpc_fetch_set")
            raw, wire = await asyncio.wait_for(
                read_bounded_stream(self._p2p, PeerID.from_base58(peer), handle, request, limit=self._set_limit(),
                                    chunk=SET_CHUNK_BYTES),
                timeout=timeout,
            )
            self._count(received=wire)
            future.set_result(raw)
        except Exception as e:
            future.set_exception(e)

    def _packed_set(self, digest: bytes) -> Optional[bytes]:
        for group in reversed(self._groups.values()):
            if group.set_digest is not None and group.set_digest.encode() == digest:
                agreement = group.agreement
                payloads = agreement.outcome().payloads
                envelopes = {owner: agreement.serve(owner, payload_digest(p)) for owner, p in payloads.items()}
                return group_sets.pack_set(agreement.binding, envelopes)
        return None

    async def rpc_fetch_set(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Serve the set one of our recent groups agreed, by its name."""
        with self._calls.admit(context.remote_id) as admitted:
            digest = request.tensor_part.buffer
            packed = self._packed_set(digest) if admitted and len(digest) == group_sets.DIGEST_CHARS else None
            if packed is None:
                yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
                return
            self._count(received=request.ByteSize())
            for start in range(0, len(packed), SET_CHUNK_BYTES):
                msg = averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=packed[start : start + SET_CHUNK_BYTES]))
                self._count(sent=msg.ByteSize())
                yield msg
