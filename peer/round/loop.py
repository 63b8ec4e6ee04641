"""A peer's round loop: H inner steps, then the round's exchange, with or without overlap.

Sequential (``outer.overlap = false``, and always on a chain stage, whose neighbours train in
lockstep with it): train, wait for the round's peers, gather, apply, evaluate, checkpoint, then
the next round's first step.

Overlapped (the one-step-delayed outer update of docs/round.md, "Overlap"; the default):
at the end of round t the peer holds ``θ_send``; it hands the payload of ``Δ_t`` to a thread of its
own that waits for the round's peers, gathers, decodes and takes the outer step on θ (the global
parameters, which every member computes bit-identically from the same payloads), then evaluates
and checkpoints, while the inner steps of round t + 1 go on from ``θ_send``. At the first step
boundary after the exchange ended, the model continues from ``θ_{t+1} + (θ_now − θ_send)``: the
steps taken meanwhile stay as a local delta, which the next pseudo-gradient ``θ_{t+1} − θ_end``
carries into round t + 1. If the next round's steps end (or reach ``outer.max_overlap`` × H) first,
the loop waits for the exchange (one at most in flight; tests/outer/test_overlap.py).
A round that found no group leaves θ as it was (its signal stays in the strategy's buffers, as in
the sequential loop) and the local delta is kept the same way.

Evaluation runs on a copy of the role's model (peer/training/evaluator.py) and the checkpoint
holds the inner optimizer and the batch stream as they were when the round's payload was made,
so neither stalls the inner steps.

Mixed speeds (peer/round/early_close.py): a peer still training when most of its round is ready closes
the round after at least ``outer.min_inner_fraction`` of H and contributes what it has. A chain closes
as one replica: its first stage decides and sends ``close`` down its links; the others stop there.

Each step of the exchange (gather, adopt a set, train alone, defer and catch up, stop) is decided by
protocol/round/round_policy.py from the facts this loop gathers; it ends in an agreed set, a state caught
up, or a stop.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Dict, Optional

import torch

from peer.checkpoints import contents as checkpoints
from peer.checkpoints import schedule
from peer.round.barrier import meet_round
from peer.round.busy_advice import BusyAdvisor, RoundTime
from peer.round.early_close import EarlyClose, min_steps
from peer.round.handoff import Handoff, InnerSteps, continue_from
from peer.round.adopt import adopt_own_set, adopt_round_set, lineage_named
from peer.round.merge import merge_round, no_group_left
from peer.round import draw, union
from peer.round.report import RoundMeters, RoundRecord, log_phases, log_round, states_of, write_status
from peer.training.evaluator import RoundEvaluator
from peer.training.roles import ChainStage, RoundAbandoned
from protocol.round import reconcile, round_policy
from protocol.round.round_policy import Step
from protocol.round.start_vote import majority_hash

logger = logging.getLogger("voloco.peer")


class RoundLoop(InnerSteps):
    def __init__(self, peer, threads=None):
        self.peer = peer
        self.threads = threads  # the peer's share of the host's CPU threads (peer/host/cpu_share.py), None: fixed
        spec = peer.spec
        self.overlap = bool(spec.outer.overlap) and not isinstance(peer.role, ChainStage)
        # the fewest steps before a round may close early; a chain's later stages follow its first (Role.decides_close)
        self.min_steps = min_steps(spec.outer.inner_steps, spec.outer.min_inner_fraction)
        # steps taken ahead of an exchange in flight before the loop waits for it (outer.max_overlap, rounded down; H: never)
        self.max_ahead = max(1, math.floor(spec.outer.max_overlap * spec.outer.inner_steps + 1e-9))
        self.early = EarlyClose(peer.membership, peer.peer_id, peer.stop_event, enabled=self.min_steps < spec.outer.inner_steps)
        self.evaluator = RoundEvaluator(peer.engine, peer.corpus.per_byte, peer.val) if self.overlap else None
        self.advisor = BusyAdvisor(spec.outer.inner_steps, self.overlap, spec.outer.max_overlap)  # the H that keeps it busy
        self._thread: Optional[threading.Thread] = None
        self._sent: Optional[Dict[str, torch.Tensor]] = None  # θ_send: the model when its payload was made
        self._error: Optional[BaseException] = None
        self._restart = False  # the exchange found no group: the steps taken meanwhile start nothing
        self._hold = False  # the exchange in flight is one the next round's steps do not overlap (_holds)
        self._linked = False  # a chain stage whose chain has trained a round (its links come up each round)
        self.closed_early = 0  # rounds this peer closed early (fewer than H steps)
        self._overlapped = 0  # steps of the current round taken while an exchange was in flight
        self._meters = RoundMeters(peer)  # wire bytes and helper processes' CPU, round by round
        self._quiet_mates: Dict[str, int] = {}  # groupmates that left the merge agreement waiting, until a round
        self._merge_skip: Dict[str, int] = {}  # peers other groups' merges do not wait for, until a round
        self._last_round: Optional[union.LastRound] = None  # what concluding the last round again takes

    # ---- the exchange in flight -----------------------------------------------------------------
    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def rounds_started(self) -> int:
        """Rounds whose inner steps are done: the engine's round, and one more while its exchange runs."""
        return self.peer.round + (1 if self.in_flight else 0)

    def defers_load(self) -> bool:
        """Whether θ must not be loaded now: the inner loop loads it, with the local delta, at its next step."""
        return self._thread is not None and threading.current_thread() is self._thread

    def finish(self) -> bool:
        """Wait for the exchange in flight, then continue from θ + (model − θ_send). False when that
        exchange found no group: then, as in the sequential loop, the round's signal stays in the
        strategy's buffers, the model restarts from θ (the swarm's, if it was ahead and this peer
        caught up) and so does the round (the steps taken meanwhile were from a stale start)."""
        thread = self._thread
        if thread is None:
            return True
        thread.join()
        self._thread, self._hold = None, False
        peer, sent, self._sent = self.peer, self._sent, None
        restart, self._restart = self._restart, False
        with peer.engine.lock:
            if restart:
                peer.role.load_theta(peer.engine.theta)
            else:
                continue_from(peer.role.params, peer.engine.theta, sent)
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return not restart

    def drain(self) -> None:
        """On the way out: let the exchange in flight end, never raise."""
        try:
            self.finish()
        except Exception as e:
            logger.error(f"the last round's exchange failed: {e!r}")

    # ---- one round ------------------------------------------------------------------------------
    def one_round(self) -> None:
        peer = self.peer
        engine, role, spec = peer.engine, peer.role, peer.spec
        t0 = time.monotonic()
        if self.threads is not None:
            self.threads.refresh()  # in this thread: torch's thread count is taken per thread
        if not self.in_flight:
            # a chain not linked yet is not waited for by the round's other peers ("linking" is not in
            # rounds); once it has trained a round its stages count as training from the round's start
            peer._set_state("linking" if isinstance(role, ChainStage) and not self._linked else "training")
        try:
            losses, round_start = self._inner_steps(spec.outer.inner_steps)
        except RoundAbandoned:
            self._linked = False
            self.drain()
            peer._recover()
            return
        self._linked = True
        if losses is None or not self.finish():
            return  # stopping, or restarting the round from the swarm's θ
        t_train = time.monotonic()
        self._meters.exchange_began()
        if not self.overlap:
            cpu0 = time.thread_time()
            payload, pending = engine.encode(round_start, role.params, len(losses))
            peer._set_state("ready")
            self._exchange(Handoff(payload, pending, losses, t0, t_train, time.monotonic(), overlapped=self._overlapped,
                                   cpu0=cpu0))
            return
        # overlap: the payload is encoded in the exchange's thread from a snapshot of the model, so the next
        # round's steps start at once (on a GPU the encode takes about a third as long as H = 30 steps)
        handoff = Handoff(None, None, losses, t0, t_train, t_train, overlapped=self._overlapped)
        if schedule.checkpoint_due(peer):
            handoff.trainer = checkpoints.trainer_snapshot(role)
        self.evaluator.prepare(role)  # its copy of the model, made here where no step runs
        with torch.no_grad():  # what the payload is encoded from: the part this peer sends (not a partial peer's frozen slices)
            self._sent = {n: p.detach().clone() for n, p in role.params.items() if n in engine.strategy.layout}
        round_start = engine.theta  # θ of this round: the exchange before it has ended
        self._hold = self._holds()
        self._thread = threading.Thread(target=self._exchange_in_background, args=(handoff, round_start, self._sent),
                                        daemon=True, name=f"exchange-{engine.round}")
        self._thread.start()

    def _holds(self) -> bool:
        """Whether the next round's steps wait for this exchange instead of overlapping it: while this
        peer has concluded no round, its barrier waits a whole straggler allowance for every peer
        announced in the round (the budget for strangers does not bound it yet), and a staller
        announced there would otherwise turn that wait into steps on the old θ, where they cost most:
        at the start of training. The whole exchange is waited for, gather and evaluation included
        (bench/RESULTS.md, "Stallers cost time, not loss"; tests/outer/test_overlap.py)."""
        return not self.peer.membership.wait_budget.limiting

    # ---- the exchange ---------------------------------------------------------------------------
    def _exchange_in_background(self, handoff: Handoff, round_start, sent) -> None:
        """Encode the round's payload (θ_round_start − θ_send), then exchange it."""
        try:
            handoff.cpu0 = time.thread_time()
            handoff.payload, handoff.pending = self.peer.engine.encode(round_start, sent, len(handoff.losses))
            handoff.t_encode = time.monotonic()
            if not self.peer.stop_event.is_set():
                self.peer._set_state("ready")
            self._exchange(handoff)
        except BaseException as e:  # re-raised by finish(), in the inner loop's thread
            logger.exception(f"round {self.peer.round}: the exchange failed")
            self._error = e
        finally:
            if self.peer.state in ("ready", "exchanging") and not self.peer.stop_event.is_set():
                self.peer._set_state("training")  # the inner steps of the next round are under way

    def _exchange(self, h: Handoff) -> None:
        """Wait for the round's peers, gather, apply; then evaluate, checkpoint and report."""
        peer, engine = self.peer, self.peer.engine
        last = peer.totals.history[-1] if peer.totals.history else None
        barrier, mates = meet_round(peer, draw.awaited(engine, engine.params_hash()))
        t_wait = time.monotonic()
        # sets of the last round that a slower group named after our merge stopped waiting: taken first, or
        # the swarm goes on with two θ (peer/round/union.py ``take_named_sets``)
        late = union.take_named_sets(peer, self._last_round)
        start_hash = engine.params_hash()
        # θ of this round downloaded, no groupmates: the lineage of the state's server (peer/round/state_sync.Basis)
        basis = peer.sync.basis.lineage(engine.round, start_hash) if peer.sync.basis and not mates else None
        has_lineage = bool(mates) or basis is not None  # whose set of the round we may take (peer/round/adopt.py)
        named = barrier.nobody_to_meet and not barrier.alone and has_lineage and lineage_named(peer, engine.round, mates)
        # each step of the exchange is protocol/round/round_policy.py's decision, from the facts gathered here
        step = round_policy.after_barrier(peer.stop_event.is_set(), barrier.nobody_to_meet, named)
        if step is Step.STOP:
            return
        peer.state = "exchanging"
        if barrier.left_strangers:  # stored at once: peers still waiting for them alone follow us (Barrier)
            peer.membership.publish()
        result = None
        counted = (peer.gatherer.bytes_sent, peer.gatherer.bytes_received)  # the whole exchange's, fetches of sets included
        if step is Step.GATHER:  # (nobody of our round left to meet: no group, catch up)
            # the only others are catching up to an earlier round (a chain stage that cannot link does,
            # again and again): give them the straggler allowance to join, not the whole round_wait
            short = barrier.expected == 1 and barrier.only_syncing
            refused = peer.membership.refused(engine.round, barrier.gave_up | barrier.unawaited)
            give_up = no_group_left(peer, engine.round, time.monotonic(), barrier.gave_up | refused)  # (never met)
            seats = barrier.without(refused)  # the group's target counts the ready peers we do not refuse
            result = peer.gatherer.gather(
                engine.round, h.payload, start_hash=start_hash, expected_size=seats.gather_size,
                timeout=peer.membership.straggler_allowance() if short else peer.membership.timing.round_wait_s,
                give_up=give_up, refused=refused, admitted=peer.membership.admitted(), ready=seats.ready,
                lineage=peer.membership.lineage(engine.round, peer.role.progress_part),  # for the start vote
                leaders=peer.membership.leaders(barrier.ready), known=peer.membership.known(), read_latency=peer.membership.read_latency(),
                last=union.announce(self._last_round, engine), **draw.senders(engine, start_hash, h.payload, peer.peer_id),
            )
            # given up while matchmaking (give_up.fired): our payload went nowhere, only a set of our lineage
            # can be taken (adopt_round_set); with none (a fresh start) the swarm's state is taken at once
            step = round_policy.after_gather(result is not None, give_up.fired, has_lineage, peer.stop_event.is_set())
        merged = None
        timing = peer.membership.timing
        if step in (Step.ADOPT_ROUND_SET, Step.ADOPT_OWN_SET):  # (a set holding our payload, or our lineage's)
            wait = timing.no_group_wait(peer.membership.read_interval())
            result = adopt_round_set(peer, engine.round, start_hash, max(wait, timing.set_fetch_s), lineage=mates, basis=basis) \
                if step is Step.ADOPT_ROUND_SET else adopt_own_set(peer, engine.round, h.payload, start_hash, wait, lineage=mates, basis=basis)
            step = round_policy.after_adopt(result is not None)
        if step is Step.NO_GROUP:
            step = round_policy.without_group(barrier.alone or peer.membership.swarm_is_empty() or peer.membership.cut_off(engine.round))
        if step is Step.ALONE:
            seen = [v for v in peer.membership.view() if v.peer_id != peer.peer_id]
            if seen:  # records, but none of a peer that takes part in rounds, or only of peers we refuse
                logger.info(f"round {engine.round}: training alone: no other peer in rounds that we match with ({states_of(seen)})")
        elif step is Step.DEFER:
            engine.defer(h.pending)
            self._restart = self.overlap
            logger.warning(f"round {engine.round}: found no group; keeping this round's update locally")
            peer._load_theta()
            # a lineage of its own: a solo last round, or none since this process started (a peer restarted
            # from a checkpoint of its solo rounds may be rounds ahead of the swarm; tests/round/test_state_sources.py)
            peer.sync.catch_up(solo=last is None or last.group == [peer.peer_id])
            # the status says so too (its round, a state it installed, its wire bytes): a slow peer whose
            # every round ends here would otherwise keep its start-up status
            write_status(peer.opts.status_file, peer.status())
            return

        t_gather = time.monotonic()
        payloads = result.payloads if result is not None else {peer.peer_id: h.payload}
        excluded = dict(result.excluded) if result is not None else {}
        # the group's union of the last round first (peer/round/union.py): θ recomputed where it grew, so
        # that this round's draw is seeded by, and its outer step taken from, the θ every member holds
        taken = union.take_group_union(peer, self._last_round, result) if result is not None else None
        by_list = getattr(engine.strategy, "max_contributions", 0) > 0  # only the drawn payloads fetched
        for mate in (result.held | result.lagged) if result is not None else ():  # held our requests: its merge answer may be too
            self._quiet_mates[mate] = max(self._quiet_mates.get(mate, 0), engine.round + 1)
        if result is not None and result.set_digest:  # other groups of the round: one θ from all their sets
            merged = merge_round(peer, engine.round, result, barrier.ready, self._merge_skip, gave_up=barrier.gave_up,
                                 quiet=self._quiet_mates, by_list=by_list, notices=peer.gatherer,
                                 awaited=draw.awaited(engine, engine.params_hash()))  # the seed after the union's repair
        t_merged = time.monotonic()  # the union's repair and the merge of the round's other groups' sets
        chosen, invalid, passed, senders, excluded = draw.contributions(peer, merged, payloads, excluded, timing.set_fetch_s)
        decoded, bad = engine.decode(chosen)
        invalid.update(bad)
        for sender, why in invalid.items():
            logger.warning(f"round {engine.round}: rejected the payload of {sender}: {why}")
        if passed:
            ours = ("ours waits for a later round" if peer.peer_id in passed
                    else "ours among them" if peer.peer_id in senders else "this peer sent none")
            logger.info(f"round {engine.round}: {len(chosen)} of {len(senders)} contributions enter θ "
                        f"(outer.max_contributions = {engine.strategy.max_contributions} a part; {ours})")
        excluded.update(invalid)
        # silent: sent nothing in time (agreed); held: held our requests while its payload reached the group
        # (our own judgement: it served some members and held us, and each member it held refuses it)
        peer.membership.came_in(engine.round, (s for s in senders if s not in excluded),
                                silent=(m for m, why in excluded.items() if why == reconcile.SILENT),
                                held=result.held if result is not None else (), lagged=result.lagged if result is not None else (), cost_s=t_gather - t_wait)
        group_hash = None
        if taken is not None:
            # each member's start counted as what it holds after the union. A group votes with its members'
            # announcements only (their starts, and the lineage each one's view named): every member holds
            # the same ones, so all decide alike
            starts = taken.keys
            voters_out = {**result.excluded, **invalid}  # the same on every member
            group_hash = majority_hash(starts, voters_out, me=peer.peer_id, unservable=result.unservable,
                                       named=result.lineages, announced=result.start_hashes)
            peer.sync.consistent = taken.holds and starts.get(peer.peer_id, start_hash) == group_hash
            if not peer.sync.consistent:
                peer.gathered_from = ""  # our θ is not the one our group's set was applied to
                logger.error(
                    f"round {engine.round}: this peer started from parameters {starts.get(peer.peer_id, start_hash)}, "
                    f"its group's start vote chose {group_hash}; it will download that state after this round"
                )
        split = frozenset()  # peers at our θ whose lineage tables most of them share and we do not
        if group_hash is not None and peer.sync.consistent and not late and not taken.taken:
            # (a set taken this round changed our tables; the others' records may not show theirs yet)
            theta, digest = engine.hashes()
            split = peer.membership.table_split(engine.round, peer.role.progress_part, peer.role.progress_sends, theta, digest)
            if split:
                peer.sync.consistent, peer.gathered_from = False, ""
                logger.error(f"round {engine.round}: this peer holds the swarm's θ {theta} with other standing and "
                             f"eligibility tables (state digest {digest}) than {len(split)} peers at that θ: an earlier "
                             f"round's union differed unseen; it will download their state after this round")
        with engine.lock:
            # what concluding this round again takes, should the next round's group hold a set we lack
            # a drawn payload we could not fetch leaves θ short of what (base, sets) names: no base is
            # announced then, and the next round's start vote sends us to the group's θ (peer/round/draw.py)
            self._last_round = None if merged is None or draw.NOT_FETCHED in excluded.values() else union.LastRound(
                engine.round, engine.snapshot(), merged.held, base=engine.params_hash(), lists=merged.lists)
            settled = engine.conclude(decoded, h.pending, delivered=peer.peer_id in senders and peer.peer_id not in excluded,
                                      excluded=excluded, me=peer.peer_id, passed=passed)
            peer._load_theta()
            if self._last_round is not None:
                self._last_round.settle(engine)
        if not peer.stop_event.is_set():
            # θ of the next round is known: its inner steps are under way (overlap) or come next (none done
            # yet); "exchanging" in a round not trained yet would count as done with it (peer_states.keeps_waiting)
            peer.step = peer.step if self.overlap else 0
            peer._set_state("training")
        sent, received = (peer.gatherer.bytes_sent - counted[0], peer.gatherer.bytes_received - counted[1]) \
            if result is not None else (0, 0)
        peer.totals.bytes_sent += sent
        peer.totals.bytes_received += received
        peer.totals.rounds += 1
        t_apply = time.monotonic()
        record = RoundRecord(
            round=engine.round,
            params_hash=engine.params_hash(),
            group=sorted(result.group) if result is not None else [peer.peer_id],  # every member, contributing or not
            contributors=settled.contributors,  # the direction check's refusals and copies not counted
            excluded=settled.excluded,  # the group's, the decoder's and the outer step's
            bytes_sent=sent, bytes_received=received,
            held=sorted(result.held | result.lagged) if result is not None else [],
            loss=sum(h.losses) / len(h.losses),  # NaN on a chain stage other than the last
            val_loss=float("nan"),
            seconds=0.0,
            waited=t_wait - h.t_encode, gather_s=t_gather - t_wait, merge_s=t_merged - t_gather,
            steps=len(h.losses),
            clipped=dict(settled.clipped), short=dict(settled.short),
            overlapped=h.overlapped,
            sets=merged.sets if merged is not None else 1,
            exchange_cpu=time.thread_time() - h.cpu0,
        )
        if not peer.sync.consistent:  # repair before reporting: the round ends with the group's parameters
            sources = set(split) or (None if result is None else {
                m for m, hsh in starts.items() if hsh == group_hash and m != peer.peer_id
            })
            peer.sync.catch_up(even_at_same_round=True, only=sources)
            record.params_hash = engine.params_hash()
            record.resynced = peer.sync.consistent  # False: no groupmate served the round's state in time
        t_eval = time.monotonic()
        peer.val_loss = record.val_loss = self.evaluator.evaluate() if self.evaluator is not None else peer._evaluate()
        record.seconds, record.ended = time.monotonic() - h.t0, time.time()
        log_phases(record.round - 1, h.t0, h.t_train, h.t_encode, t_wait, t_gather, t_apply, t_eval, time.monotonic())
        record.util = peer.util.round_done()
        advice = self.advisor.note(RoundTime(record.util, peer.util.last_steps, peer.util.last_busy,
                                               time.monotonic() - h.t_train, record.waited))
        self._meters.fill(record)
        peer.totals.history.append(record)
        if h.trainer is not None or (not self.overlap and schedule.checkpoint_due(peer)):
            schedule.checkpoint_round(peer, h.trainer)  # written in the background, at a bounded cost
        peer.sync.enable_sharing()
        peer.membership.publish(only_if_due=True)  # losses and tokens alone wait for the keep-alive
        write_status(peer.opts.status_file, peer.status())
        log_round(record, peer.tokens_per_s)
        if advice:
            logger.info(advice)
        # a lineage that found a group of its own but fell rounds behind the swarm (restarts, a split)
        # takes the swarm's state now, or the two go on apart for as long as each finds a group; a
        # solo round's lineage (cut off) takes it even from an earlier round once the swarm is back
        before = engine.round
        peer.sync.catch_up(solo=result is None)  # only when the swarm is at a later round (round_policy.sync_target)
        if engine.round != before and not peer.stop_event.is_set():
            self._restart = self.overlap  # the steps taken meanwhile started from the stale θ
