"""Serving and fetching the payload sets groups agreed, so several groups of one round make one θ.

A mixin of peer/exchange/gatherer.py's ``PayloadGatherer`` (the averager process holds the agreements and
the libp2p streams): ``rpc_fetch_set`` serves the packed set (protocol/round/group_sets.py) one of our
recent groups agreed, or one we fetched lately and the host checked, by its name, to any peer the
run admits; ``fetch_set`` fetches one from a peer, from the host process, read with the size limit
of a full group's set. What comes back is only bytes: protocol/round/group_sets.py's ``open_set``
checks every signature before anything counts, and only then (``keep_checked_set``) is the set
served on: a garbled set under a real name would make the peers asking us for it refuse us.

``rpc_merged`` tells a member of one of our groups which sets we merged for that group's round
(``offer_merged``), once we know: members that merged different sets (one saw a late group's set
in time, another did not) each take the union of their groupmates' lists (``merged_by``,
peer/round/merge.py), so a group ends its round with one θ. A question names the round too: a peer
whose own record shows it will never merge that set (it names another set for the round, or is long
past it: protocol/round/peer_states.py ``offers_no_set``) says so at once instead of holding it.
"""

from __future__ import annotations

import asyncio
import math
from typing import AsyncIterator, Callable, Dict, Optional, Sequence, Tuple

from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MPFuture, get_logger

from peer.exchange.bounds import StallCut, keep_bounded, read_bounded_stream
from protocol.round import group_sets
from protocol.round.peer_states import offers_no_set
from protocol.wire.signed import payload_digest

logger = get_logger(__name__)

SET_CHUNK_BYTES = 1 << 18
KEEP_FETCHED = 8  # sets fetched from other groups we keep serving (a groupmate may lack one we merged)
KEEP_FETCHED_BYTES = 64 << 20  # and the most bytes they may take together
KEEP_OFFERS = 8  # our recent rounds' lists of merged sets, answered to groupmates
MAX_ROUND_CHARS = 12  # a question's round, as decimal digits
# questions about our merges held at once for callers in none of our groups (a groupmate whose group we
# have not opened yet, or anyone: the question names a made-up set and waits up to merged_wait_max_s);
# past it such a question is answered at once as if its wait were over
MAX_STRANGERS_HELD = 32


class SetServer:
    """Needs of its host class: ``_groups`` (group id -> group with ``agreement`` and ``set_digest``),
    ``_calls`` and ``_stream_calls`` (CallLimiters), ``_p2p``, ``prefix``, ``_count``, ``_outer_pipe``,
    ``_max_group_size``, ``_max_payload_bytes``, ``_fetched``, ``_unchecked_sets``, ``_packed_sets`` and ``_merged``
    (empty OrderedDicts),
    ``timing`` (protocol/round/timing.py), and ReadyNotices' ``_take_progress`` and ``_ready_progress``
    (peer/exchange/ready_notices.py: our own progress record, as the host last published it)."""

    _strangers_held = 0  # rpc_merged questions held now for callers in none of our groups

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
            return future.result(timeout=timeout + self.timing.pipe_slack_s)
        except Exception as e:
            logger.debug(f"set {digest} from {peer}: {e!r}")
            return None

    def keep_checked_set(self, peer: str, digest: str) -> None:
        """Serve on the set ``digest`` last fetched from ``peer``: ``open_set`` found it is that set."""
        self._outer_pipe.send(("_keep_checked_set", [], dict(peer=peer, digest=digest)))

    def offer_merged(self, set_digest: str, members: Sequence[str], names: Sequence[str]) -> None:
        """The sets we merged for the round of our group ``set_digest`` (its own included): what its
        ``members`` (base58) are told when they ask (``merged_by``)."""
        self._outer_pipe.send(("_offer_merged", [], dict(
            set_digest=set_digest, members=frozenset(PeerID.from_base58(m).to_bytes() for m in members),
            packed=group_sets.pack_names(names))))

    def merged_by(self, waits: Dict[str, float], set_digest: str,
                  round_no: Optional[int] = None) -> Dict[str, Optional[Tuple[str, ...]]]:
        """Each peer of ``waits`` (members of our group ``set_digest``, of round ``round_no``): the sets it
        merged for the round, asked all at once, each answer awaited until that peer has merged or for
        its wait (s); None for a peer that did not answer in time, or answered something that is not a
        list of set names; () for one that said it merges another set of the round, or none."""
        future = MPFuture()
        self._outer_pipe.send(("_merged_by", [], dict(waits=dict(waits), set_digest=set_digest, round_no=round_no,
                                                      future=future)))
        try:
            return future.result(timeout=max(waits.values(), default=0.0) + self.timing.pipe_slack_s)
        except Exception as e:
            logger.debug(f"the merges of group {set_digest}: {e!r}")
            return {p: None for p in waits}

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
            keep_bounded(self._unchecked_sets, (digest.encode(), peer), raw, KEEP_FETCHED, KEEP_FETCHED_BYTES)
            future.set_result(raw)
        except Exception as e:
            future.set_exception(e)

    async def _keep_checked_set(self, peer: str, digest: str) -> None:
        raw = self._unchecked_sets.pop((digest.encode(), peer), None)
        if raw is not None:
            self._keep_fetched(digest.encode(), raw)

    def _keep_fetched(self, digest: bytes, raw: bytes) -> None:
        """Serve on a fetched set the host checked (within ``KEEP_FETCHED`` sets and ``KEEP_FETCHED_BYTES``)."""
        keep_bounded(self._fetched, digest, raw, KEEP_FETCHED, KEEP_FETCHED_BYTES)

    def _group_of_set(self, name: bytes):
        for group in reversed(self._groups.values()):
            if group.set_digest is not None and group.set_digest.encode() == name:
                return group
        return None

    async def _offer_merged(self, set_digest: str, members: frozenset, packed: bytes) -> None:
        self._merged[set_digest.encode()] = (members, packed)
        self._merged.move_to_end(set_digest.encode())
        while len(self._merged) > KEEP_OFFERS:
            self._merged.popitem(last=False)

    async def _merged_by(self, waits: Dict[str, float], set_digest: str, round_no: Optional[int],
                         future: MPFuture) -> None:
        try:
            peers = sorted(waits)
            answers = await asyncio.gather(*(self._ask_merged(p, set_digest, waits[p], round_no) for p in peers))
            future.set_result(dict(zip(peers, answers)))
        except Exception as e:
            future.set_exception(e)

    async def _ask_merged(self, peer: str, set_digest: str, timeout: float,
                          round_no: Optional[int] = None) -> Optional[Tuple[str, ...]]:
        request = averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=set_digest.encode()), weight=timeout,
                                              group_id=b"" if round_no is None else str(int(round_no)).encode())
        try:
            stub = self.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix)
            self._count(sent=request.ByteSize())
            answer = await asyncio.wait_for(stub.rpc_merged(request), timeout=timeout + self.timing.rpc_slack_s)
            self._count(received=answer.ByteSize())
            if answer.code == averaging_pb2.GROUP_DISBANDED:
                return ()  # it merges another set of the round, or none: nothing to wait for
            if answer.code != averaging_pb2.NO_CODE:
                return None
            return group_sets.parse_names(answer.tensor_part.buffer)
        except Exception as e:
            logger.debug(f"what {peer} merged for group {set_digest}: {e!r}")
            return None

    def _packed_set(self, digest: bytes) -> Optional[bytes]:
        """The set named ``digest``, packed: one of our groups' (packed once: a name fixes its content,
        and every asker shares the one copy), or one fetched and checked; None if we hold no such set."""
        packed = self._packed_sets.get(digest)
        if packed is not None:
            return packed
        group = self._group_of_set(digest)
        if group is not None:
            agreement = group.agreement
            payloads = agreement.outcome().payloads
            envelopes = {owner: agreement.serve(owner, payload_digest(p)) for owner, p in payloads.items()}
            packed = group_sets.pack_set(agreement.binding, envelopes)
            keep_bounded(self._packed_sets, digest, packed, KEEP_FETCHED, KEEP_FETCHED_BYTES)
            return packed
        return self._fetched.get(digest)

    async def rpc_fetch_set(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Serve the set one of our recent groups agreed, by its name."""
        def answer(digest: bytes) -> Optional[bytes]:
            return self._packed_set(digest) if len(digest) == group_sets.DIGEST_CHARS else None

        async for msg in self._serve_packed(context, request, answer):
            yield msg

    async def _serve_packed(self, context: P2PContext, request: averaging_pb2.AveragingData,
                            answer: Callable[[bytes], Optional[bytes]]) -> AsyncIterator[averaging_pb2.AveragingData]:
        """``answer(what was asked)`` streamed in chunks to an admitted caller (``_stream_calls``: a few at once
        from each peer, ``SERVING_AT_ONCE`` in all); BAD_GROUP_ID for None. hivemind puts no deadline on
        the serving side, so a caller that stops reading held its place for as long as its connection
        lived (32 identities held every place): the stream is cut as state serving's are
        (``bounds.StallCut``; tests/exchange/test_merged_lists.py::test_a_caller_that_stops_reading_loses_its_place)."""
        with self._stream_calls.admit(context.remote_id) as admitted:
            packed = answer(request.tensor_part.buffer) if admitted else None
            if packed is None:
                yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
                return
            self._count(received=request.ByteSize())
            watchdog = StallCut(self.timing, asyncio.current_task().cancel)
            try:
                for start in range(0, len(packed), SET_CHUNK_BYTES):
                    msg = averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=packed[start : start + SET_CHUNK_BYTES]))
                    self._count(sent=msg.ByteSize())
                    watchdog.sent(start)
                    yield msg
            finally:
                watchdog.cancel()

    async def rpc_merged(self, request: averaging_pb2.AveragingData, context: P2PContext) -> averaging_pb2.AveragingData:
        """A member of one of our groups asks which sets we merged for its round: answered once we
        have merged (``offer_merged``), held open at most the wait it names (``weight``, capped), or at
        once (GROUP_DISBANDED) where our record shows we never will (``offers_no_set``; a question
        that names no round, ``group_id``, is only held). A caller in none of our groups is held only
        while fewer than ``MAX_STRANGERS_HELD`` such are
        (tests/exchange/test_merged_lists.py::test_questions_from_strangers_are_held_only_up_to_a_bound)."""
        with self._calls.admit(context.remote_id) as admitted:
            name, asked = request.tensor_part.buffer, request.group_id
            if (not admitted or len(name) != group_sets.DIGEST_CHARS or len(asked) > MAX_ROUND_CHARS
                    or (asked and not asked.isdigit())):
                return averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            round_no = int(asked) if asked else None
            self._count(received=request.ByteSize())
            caller = context.remote_id.to_bytes()
            stranger = not any(caller in g.members for g in self._groups.values())
            if stranger and self._strangers_held >= MAX_STRANGERS_HELD:  # answered as if it timed out
                return averaging_pb2.AveragingData(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
            self._strangers_held += stranger
            try:
                return await self._merged_answer(name, round_no, caller, request.weight)
            finally:
                self._strangers_held -= stranger

    async def _merged_answer(self, name: bytes, round_no: Optional[int], caller: bytes, weight: float):
        """``rpc_merged``'s answer, once there is one or ``weight`` seconds (capped) are over."""
        wait = min(max(weight, 0.0), self.timing.merged_wait_max_s) if math.isfinite(weight) else 0.0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while True:  # a slower member may not have agreed or merged yet
            members, packed = self._merged.get(name, (None, None))
            if members is not None and caller not in members:
                return averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            if packed is not None:
                msg = averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=packed))
                self._count(sent=msg.ByteSize())
                return msg
            if round_no is not None and self._merges_elsewhere(name, round_no):
                return averaging_pb2.AveragingData(code=averaging_pb2.GROUP_DISBANDED)
            if loop.time() >= deadline:
                return averaging_pb2.AveragingData(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
            await asyncio.sleep(self.timing.merged_poll_s)

    def _merges_elsewhere(self, name: bytes, round_no: int) -> bool:
        """Whether our own record says we will never merge the set ``name`` of ``round_no``."""
        self._take_progress()
        mine = self._ready_progress
        return mine is not None and offers_no_set(mine, round_no, name.decode("ascii", "replace"))
