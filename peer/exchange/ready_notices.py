"""Telling the peers whose round barrier or merge waits for us that we are done, without the DHT in between.

A barrier (peer/round/membership.py) learns from the progress records whom it waits for; reading
those records is rate-limited by the swarm's size (``Timing.read_interval``: every N / 8 s, at most
8 s), so a barrier used to end up to one read interval after the last peer it waited for was ready.
Instead, the barrier asks each peer it waits for directly ("tell me once you are done with round
r": ``ask_ready``), and that peer holds the question open until its own state ends the wait
(protocol/round/peer_states.py ``keeps_waiting``) or the question's hold runs out, then answers with
its current progress record. A barrier's questions are bounded by whom it waits for (at most
``Timing.ready_asked_max`` peers, and one question at a time to each), not by the swarm's size.

A mixin of peer/exchange/gatherer.py's ``PayloadGatherer``: the host process stores its progress
record in memory shared with the averager process whenever it publishes one (``note_progress``);
the averager process serves ``rpc_ready`` from the last one stored. The answer is that peer's own claim about itself, exactly as its DHT record is
(the libp2p stream authenticates who answers): the asker parses it with the same
``protocol/dht/records.py`` ``parse_progress`` and acts on it only to stop waiting for that peer.
In a private run the gate of swarm/access/admission.py serves it to admitted peers only.

A round's merge (peer/round/merge.py) waits the same way for the peers of its round that have not
named their group's set: its questions (``until=SET``, sent as the request's ``group_id``) are held
while protocol/round/peer_states.py ``names_no_set_yet`` holds, and answered with the record that
names the set, which the merge would otherwise see only at its next read of the view (up to
N / 8 s later). A server that does not know the kind answers at once, and the asker asks again.
In a run that takes at most K a part the merge fetches the other groups' sets as lists
(peer/round/draw.py): its question then says so (``WITH_LIST``), and the answer carries the list of
the set the record names (``group_id``; an older server sends none). The asker keeps it only where it
checks out under that name (``_keep_named_list``, set_lists.py ``_keep_list``), and its merge's fetch
of that list is then answered from it, without a call: at 32 peers a peer fetched 5.6 lists a round,
a stream call each.

The asking side, in the host process, is ``ReadyAsks``: one barrier's questions, and their answers
laid over its view. An answer stands in for the peer's record where it came after the view's last
read began. What a barrier asks is bounded by whom it waits for: at most ``Timing.ready_asked_max``
peers (last round's groupmates first), one question in flight to each, asked again no sooner than
``Timing.ready_reask_s`` after an answer that did not end the wait, and never again in that barrier
after a question that got no answer (a peer that serves no questions, an older voloco or one behind a
NAT, is seen through the view as before); an answer that does not parse, or names another run spec,
is dropped.

Bounds of the serving side: a question is held at most ``Timing.ready_hold_s`` (and no longer than the asker asks),
``MAX_HELD`` questions at once (beyond them, answered at once), and ``QUESTIONS_PER_PEER`` running
from one caller (a limiter of their own: a caller's questions never take the slots of its gather calls); an answer over ``MAX_ANSWER_BYTES`` is refused; a list an answer carries is kept only within ``max_manifest_bytes``, and as many as
set_lists.py keeps. Guarded by tests/exchange/test_ready_notices.py, tests/round/test_ready_asks.py
and tests/exchange/test_set_lists.py
(``test_a_merges_answer_carries_the_list_of_the_set_it_names_and_the_asker_fetches_it_without_a_call``).
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import logging
import math
import multiprocessing as mp
import os
import time
from typing import Callable, Dict, Iterable, List, Optional, Set, Tuple

from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MPFuture, get_logger

from swarm.call_limits import CallLimiter
from protocol.dht.records import Progress, parse_progress
from protocol.errors import ProtocolError
from protocol.round import group_sets, set_manifests
from protocol.round.peer_states import DONE, NOT_IN_ROUNDS, keeps_waiting, names_no_set_yet
from protocol.round.timing import Timing
from swarm.records import PeerView

logger = get_logger(__name__)
peer_logger = logging.getLogger("voloco.peer")  # the asking side logs with the round's other lines

MAX_HELD = 512  # questions held open at once; more are answered at once
QUESTIONS_PER_PEER = 4  # questions one caller may have running here (a barrier asks one at a time)
MAX_ANSWER_BYTES = 4096  # a progress record is about 100 bytes
MAX_ROUND_CHARS = 12  # the asked round, as decimal digits
DONE_Q, SET = b"", b"set"  # what a question waits for: the round's steps done (a barrier), its set named (a merge)
WITH_LIST = b"list"  # a merge's question (the request's ``peer_id``): "and send the list of the set you name"


class ReadyNotices:
    """Needs of its host class: ``_p2p``, ``prefix``, ``_count``, ``_outer_pipe``, ``get_stub``,
    ``timing`` (protocol/round/timing.py) and, for the lists a merge's answer carries, set_lists.py's
    ``ListServer`` (``_manifest_of``, ``_keep_list``, ``_max_group_size``); its ``__init__`` calls
    ``_init_ready_notices`` before the averager process starts."""

    _ready_body: Optional[bytes] = None  # our last progress record (Progress.to_wire, msgpack) ...
    _ready_round, _ready_state = -1, ""  # ... what it says
    _ready_progress: Optional[Progress] = None  # ... parsed (peer/exchange/set_server.py reads it too)
    _ready_seen = 0  # the version of the shared record taken
    _ready_changed: Optional[asyncio.Event] = None  # set (and replaced) whenever our record changes
    _ready_held = 0
    _ready_watcher: Optional[asyncio.Task] = None  # takes the shared record while questions are held
    _questions: Optional[CallLimiter] = None  # QUESTIONS_PER_PEER a caller, made on the first question

    def _init_ready_notices(self) -> None:
        # our record, shared with the averager process: the heartbeat thread stores it too, and a pipe
        # written from two threads at once could interleave two messages
        self._ready_shared = mp.Array(ctypes.c_char, MAX_ANSWER_BYTES)
        self._ready_len = mp.Value(ctypes.c_int, 0, lock=False)
        self._ready_version = mp.Value(ctypes.c_int64, 0, lock=False)

    # ---- host-process API ---------------------------------------------------------------------
    def note_progress(self, body: bytes) -> None:
        """Our progress record as just published (encoded): what the peers that ask are told."""
        if len(body) > MAX_ANSWER_BYTES:
            logger.debug(f"not serving a progress record of {len(body)} bytes")
            return
        with self._ready_shared.get_lock():
            self._ready_shared[: len(body)] = bytes(body)
            self._ready_len.value = len(body)
            self._ready_version.value += 1

    def ask_ready(self, peer: str, round_no: int, wait: float, until: bytes = DONE_Q, with_list: bool = False) -> MPFuture:
        """Ask ``peer`` (base58) to answer once it is done with ``round_no`` (``until=SET``: once it
        names its group's set for it, or leaves it), or after ``wait`` s at most: a future of its
        progress record's bytes (unchecked), or None if it did not answer. ``with_list`` (a merge's
        question in a run that takes at most K): the answer may carry the list of the set the record
        names, kept here once it checks out, so that fetching that list (``fetch_manifest``) costs no call."""
        future = MPFuture()
        self._outer_pipe.send(("_ask_ready", [], dict(peer=peer, round_no=int(round_no), wait=float(wait),
                                                      until=bytes(until), with_list=bool(with_list), future=future)))
        return future

    # ---- averager-process side ----------------------------------------------------------------
    def _take_progress(self) -> None:
        """Take our record from the shared memory if it changed since last taken."""
        if self._ready_version.value == self._ready_seen:
            return
        with self._ready_shared.get_lock():
            version, body = self._ready_version.value, bytes(self._ready_shared[: self._ready_len.value])
        self._ready_seen = version
        try:
            p = parse_progress(body)
        except ProtocolError as e:  # our own record: cannot happen, but never serve what no peer could read
            logger.debug(f"not serving a progress record that does not parse: {e}")
            return
        self._ready_body, self._ready_round, self._ready_state, self._ready_progress = body, p.round, p.state, p
        changed, self._ready_changed = self._ready_changed, asyncio.Event()
        if changed is not None:
            changed.set()

    async def _watch_progress(self) -> None:
        try:
            while self._ready_held > 0:
                self._take_progress()
                await asyncio.sleep(self.timing.ready_watch_s)
        finally:
            self._ready_watcher = None

    async def _ask_ready(self, peer: str, round_no: int, wait: float, future: MPFuture, until: bytes = DONE_Q,
                         with_list: bool = False) -> None:
        request = averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=str(round_no).encode()), weight=wait,
                                              group_id=until, peer_id=WITH_LIST if with_list else b"")
        try:
            stub = self.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix)
            self._count(sent=request.ByteSize())
            answer = await asyncio.wait_for(stub.rpc_ready(request), timeout=wait + self.timing.rpc_slack_s)
            self._count(received=answer.ByteSize())
            body = answer.tensor_part.buffer
            ok = answer.code == averaging_pb2.NO_CODE and 0 < len(body) <= MAX_ANSWER_BYTES
            if ok and with_list and answer.group_id:
                try:
                    self._keep_named_list(bytes(body), round_no, bytes(answer.group_id))
                except Exception:  # a checker's bug: the list is dropped, the answer still counts
                    logger.exception(f"checking the list {peer} sent with its answer failed unexpectedly")
            future.set_result(bytes(body) if ok else None)
        except Exception as e:
            logger.debug(f"asking {peer} whether it is done with round {round_no}: {e!r}")
            future.set_result(None)

    def _keep_named_list(self, body: bytes, round_no: int, raw: bytes) -> None:
        """The list an answer carried: kept to serve (and to hand to our own merge) only where it is the
        list of the set the answer's record names, of the asked round, by the set's name (``_keep_list``);
        one already held is not checked again (every member of a group answers with its set's list)."""
        try:
            name = parse_progress(body).set_of(round_no)
        except ProtocolError:
            return
        if (name and len(raw) <= set_manifests.max_manifest_bytes(self._max_group_size)
                and self._manifest_of(name.encode()) is None):
            self._keep_list(name, raw, round_no)

    def _list_for(self, asked: int) -> bytes:
        """The list of the set our record names for round ``asked``, b"" where none is held."""
        name = self._ready_progress.set_of(asked) if self._ready_progress is not None else ""
        packed = self._manifest_of(name.encode()) if len(name) == group_sets.DIGEST_CHARS else None
        return packed or b""

    def _holds(self, asked: int, until: bytes) -> bool:
        if self._ready_body is None:
            return True
        if until == SET:
            return names_no_set_yet(self._ready_progress, asked)
        return keeps_waiting(self._ready_round, self._ready_state, asked)

    async def rpc_ready(self, request: averaging_pb2.AveragingData, context: P2PContext) -> averaging_pb2.AveragingData:
        """A barrier waiting for us asks whether we are done with its round: answered with our progress
        record once we are (or are out of rounds, or past it), held open meanwhile at most the wait it
        names (``weight``, capped at ``Timing.ready_hold_s``). A merge's question (``group_id`` SET) is
        held until our record names our group's set for the round instead; a kind we do not know is
        answered at once."""
        if self._questions is None:
            self._questions = CallLimiter(QUESTIONS_PER_PEER)
        with self._questions.admit(context.remote_id) as admitted:
            asked = request.tensor_part.buffer
            if not admitted or not 0 < len(asked) <= MAX_ROUND_CHARS or not asked.isdigit():
                return averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            self._count(received=request.ByteSize())
            round_no, until = int(asked), request.group_id
            wait = min(max(request.weight, 0.0), self.timing.ready_hold_s) if math.isfinite(request.weight) else 0.0
            if until not in (DONE_Q, SET):
                wait = 0.0
            loop = asyncio.get_running_loop()
            deadline = loop.time() + wait
            self._take_progress()
            if self._ready_held < MAX_HELD:
                self._ready_held += 1
                if self._ready_watcher is None:
                    self._ready_watcher = asyncio.create_task(self._watch_progress())
                try:
                    while self._holds(round_no, until) and loop.time() < deadline:
                        if self._ready_changed is None:
                            self._ready_changed = asyncio.Event()
                        try:
                            await asyncio.wait_for(self._ready_changed.wait(), deadline - loop.time())
                        except asyncio.TimeoutError:
                            break
                finally:
                    self._ready_held -= 1
            if self._ready_body is None:
                return averaging_pb2.AveragingData(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
            msg = averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=self._ready_body))
            if until == SET and request.peer_id == WITH_LIST:
                msg.group_id = self._list_for(round_no)
            self._count(sent=msg.ByteSize())
            return msg


# ---- the asking side: one barrier's questions (host process) ------------------------------------
class ReadyAsks:
    """``notices``: what asks (peer/exchange/ready_notices.py's ``ask_ready``: peer, round, wait ->
    a future of bytes or None); ``digest``: our run spec's, the only one an answer may name.
    ``until``: DONE_Q (a barrier's questions) or SET (a merge's)."""

    def __init__(self, notices, round_no: int, digest: str, timing: Timing, clock: Optional[Callable[[], float]] = None,
                 until: bytes = DONE_Q, with_list: bool = False):
        self.notices, self.round_no, self.digest, self.timing = notices, round_no, digest, timing
        self.until, self.with_list = until, with_list
        self.clock = clock if clock is not None else time.monotonic
        self._asked: Dict[str, object] = {}  # peer -> the future of the question in flight
        self._answers: Dict[str, Tuple[float, Progress]] = {}  # peer -> (when it came, what it said)
        self._silent: Set[str] = set()  # asked and not answered: not asked again in this barrier
        self.asked = 0  # questions sent (for the tests and the log)
        self._key = os.urandom(16)

    def ask(self, peers: Iterable[str], first: Set[str] = frozenset()) -> None:
        """Ask each of ``peers`` (those the barrier still waits for; ``first``: asked before the rest)
        that has no question in flight, within the bound."""
        self._collect()
        now = self.clock()
        # the bound counts questions in flight; the order past the mates is a keyed hash, so that no
        # peer id chosen to sort first takes every slot
        wanted = sorted((p for p in set(peers) if p not in self._silent),
                        key=lambda p: (p not in first, hashlib.blake2b(p.encode(), key=self._key).digest()))
        for peer in wanted[: self.timing.ready_asked_max]:
            if peer in self._asked:
                continue
            answered = self._answers.get(peer)
            if answered is not None and now - answered[0] < self.timing.ready_reask_s:
                continue
            try:
                self._asked[peer] = self.notices.ask_ready(peer, self.round_no, self.timing.ready_hold_s, until=self.until,
                                                           with_list=self.with_list)
                self.asked += 1
            except Exception as e:  # the averager process is gone (stopping): the view alone
                peer_logger.debug(f"could not ask {peer} whether it is done with round {self.round_no}: {e!r}")
                self._silent.add(peer)

    def _collect(self) -> None:
        for peer, future in list(self._asked.items()):
            if not future.done():
                continue
            del self._asked[peer]
            try:
                body = future.result()
            except Exception:
                body = None
            progress = self._parse(peer, body)
            if progress is None:
                self._silent.add(peer)
            else:
                self._answers[peer] = (self.clock(), progress)

    def _parse(self, peer: str, body: Optional[bytes]) -> Optional[Progress]:
        if body is None:
            return None
        try:
            progress = parse_progress(body)
        except ProtocolError as e:
            peer_logger.debug(f"{peer} answered whether it is done with a record that does not parse: {e}")
            return None
        return progress if progress.spec == self.digest else None

    def overlay(self, views: List[PeerView], read_began: float) -> List[PeerView]:
        """``views`` with each record replaced by the answer of its peer where that answer shows it further
        on (a later round, or done with the same one), or as far on and came after the view's read began
        (``read_began``, on this object's clock): a read can carry a record older than an answer (the
        answer is sent before the record is stored), and an answer can be older than a read."""
        self._collect()
        if not self._answers:
            return views
        out = []
        for v in views:
            at, answer = self._answers.get(v.peer_id, (None, None))
            if answer is not None and (self._further(answer, v.progress)
                                       or (not self._further(v.progress, answer) and at > read_began)):
                v = PeerView(peer_id=v.peer_id, progress=answer, expires=v.expires)
            out.append(v)
        return out

    def _further(self, a: Progress, b: Progress) -> bool:
        """``further``; for a merge's questions, of two records of the same round, one that names the round's set."""
        if self.until == SET and a.round == b.round and a.state not in NOT_IN_ROUNDS and b.state not in NOT_IN_ROUNDS:
            if bool(a.set_of(self.round_no)) != bool(b.set_of(self.round_no)):
                return bool(a.set_of(self.round_no))
        return further(a, b)


def further(a: Progress, b: Progress) -> bool:
    """Whether record ``a`` shows its peer further on than record ``b``: a later round, or done with the same one."""
    return (a.round, a.state in DONE) > (b.round, b.state in DONE)
