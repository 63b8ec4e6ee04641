"""The round barrier: ``BarrierWait`` (a mixin of peer/round/membership.py's ``Membership``, reading its
view of the progress records, timing, no-show ledger and budget for strangers) waits until the live
peers of a round are ready for its exchange, or until waiting longer is not worth it (the straggler
allowance past the last arrival, the budget for strangers, ``swarm.round_wait``); ``Barrier`` is
what it found: whom the round's exchange can meet, and the group size its gather aims for. peer/round/loop.py decides the exchange's
next step from it (protocol/round/round_policy.py); guarded by tests/round/test_liveness.py and
tests/round/test_rejoin.py."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Callable, Container, Iterable, List, Optional, Set, Tuple

from peer.exchange.ready_notices import ReadyAsks
from peer.round.start_waits import names as _names
from protocol.dht.records import Progress
from protocol.round.peer_states import DONE, EXCHANGING, IN_ROUND, NOT_IN_ROUNDS, STARTING, TRAINING, WAITING
from protocol.round.round_policy import sync_target
from swarm.records import PeerView

logger = logging.getLogger("voloco.peer")


@dataclass
class Barrier:
    """What the wait before a round's exchange found."""

    expected: int  # group size to expect: this peer and every peer of its round that is ready
    alone: bool  # no other live peer at all
    behind: bool  # the swarm is at a later round
    only_syncing: bool = False  # every other live peer is downloading the state of an earlier round
    ready: frozenset = frozenset()  # the other peers of the round that were ready (they may gather in other groups)
    gave_up: frozenset = frozenset()  # the peers of the round it stopped waiting for (still training, or stalled)
    unawaited: frozenset = frozenset()  # peers of the round still coming that it did not wait for (they may not send)
    # it ended with strangers still coming: its "exchanging" is stored at once, so that a peer still
    # waiting for them alone sees it has moved on (peer/round/membership.py ``_barrier``)
    left_strangers: bool = False

    @property
    def nobody_to_meet(self) -> bool:
        return self.alone or (self.behind and self.expected == 1)

    @property
    def gather_size(self) -> int:
        """The group size the gather aims for: the ready peers and us, and at least a pair while
        peers of the round are still coming (nobody ready yet is no reason to train alone: the gather
        waits for one of them, until the round's wait ends or every other peer has gathered)."""
        return max(self.expected, min(2, 1 + len(self.gave_up | self.unawaited)))

    def without(self, refused: frozenset) -> "Barrier":
        """This barrier with ``refused`` (whom this round's matchmaking refuses) not among the ready: a
        group's target keeps no seat for a peer that may not take it (the leader would wait out its
        matchmaking for it). tests/round/test_rejoin.py::test_a_silent_groupmate_the_barrier_does_not_wait_for_takes_no_seat"""
        out = self.ready & refused
        return replace(self, expected=self.expected - len(out), ready=self.ready - out) if out else self


def meet_round(peer, awaited: Optional[Callable]) -> Tuple[Barrier, Set[str]]:
    """``peer``'s barrier of its engine's round, and last round's groupmates (peer/round/loop.py): the
    members last round judged (``RoundRecord.judged``) are neither mates nor peers still exchanging the
    round before. ``awaited``: with K a part, only peers that may send are waited for (here and in the merge)."""
    engine = peer.engine
    last = peer.totals.history[-1] if peer.totals.history else None
    mates, judged, refused = (last.mates(peer.peer_id), last.judged(peer.peer_id), last.refused()) \
        if last is not None and last.round == engine.round else (set(), set(), set())
    barrier = peer.membership.wait_for_round(engine.round, mates, first_round=peer.totals.rounds == 0, known=engine.standing,
                                             awaited=awaited, notices=peer.gatherer, judged=judged, refused=refused)
    return barrier, mates


class BarrierWait:
    """``Membership``'s wait before a round's exchange (see the module docstring)."""

    def wait_for_round(self, round_no: int, mates: Set[str], first_round: bool, known: Container[str] = (),
                       awaited: Optional[Callable[[str, Progress], bool]] = None, notices=None,
                       judged: Container[str] = (), refused: Iterable[str] = ()) -> Barrier:
        """Wait until every live peer of ``round_no`` is ready: at most ``swarm.round_wait``, and at
        most the straggler allowance past the last time a peer of the round became ready.

        ``mates``: last round's groupmates (those still finishing it train this round with us); any
        other peer still exchanging the round before is waited for too.
        ``first_round``: peers still "waiting" for the start quorum, or "starting" in this round (their
        process up, their model and data still loading), are about to train it too: a peer that trained
        a swarm's first round alone beside one still starting put the two on two lineages, and where it
        cannot serve its state (``--client-mode``) the other could not take it, so the two trained apart
        for a minute (tests/round/test_liveness.py
        ``test_a_first_round_waits_for_a_peer_still_starting_in_it_and_no_longer_than_the_allowance``). Peers
        waited for in vain and not in our last group are not waited for a while. ``known``: senders
        with standing in our lineage, no strangers: a wait for strangers alone lasts what
        ``self.wait_budget`` grants. ``awaited`` (peer id, record): whether a peer other than a mate
        is worth waiting for at all (a round of at most K contributions: those that may send,
        peer/round/draw.py ``awaited``); None: everyone (tests/round/test_awaited.py). ``notices``: what
        asks the peers waited for directly (peer/exchange/ready_notices.py ``ReadyAsks``); None: the view alone.
        ``judged``: last round's members that are no mates (``RoundRecord.judged``: sent nothing, held our
        requests, or strangers no longer waited for): no peers still exchanging the round before, only
        peers of this round once they train it (a new identity that held a group was waited for a whole
        allowance the next round, its record alive for its TTL; an honest newcomer on a slow link, cut
        as a stranger, may miss its second round so, once: it is known from then on;
        test_a_member_that_held_last_round_is_not_waited_for_while_it_finishes_it). Peers our
        matchmaking refuses now are not waited for at all (``refused_now``). ``refused``: senders whose
        contribution last round's checks refused: no acquaintances from it (``WaitBudget.forget``;
        test_a_sender_whose_update_was_refused_is_still_a_stranger)."""
        self._note_group(mates, round_no)
        self.wait_budget.forget(refused)
        self.wait_budget.lineage(known)
        start = time.monotonic()
        cap = self.straggler_allowance()
        budget = self.strangers_grant(start, cap)  # one read of the view at least (no_show_views.py)
        deadline = start + self.timing.round_wait_s
        busy = (TRAINING, WAITING, STARTING) if first_round else (TRAINING,)
        try:
            asks = ReadyAsks(notices, round_no, self.digest, self.timing, time.monotonic) if notices is not None else None
            return self._barrier(round_no, mates, busy, start, cap, budget, deadline, awaited, asks, judged)
        finally:
            self.waiting_for_strangers.clear()  # whatever ended the wait, an exception included

    def _most_moved_on(self, ready: List[PeerView], round_no: int) -> bool:
        """Whether more than half the ready peers of ``round_no`` we know, still matchmaking, say "exchanging"."""
        struck = self.silent.skipped(round_no)
        known = [v for v in ready if not self.wait_budget.stranger(v.peer_id) and v.peer_id not in self.no_shows
                 and v.peer_id not in struck and not v.progress.set_of(round_no)]
        return 2 * sum(v.progress.state == EXCHANGING for v in known) > len(known)

    def _barrier(self, round_no: int, mates: Set[str], busy: tuple, start: float, cap: float, budget: float,
                 deadline: float, awaited: Optional[Callable[[str, Progress], bool]] = None,
                 asks: Optional[ReadyAsks] = None, judged: Container[str] = ()) -> Barrier:
        """``wait_for_round``'s loop: read the view (and ``asks``' answers) until the round's peers are ready."""
        last_arrival = start
        arrived: Set[str] = set()
        lost = False
        while True:
            view = self.view()
            if asks is not None:
                view = asks.overlay(view, self.read_began)
            mine = [v for v in view if v.progress.round == round_no and v.peer_id != self.peer_id]
            ready = [v for v in mine if v.progress.state in DONE]
            # and peers still exchanging the round before (a group whose exchange ended first would take this
            # round alone: tests/round/test_ready_asks.py); last round's groupmates in any state of a round
            pending = [v for v in mine if v.progress.state in busy] + [
                v for v in view if v.progress.round == round_no - 1 and (
                    (v.progress.state in DONE and v.peer_id not in judged) or (v.peer_id in mates and v.progress.state not in NOT_IN_ROUNDS))
            ]
            coming = [v for v in pending if v.peer_id not in self.no_shows]
            worth = [v for v in coming if awaited is None or v.peer_id in mates or awaited(v.peer_id, v.progress)]
            # a peer our matchmaking refuses now takes no seat: given up at once (``refused_now``)
            struck, shunned = self.refused_now(round_no, mates, (v.peer_id for v in worth))
            pending = [v for v in worth if v.peer_id not in shunned]
            now = time.monotonic()
            if {v.peer_id for v in ready} - arrived:
                arrived |= {v.peer_id for v in ready}
                last_arrival = now
            strangers = bool(pending) and all(self.wait_budget.stranger(v.peer_id) for v in pending)
            allowance = budget if strangers and self.wait_budget.limiting else cap
            if strangers and self.wait_budget.limiting:
                self.waiting_for_strangers.set()
            else:
                self.waiting_for_strangers.clear()
            # most ready peers we know that are still matchmaking (no no-show, none we refuse, no set named)
            # have left their barriers: they did not wait for these strangers (their budgets are not ours),
            # and their group forms without us if we do (bench/hostile.py --attacks lurk-fresh). Most, not
            # one: a known identity saying "exchanging" early cannot end our waits for newcomers alone
            moved_on = strangers and self.wait_budget.limiting and self._most_moved_on(ready, round_no) and (
                now - last_arrival > min(cap, self.read_interval() + self.read_latency()))  # one read at least
            late = now - last_arrival > allowance or moved_on
            if self.lost_sight() and now <= deadline and not self.stop.is_set():
                if not lost:
                    lost = True
                    logger.info(f"round {round_no}: the last read found no other peer, though {len(self._live_seen)} "
                                f"were live in the last {self.timing.live_memory_ttls * self.ttl():.0f} s: reading again")
                time.sleep(self.timing.view_poll_s)
                continue
            if not pending or late or now > deadline or self.stop.is_set():
                # the strangers refused are struck as if waited for in vain, members struck already are not
                waited = pending + [v for v in worth if v.peer_id in shunned - struck]
                self._waited, self._waited_round = {v.peer_id for v in waited}, round_no
                # (one still in the round before has come once it trains this round at all: step -1)
                self._waited_steps.update({v.peer_id: v.progress.step if v.progress.round == round_no else -1 for v in waited})
                if strangers:
                    self.wait_budget.spend(now - last_arrival, now, cap)
                if pending and moved_on:
                    logger.info(f"round {round_no}: a peer we know has left its barrier: not waiting longer for "
                                f"{_names(v.peer_id for v in pending)}, new to us")
                elif pending and late:
                    short = " (what the budget for strangers holds)" if allowance < cap else ""
                    logger.info(f"round {round_no}: not waiting longer than {allowance:.1f} s past the last arrival{short} "
                                f"for {_names(v.peer_id for v in pending)}")
                others = [
                    v for v in view
                    if v.peer_id != self.peer_id and v.progress.state not in NOT_IN_ROUNDS and v.peer_id not in self.absent
                ]
                behind = sync_target({v.peer_id: v.progress.round for v in others}, self.known(),
                                     {v.peer_id for v in others if v.progress.state in IN_ROUND})[0] > round_no
                syncing = bool(others) and all(v.progress.state == "syncing" and v.progress.round < round_no for v in others)
                return Barrier(expected=1 + len(ready), alone=not others, behind=behind, only_syncing=syncing,
                               ready=frozenset(v.peer_id for v in ready), gave_up=frozenset(self._waited | shunned),
                               unawaited=frozenset(v.peer_id for v in coming) - self._waited - shunned,
                               left_strangers=(strangers and bool(pending)) or any(self.wait_budget.stranger(p) for p in shunned))
            if asks is not None:  # still waiting: ask whom it waits for directly
                asks.ask((v.peer_id for v in pending), first=mates)
            time.sleep(self.timing.view_poll_s)
