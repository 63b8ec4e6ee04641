"""Every wait of a peer's round, in one object: derived from the spec's ``[swarm]`` section, with
the host's measured DHT read latency where a wait stretches with it.

No other module holds a wait constant: the round's collaborators (membership, the round loop, the
merge of a round's sets, state sync, the exchange) are each given the peer's ``Timing`` and read
their waits from it. A wait decides only how long a peer waits, never what a round contains.

Each field says which wait it sets and why it has its value; the methods are the formulas that
combine them. Guarded by tests/protocol/test_timing.py (and, for each wait's effect, the tests its field names).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Tuple


@dataclass(frozen=True)
class Timing:
    # ---- from the spec's [swarm] section ---------------------------------------------------------
    matchmaking_s: float = 3.0
    """``swarm.matchmaking_time``: a leader's least wait for followers before it closes a group."""
    gather_slot_s: float = 30.0
    """``swarm.gather_timeout``: the deadline of each round of a group's agreement, and of one state download."""
    round_wait_s: float = 60.0
    """``swarm.round_wait``: the longest a peer waits for its round's peers, and for a group to form."""
    heartbeat_s: float = 2.0
    """``swarm.heartbeat_period``: how often the heartbeat thread may store the progress record."""

    # ---- the round barrier and the view (peer/round/membership.py) -------------------------------
    straggler_min_s: float = 5.0
    """The least a ready peer waits past the last arrival for peers that announced the round
    (tests/round/test_liveness.py)."""
    straggler_fraction: float = 0.5
    """... and at most this fraction of its own training time of the round, if that is longer."""
    vain_wait_share: float = 0.1
    """What strangers (peers never seen to come: fresh identities) may cost over any window, as a share
    of wall time, plus one allowance and one exchange: half for the barrier's waits for them that end
    without them (protocol/round/no_shows.py's ``WaitBudget``), half for the time they cost in a
    peer's groups (peer/round/no_show_views.py ``_charge_strangers``). With a tenth each, a new
    silent identity every round stretched rounds 1.27-1.31x (bench/RESULTS.md): the two budgets add up."""
    budget_after_rounds: int = 1
    """... from this peer's this many concluded rounds on: at a run's start, or a restart, everyone is
    a stranger to it, and is waited for the whole allowance in its first round."""
    read_min_s: float = 0.5
    """A peer reads the progress records at most this often (tests/round/test_control_plane.py) ..."""
    swarm_reads_per_s: float = 8.0
    """... and at most N / this often in a swarm of N peers: the swarm's reads stay near this rate."""
    read_max_s: float = 8.0
    """... and never less often than this: forged identities cannot slow the view down further."""
    view_poll_s: float = 0.25
    """Between two looks at the view while waiting on it (barrier, merge, adopting a set)."""
    merge_read_after_s: float = 1.0
    """A round's merge reads the view this long past its gather where no read began meanwhile: the read
    that lets it end. Not at once (a read right after the gather missed late groups' sets in a first
    round), nor at the view's schedule (N / 8 s: up to 8 s of every round in a large swarm); 1 s is the
    schedule of an 8-peer swarm, whose merges always waited so (peer/round/merge.py)."""
    ready_hold_s: float = 10.0
    """A barrier's question to a peer it waits for ("tell me once you are done with this round":
    peer/exchange/ready_notices.py ``ReadyAsks``) is held open by that peer at most this long, then asked again ..."""
    ready_reask_s: float = 1.0
    """... and asked again no sooner than this after an answer that did not end the wait for that peer."""
    ready_watch_s: float = 0.05
    """While questions are held, how often the averager process looks at the record the host shares with it."""
    ready_asked_max: int = 32
    """The most peers one barrier asks directly (the rest it sees through the view alone)."""
    pause_poll_s: float = 0.02
    """Between two looks at the flags an overlapped peer's steps pause on (the barrier's wait for strangers,
    the group's wait for a member that sent nothing: peer/round/loop.py ``_pause_for_no_shows``)."""
    keepalive_ttl_fraction: float = 1 / 3
    """An unchanged record is stored again every this fraction of its TTL (at least a heartbeat)."""
    missed_reads_kept: int = 2
    """A record missing from reads stays in the view this many read intervals past its expiry."""
    live_memory_ttls: int = 2
    """A peer seen live within this many record TTLs makes an empty view a missed read."""
    empty_view_wait_s: float = 5.0
    """The least a partial run's new peer watches the others choose (and at least two heartbeats)
    before it chooses its slice."""
    carry_rounds: int = 2
    """Rounds a peer still coming to a round we waited for it in is judged again before it is a no-show."""
    max_skip_rounds: int = 32
    """A peer waited for in vain again and again is skipped for at most this many rounds (tests/round/test_rejoin.py)."""
    keep_local_rounds: int = 3
    """A state installed at most this many rounds past the peer's own keeps its local buffers (SparseLoCo's
    error feedback, DCT's momentum, DiLoCo's pending update): the rounds it missed (no group found, a
    short stall) count later instead of being lost. Further ahead, or behind, they are of a θ the swarm
    has left, and are zeroed (tests/round/test_liveness.py)."""
    forgive_after_rounds: int = 16
    """A no-show's strikes fall by one for every this many rounds without a miss (protocol/round/no_shows.py):
    a peer that stalls whenever it is waited for costs about one wait per this many rounds."""
    excuse_every_rounds: int = 16
    """A claim of having gathered in another group excuses a miss at most once per this many rounds."""

    # ---- early close (peer/round/early_close.py) -----------------------------------------------
    early_close_poll_s: float = 1.0
    """Between two reads of the progress records while a round is armed to close early
    (tests/round/test_control_plane.py)."""

    # ---- the matchmaking (peer/exchange/matchmaking.py, peer/exchange/gatherer.py) --------------
    latency_timeouts: float = 3.0
    """A matchmaking request waits at least this many DHT read latencies for its answer
    (tests/exchange/test_matchmaking_times.py)."""
    give_up_poll_s: float = 0.5
    """How often a gather still looking for a group asks whether one can still form
    (tests/exchange/test_gather_give_up.py)."""
    answer_grace_s: float = 3.0
    """Once every other sender's payload of a group has come (or its fetch failed), a sender that has
    sent none of its own yet is waited for at least this much longer, then not asked again in the group
    (its payload left to the others' relays: protocol/round/fetch_clock.py); an overlapped peer's steps
    pause meanwhile. Honest senders measured on loopback began at most 0.1 s after the others' payloads,
    84 of them with 8 peer processes on 2 cores (bench/RESULTS.md, "A silent groupmate's grace, paused");
    the floor is what a member that learns of its group late needs (two asks of a leader, a second
    ``late_join_pause_s`` after the first: peer/exchange/late_join.py) and a fetch's retries
    (1.5 s of backoff: peer/exchange/bounds.py) ..."""
    answer_grace_factor: float = 1.0
    """... or this many times as long as the others' payloads took, if longer (never to the deadline)."""
    prepare_s: float = 30.0
    """The longest the averager process may take to take a round's payload and settings."""

    # ---- the round's sets (peer/round/merge.py, peer/exchange/set_server.py) --------------------
    set_fetch_s: float = 10.0
    """The most one fetch of another group's set may take (tests/round/test_group_merge.py) ..."""
    set_fetch_min_s: float = 1.0
    """... and the least time a fetch is given, however little of the merge's wait is left."""
    merge_skip_rounds: int = 8
    """Rounds a peer the merge waited for in vain is not waited for again (and a quiet groupmate
    waited for only ``quiet_mate_s``)."""
    mate_answer_min_s: float = 2.0
    """The least a groupmate's answer about its merge is waited for."""
    quiet_mate_s: float = 1.0
    """How long a groupmate that did not say lately which sets it merged is waited for."""
    gathering_extra_slots: int = 2
    """Gather slots longer a peer waits while peers of the round that finished training have named no set."""
    merged_wait_max_s: float = 600.0
    """The longest a groupmate's question about our merge is held open here (tests/exchange/test_merged_lists.py)."""
    merged_poll_s: float = 0.1
    """Between two looks at our own merge while a groupmate's question waits for it."""
    pipe_slack_s: float = 5.0
    """What a call to the averager process may take beyond the wait it carries."""
    rpc_slack_s: float = 1.0
    """What a question to a groupmate may take beyond the wait it asks the groupmate to hold it."""
    retry_first_pause_s: float = 0.1
    """A gather call that failed quickly (a reset stream, a group not open there yet) is tried again
    after this pause, doubling (tests/exchange/test_exchange_bounds.py) ..."""
    retry_longest_pause_s: float = 1.0
    """... up to this pause, until its deadline."""
    late_join_pause_s: float = 1.0
    """Between two passes over this round's leaders asking for a group that names us (peer/exchange/late_join.py)."""

    # ---- state sync (peer/round/state_sync.py) ---------------------------------------------------
    refuse_source_s: float = 600.0
    """A peer that served a state we refused is left out of the view for this long (tests/round/test_state_sources.py)."""
    silent_source_s: float = 60.0
    """... one that claimed a round we need and served nothing (no answer, too slow)."""
    record_lag_rounds: int = 3
    """A served state may be this many rounds past its server's record read after the download: a record
    is stored every heartbeat, and rounds of a small run end faster (a netns run at 1.5 s a round: every
    server refused, and hidden for ``refuse_source_s``, for a state 2-3 rounds past its record)."""
    retry_target_s: float = 60.0
    """A round no peer could serve is not chased again sooner (tests/round/test_liveness.py)."""
    download_pause_s: float = 1.0
    """The pause before the next download of a catch-up, longer by this after each failure."""
    recheck_s: float = 1.0
    """Beyond two read intervals, how long a fresh view is waited for before a state is refused."""
    download_min_rate: float = float(1 << 20)
    """Bytes/s: a state download slower than this on top of its per-frame timeout is given up."""
    serves_at_once: int = 2
    """State downloads this peer serves at the same time, strangers never all of them (protocol/round/serve_gate.py)."""
    serves_per_peer: int = 8
    """... downloads one peer may begin within ``serve_window_s`` (a catch-up asks one source up to 3 times, a round
    may catch up more than once)."""
    serve_window_s: float = 60.0
    """... the window those are counted over."""

    # ---- chain stages (peer/chain/stage.py) -------------------------------------------------------
    chain_poll_s: float = 1.0
    """Between two reads of the chain assignments while a candidate waits for a chain."""
    chain_redial_s: float = 0.5
    """Between two reads of the next stage's endpoint, and between two passes over its addresses."""
    chain_call_s: float = 30.0
    """The longest a stage's listener or link set-up may take on its event loop."""
    chain_retarget_s: float = 10.0
    """The longest the listener takes to expect another round or neighbour."""

    # ---- the host (peer/host/lifecycle.py) -------------------------------------------------------
    settle_s: float = 0.3
    """On stop, before p2pd closes its connections: the last bytes reach the kernel's counters."""

    @classmethod
    def from_spec(cls, spec) -> "Timing":
        """The waits of a run: the spec's [swarm] values, the fixed ones at their defaults."""
        s = spec.swarm
        return cls(matchmaking_s=float(s.matchmaking_time), gather_slot_s=float(s.gather_timeout),
                   round_wait_s=float(s.round_wait), heartbeat_s=float(s.heartbeat_period))

    def with_(self, **changes) -> "Timing":
        """A copy with some waits changed (a test's shorter poll, say)."""
        return replace(self, **changes)

    # ---- the formulas ------------------------------------------------------------------------------
    def read_interval(self, records: int) -> float:
        """The least time between two DHT reads of the progress records, in a swarm of ``records``."""
        return min(self.read_max_s, max(self.read_min_s, records / self.swarm_reads_per_s))

    def keepalive(self, ttl: float) -> float:
        """How often an unchanged progress record of TTL ``ttl`` is stored again."""
        return max(self.heartbeat_s, self.keepalive_ttl_fraction * ttl)

    def straggler_allowance(self, train_seconds: float) -> float:
        """How long a ready peer waits past the last arrival for peers that announced the round,
        having trained it for ``train_seconds`` itself (never past ``round_wait_s``)."""
        allowance = max(self.straggler_min_s, 2 * self.heartbeat_s, self.straggler_fraction * train_seconds)
        return min(allowance, self.round_wait_s)

    def empty_view_wait(self) -> float:
        return max(2 * self.heartbeat_s, self.empty_view_wait_s)

    def matchmaking(self, read_latency: float, limit: float) -> Tuple[float, float]:
        """(a leader's wait for followers, a follower's wait for a leader's answer) on a host where one
        DHT read takes ``read_latency`` s: ``matchmaking_s`` and a third of it, the answer's wait
        stretched to ``latency_timeouts`` read latencies (and the leader's to three answers) on a
        loaded host, at most ``limit``."""
        request = max(self.matchmaking_s / 3, self.latency_timeouts * max(0.0, read_latency))
        wait = min(max(self.matchmaking_s, 3 * request), max(self.matchmaking_s, limit))
        return wait, min(request, wait / 3)

    def answer_grace(self, others_took: float) -> float:
        """How long a group's sender that has sent none of its payload is waited for once the other
        senders' payloads took ``others_took`` seconds to come."""
        return max(self.answer_grace_s, self.answer_grace_factor * others_took)

    def merge_allowance(self, straggler: float, matchmaking_wait: float) -> float:
        """How long past the last set that came in a peer waits for the round's other groups: another
        group may form and agree as late as a gather's deadline after ours, plus two matchmakings."""
        return max(straggler, self.gather_slot_s) + 2 * max(self.matchmaking_s, matchmaking_wait)

    def gathering_extra(self) -> float:
        """How much longer the merge waits while a peer it waits for has finished training."""
        return self.gathering_extra_slots * self.gather_slot_s

    def mate_merge_bound(self) -> float:
        """The longest a groupmate's merge may run, counted from the start of ours: its wait
        (``round_wait_s`` and the gathering extra), a fetch begun at its end, and a gather slot of
        skew between our group's members' starts."""
        return self.round_wait_s + (self.gathering_extra_slots + 1) * self.gather_slot_s + self.set_fetch_s

    def recheck_wait(self, read_interval: float) -> float:
        """How long state sync waits for a fresh view before it refuses a state."""
        return 2 * read_interval + self.recheck_s

    def no_group_wait(self, read_interval: float) -> float:
        """How long a peer whose gather failed looks for its group's set before it defers the round."""
        return 2 * read_interval + self.matchmaking_s
