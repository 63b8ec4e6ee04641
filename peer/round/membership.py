"""Who is in the run, as this peer sees it: heartbeat, view, start quorum and the round barrier (the
waits before round 0, the slice choice and the start quorum, are peer/round/start_waits.py's; the
barrier's wait loop is peer/round/barrier.py's).

Every peer publishes a progress record (protocol/dht/records.py) under the run's key whenever its state
changes, and refreshes it while nothing changes every third of its TTL (at most every
``swarm.heartbeat_period``); it reads everyone's to decide whom to wait for. Records are read through
``swarm.records`` (hivemind's DHT). Every read moves every peer's signed record, so a peer reads at
most every ``Timing.read_min_s`` and, in a larger swarm, every ``N / Timing.swarm_reads_per_s`` seconds: the
swarm's reads stay near ``swarm_reads_per_s`` a second however many peers it has (at a fixed rate
per peer, a large swarm's reads time out, views come back partial and peers train alone). Callers
in between share the last view (tests/round/test_control_plane.py). A read that fails or misses records
keeps the last view's records until they expire, and ``Timing.missed_reads_kept`` read intervals
more: a record is never removed from the DHT before its expiration, so a record missing from one
read is a read that did not reach it, not a peer that left (on a loaded host a peer's keep-alive
store and two reads can all be late within one TTL, and a view that dropped such records would stay
partial, short of its start quorum); a slow DHT never stops training, and never makes the swarm
look empty: a view with no other live peer while a read of the last ``Timing.live_memory_ttls`` record
TTLs found some is reads that missed them, and the round barrier reads again (until
``swarm.round_wait``) instead of training alone (tests/round/test_liveness.py).

A record is a claim, not a promise: a peer may announce that it trains this round and never come.
The round barrier therefore waits for announced peers only a *straggler allowance* past the last
moment another peer of the round became ready (half this peer's own training time of the round, at
least ``Timing.straggler_min_s``); peers it waited for in vain get strikes and are skipped for a
while, and a wait for strangers alone (fresh identities) lasts what a budget grants
(protocol/round/no_shows.py: a staller costs about one allowance per ``Timing.forgive_after_rounds``
rounds, a new identity every round a bounded share of wall time, while an honest peer that fell
behind once is waited for again as soon as it comes: tests/round/test_rejoin.py). In a round of at
most K contributions a part, only the peers that may send it are waited for (``awaited``:
peer/round/draw.py; tests/round/test_awaited.py). The barrier also asks the peers it waits for
directly to answer once they are done (peer/exchange/ready_notices.py), so it need not wait for the
next read of the view to see them ready. A round far ahead of everyone is not believed either: "the
swarm's round" is one that two peers we know, or a strict majority of those we see, have reached
(``sync_target``), and peers that state sync caught lying (a state it refused, none served) are left
out of the view for a while (``ignore``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Deque, Dict, FrozenSet, List, Optional, Sequence, Set

from hivemind.utils import get_dht_time

from peer.round.barrier import BarrierWait
from peer.round.no_show_views import NoShows
from peer.round.start_waits import StartWaits
from protocol.round import peer_states
from protocol.round.start_vote import swarm_lineage, table_split
from protocol.round.state_sources import LeftOut
from protocol.round.named_sets import NamedSets
from protocol.round.no_shows import NoShowLedger, WaitBudget, claimed_elsewhere
from protocol.round.peer_states import DONE, NOT_IN_ROUNDS
from protocol.dht.records import Progress, encode_body, peer_record_ttl
from protocol.spec import RunSpec
from protocol.round.timing import Timing
from swarm.records import PeerView, publish_progress, read_progress

logger = logging.getLogger("voloco.peer")

# NOT_IN_ROUNDS (protocol/round/peer_states.py): peers that take no part in rounds: stopped, or not yet
# (booting, waiting for a chain, or a chain stage still connecting to its neighbours: a chain that
# cannot link never trains). A peer never waits for them; one that went ahead alone meanwhile is
# caught up with (downloaded) when they start.

LATENCIES_KEPT = 5  # reads whose durations give the host's DHT read latency


class Membership(NoShows, StartWaits, BarrierWait):
    """This peer's progress record in the DHT and its view of everyone else's."""

    def __init__(self, dht, spec: RunSpec, peer_id: str, progress: Callable[[], Progress], stop: threading.Event,
                 timing: Optional[Timing] = None):
        self.dht, self.spec, self.peer_id, self.stop = dht, spec, peer_id, stop
        # the records of our spec carry this digest: computed once (a pydantic dump, ~50 us), not per
        # record at every poll of the view
        self.digest = spec.digest()
        self.timing = timing if timing is not None else Timing.from_spec(spec)  # every wait of the round
        self._progress = progress
        self._publishing = threading.Lock()  # one record read and stored at a time (publish)
        self._thread: Optional[threading.Thread] = None
        self.no_shows: Set[str] = set()  # waited for in vain: not waited for a while (protocol/round/no_shows.py)
        self.absent: Set[str] = set()  # ... and not seen to come since: nobody to meet either
        self.ledger = NoShowLedger.from_timing(self.timing)
        self._came: Dict[int, Set[str]] = {}  # round -> senders whose signed payload was in our union
        # waits for strangers (fresh identities): half of their share of any window (protocol/round/no_shows.py)
        self.wait_budget = WaitBudget(self.timing.vain_wait_share / 2, self.timing.budget_after_rounds)
        # set while the round barrier waits for strangers alone: an overlapped peer's steps pause meanwhile,
        # so that such a wait costs time from the budget, not steps on the old θ (peer/round/loop.py)
        self.waiting_for_strangers = threading.Event()
        # groupmates that joined a group of ours and sent nothing: not matched with for a while
        self.silent = NoShowLedger.from_timing(self.timing)
        # the time strangers cost in our groups, the other half: while in debt, our matchmaking admits none (no_show_views.py)
        self.stranger_seats = WaitBudget(self.timing.vain_wait_share / 2, 0)
        self._waited: Set[str] = set()  # whom the last barrier gave up waiting for
        self._waited_round = -1  # ... in which round
        self._waited_steps: Dict[str, int] = {}  # ... at which inner step of it
        self._carried: Dict[str, int] = {}  # peers waited for in a round they are still coming to -> that round
        self._training_since: Optional[float] = None
        self._left_out = LeftOut()  # peers whose records are left out of the view, until when, and why
        self.train_seconds = 0.0  # this peer's training time of its last round
        self._read_lock = threading.Lock()  # one DHT read at a time; callers meanwhile share its result
        self._views: List[PeerView] = []  # the last view read (every spec, nobody left out)
        self.named_sets = NamedSets()  # what the records read named of their groups' sets (adopt.adopt_round_set)
        self._latencies: Deque[float] = deque(maxlen=LATENCIES_KEPT)  # seconds the last reads took
        self._read_at: Optional[float] = None
        self.read_began = float("-inf")  # when the view's last DHT read began (monotonic)
        self._published: Optional[tuple] = None  # (monotonic time, what others act on) of the last record stored
        self._live_seen: Dict[str, float] = {}  # other peer -> when a read last found it live (in rounds)
        # what answers the barriers that ask us directly (peer/exchange/ready_notices.py): told every record we store
        self.tell: Optional[Callable[[bytes], None]] = None

    # ---- our record -----------------------------------------------------------------------------
    def ttl(self) -> float:
        return peer_record_ttl(self.spec.swarm.heartbeat_period)  # a busy peer's heartbeat may be late

    def keepalive_s(self) -> float:
        """How often an unchanged progress record is stored again."""
        return self.timing.keepalive(self.ttl())

    def publish(self, only_if_due: bool = False) -> None:
        """Store this peer's progress record; with ``only_if_due``, only if something other peers act
        on changed (``peer_states.acted_on``) or the last one is a keep-alive period old (the heartbeat).
        One at a time: the heartbeat's record, read before a state change, is never stored after the
        change's (tests/round/test_control_plane.py::test_a_heartbeat_never_stores_a_state_older_than_the_last_stored)."""
        with self._publishing:
            self._publish(only_if_due)

    def _publish(self, only_if_due: bool) -> None:
        try:
            progress = self._progress()
            now, key = time.monotonic(), peer_states.acted_on(progress)
            if only_if_due and self._published is not None:
                at, last = self._published
                if last == key and now - at < self.keepalive_s():
                    return
            self._note_state(progress.state)
        except Exception as e:
            logger.debug(f"could not publish progress: {e!r}")
            return
        self._tell(progress)
        try:
            publish_progress(self.dht, self.spec.run_id, self.peer_id, progress, ttl=self.ttl())
            self._published = (now, key)
        except Exception as e:
            logger.debug(f"could not publish progress: {e!r}")

    def _tell(self, progress: Progress) -> None:
        """What a barrier asking us directly is told (peer/exchange/ready_notices.py), before the store."""
        if self.tell is not None:
            try:
                self.tell(encode_body(progress.to_wire()))
            except Exception as e:
                logger.debug(f"could not tell the gatherer our progress: {e!r}")

    def _note_state(self, state: str) -> None:
        """Time this peer's training (every state change is published): the straggler allowance scales with it."""
        if state == "training":
            if self._training_since is None:
                self._training_since = time.monotonic()
        elif self._training_since is not None:
            self.train_seconds = time.monotonic() - self._training_since
            self._training_since = None

    def start_heartbeat(self, extra: Callable[[], None]) -> None:
        """Publish every heartbeat period from a thread of its own, then call ``extra``."""

        def loop() -> None:
            while not self.stop.wait(self.timing.heartbeat_s):
                self.publish(only_if_due=True)
                try:
                    extra()
                except Exception as e:
                    logger.debug(f"heartbeat: {e!r}")

        self._thread = threading.Thread(target=loop, daemon=True, name="heartbeat")
        self._thread.start()

    # ---- everyone's ---------------------------------------------------------------------------------
    def read_interval(self) -> float:
        """The least time between two DHT reads of the progress records, for the swarm last seen."""
        return self.timing.read_interval(len(self._views))

    def view(self, read_since: Optional[float] = None) -> List[PeerView]:
        """Every progress record of this run spec (our own included), read at most every ``read_interval``;
        and now where the last read began at or before ``read_since`` (monotonic: a round's merge needs one
        read begun past its gather, peer/round/merge.py; tests/round/test_control_plane.py)."""
        with self._read_lock:
            if (self._read_at is None or time.monotonic() - self._read_at >= self.read_interval()
                    or (read_since is not None and self.read_began <= read_since)):
                began = time.monotonic()
                self._views = self._read(began)
                self.named_sets.note(self._shown(self._views))
                self._read_at, self.read_began = time.monotonic(), began
                self._latencies.append(self._read_at - began)
            views = self._views
        return self._shown(views)

    def _shown(self, views: List[PeerView]) -> List[PeerView]:
        """The records of ``views`` of this run spec, but a peer's we ignore for lying (``ignore``)."""
        now = time.monotonic()
        return [v for v in views if v.progress.spec == self.digest and not self._left_out.hides(v.peer_id, now)]

    def read_latency(self) -> float:
        """How long a DHT read of the progress records takes on this host now: the median of the
        last ``LATENCIES_KEPT`` reads (0 before any); matchmaking's timeouts stretch with it."""
        with self._read_lock:
            recent = sorted(self._latencies)
        return recent[len(recent) // 2] if recent else 0.0

    def fresh_view(self, since: float, timeout: float) -> List[PeerView]:
        """``view()`` from a DHT read that began after ``since`` (monotonic), waiting out the read
        interval for it; after ``timeout`` seconds, the latest view there is."""
        deadline = time.monotonic() + timeout
        views = self.view()
        while self.read_began <= since and time.monotonic() < deadline and not self.stop.is_set():
            time.sleep(min(self.timing.view_poll_s, self.read_interval()))
            views = self.view()
        return views

    def _read(self, began: float) -> List[PeerView]:
        """A fresh read, with the last view's unexpired records it missed (see the module doc).
        Unexpired when the read began: on a loaded host one read can outlast a record's TTL."""
        try:
            fresh = read_progress(self.dht, self.spec.run_id)
        except Exception as e:  # the DHT being slow must not stop training
            logger.debug(f"could not read progress records: {e!r}")
            fresh = []
        seen = {v.peer_id for v in fresh}
        self._note_live(fresh)
        at_start = get_dht_time() - (time.monotonic() - began)
        grace = self.timing.missed_reads_kept * self.read_interval()
        return fresh + [v for v in self._views if v.peer_id not in seen and v.expires + grace > at_start]

    def ignore(self, peer_id: str, seconds: float, lied: bool = True) -> None:
        """Leave ``peer_id``'s records out of the view for ``seconds`` (it was caught lying, or was silent)."""
        now = time.monotonic()
        self._left_out.leave_out(peer_id, now + seconds, now, lied)

    def lied(self, peer_id: str) -> bool:
        """Whether ``peer_id`` is left out of the view now for lying."""
        return self._left_out.lied(peer_id, time.monotonic())

    def others(self, excluding=NOT_IN_ROUNDS) -> List[PeerView]:
        return [v for v in self.view() if v.peer_id != self.peer_id and v.progress.state not in excluding]

    def lineage(self, round_no: int, part: int) -> str:
        """The start most of the peers of ``round_no`` (of ``part``) that we know hold, as our view shows:
        named to our group for its start vote (protocol/round/start_vote.py ``swarm_lineage``)."""
        return swarm_lineage(((v.peer_id, v.progress.params_hash) for v in self._in_round(round_no, part)), self.known())

    def table_split(self, round_no: int, part: int, sends: str, theta: str, digest: str) -> FrozenSet[str]:
        """The peers of ``round_no`` (of our ``part`` and ``sends``) we know that hold our θ ``theta`` with
        other lineage tables, where most peers at that θ do (protocol/round/start_vote.py ``table_split``)."""
        return table_split(((v.peer_id, v.progress.params_hash, v.progress.state_digest)
                            for v in self._in_round(round_no, part) if v.progress.sends == sends),
                           self.peer_id, theta, digest, self.known())

    def _in_round(self, round_no: int, part: int) -> List[PeerView]:
        """The records of the view of peers of ``part`` taking part in ``round_no``."""
        return [v for v in self.view() if v.progress.round == round_no and v.progress.part == part
                and v.progress.state not in NOT_IN_ROUNDS]

    def swarm_is_empty(self) -> bool:
        """No other live peer in the view, and none in a read of the last ``Timing.live_memory_ttls`` TTLs."""
        return not self.others() and not self._seen_live_lately()

    def _note_live(self, fresh: Sequence[PeerView]) -> None:
        now, digest = time.monotonic(), self.digest
        for v in fresh:
            if v.peer_id == self.peer_id or v.progress.spec != digest:
                continue
            if v.progress.state in NOT_IN_ROUNDS:
                # read, and not in rounds (stopped, restarting, a chain stage back to linking): not a
                # missed read. A stage that cannot link flips between "syncing" and "linking"; kept
                # here, it would have the round's barrier read again for nothing
                # (tests/round/test_liveness.py, test_a_peer_read_again_out_of_rounds_is_not_a_missed_read)
                self._live_seen.pop(v.peer_id, None)
            else:
                self._live_seen[v.peer_id] = now
        self._live_seen = {p: t for p, t in self._live_seen.items() if t > self._live_horizon()}  # bounded by the live swarm

    def _live_horizon(self) -> float:
        return time.monotonic() - self.timing.live_memory_ttls * self.ttl()

    def _seen_live_lately(self) -> bool:
        """Whether a read of the last ``Timing.live_memory_ttls`` record TTLs found another peer live (not a no-show)."""
        horizon = self._live_horizon()
        return any(t > horizon and p not in self.no_shows for p, t in self._live_seen.items())

    def lost_sight(self) -> bool:
        """Whether the view shows no other live peer while a read of the last ``Timing.live_memory_ttls``
        record TTLs found some (not no-shows): the reads missed them, not a swarm that left: those
        that stop say so, and a killed peer's record stays for its TTL. Never true once they have
        been out of sight that long (tests/round/test_liveness.py,
        ``test_reads_that_miss_every_peer_seen_live_lately_are_no_empty_swarm``)."""
        return not self.others() and self._seen_live_lately()

    def straggler_allowance(self) -> float:
        """How long past the last arrival a ready peer still waits for peers announced in its round."""
        return self.timing.straggler_allowance(self.train_seconds)

    def _note_group(self, mates: Set[str], round_no: int) -> None:
        """Last round's group was ``mates`` (+ us): whom we waited for in vain is skipped for a while.

        A peer still coming (in the round it was waited in, done training it or its step advanced) is
        slower than us, not absent: judged again at the next barriers for at most ``Timing.carry_rounds``
        rounds, lest the peers still matchmaking when a large swarm's first pair gathers be no-shows
        to it (``test_peers_still_coming_to_the_round_are_judged_later_not_struck``)."""
        candidates = {**self._carried, **{p: self._waited_round for p in self._waited}}
        view = self.view()
        by_peer = {v.peer_id: v.progress for v in view}
        claimed = {r: claimed_elsewhere(((v.peer_id, v.progress.gathered_round, v.progress.gathered) for v in view), r)
                   for r in set(candidates.values())}
        self._carried, missing = {}, set()
        for peer, r in candidates.items():
            if peer in mates or peer in self._came.get(r, ()):
                continue  # it came: a groupmate, or its signed payload is in our union of the round
            p = by_peer.get(peer)
            # waited for while still exchanging the round before: came only if that exchange named a set or
            # sent us its payload (test_a_peer_one_round_behind_for_ever_is_struck)
            finished = self._waited_steps.get(peer) != -1 or (
                p is not None and (bool(p.set_of(r - 1)) or peer in self._came.get(r - 1, ())))
            coming = p is not None and p.round == r and finished and (
                p.state in DONE or (p.state == "training" and p.step > self._waited_steps.get(peer, p.step)))
            # (a record saying it ended the round is a claim, no appearance: it stays a stranger to the budget;
            # a new identity claimed so to be waited for the whole allowance the next round)
            if coming and r >= round_no - self.timing.carry_rounds:
                self._carried[peer] = r
            elif not (peer in claimed[r] and self.ledger.excuse(peer, round_no)):  # a claim excuses it now and then
                missing.add(peer)
        self.wait_budget.met(mates)
        for peer in mates:
            self.ledger.came(peer, round_no)
        self._waited_steps = {p: self._waited_steps[p] for p in self._carried if p in self._waited_steps}
        self._waited = set()
        self.missed(missing, round_no)
