"""Whom this peer waits for and matches with, from what the round's groups and barriers saw: strikes
for peers waited for in vain (the barrier's ledger), strikes for groupmates that sent nothing or held
our requests (the matchmaking's refusals), the budget for waits for strangers, and the budget for the
time strangers cost in our groups (protocol/round/no_shows.py ``WaitBudget``, both).
A mixin of peer/round/membership.py's ``Membership``, which owns the ledgers; guarded by
tests/round/test_rejoin.py and tests/round/test_strangers.py."""

from __future__ import annotations

import logging
import time
from typing import Container, Iterable, Optional, Set, Tuple

from peer.round.start_waits import names as _names
from swarm.records import PeerView

logger = logging.getLogger("voloco.peer")

# the most a stranger's cost in our groups is remembered: a gather can last this many slots (its
# agreement rounds and their fetches), so one held to the end is charged in full
STRANGER_DEBT_SLOTS = 6


class NoShows:
    """``Membership``'s strikes and refusals (see the module docstring)."""

    def came_in(self, round_no: int, senders: Iterable[str], silent: Iterable[str] = (), held: Iterable[str] = (),
                cost_s: float = 0.0, lagged: Iterable[str] = ()) -> None:
        """The senders whose signed payload is in this peer's union of round ``round_no``: they came
        (the next barrier does not strike them, and a single strike of theirs is over). ``silent``:
        groupmates the gather excluded for sending nothing in time (alike on every member); ``held``:
        groupmates that held this peer's requests while its payload reached the group anyway (cut a grace
        after the others' payloads, or a later agreement round's request held to its deadline: this
        peer's own judgement). A strike each in ``self.silent``; this peer's matchmaking refuses them
        meanwhile (``refused``), so one that joins groups only to stall them costs a grace per skip
        period, not per round; one that serves its payload to some members and holds the others is
        refused by every member it held (tests/round/test_rejoin.py). ``cost_s``: how long the round's
        matchmaking and gather took, charged when a stranger among them held it (``_charge_strangers``).
        ``lagged``: strangers a later agreement round stopped waiting for (peer/exchange/agreement_rounds.py):
        charged too, but no strike (an honest newcomer on a slow link answers late as well)."""
        silent = set(silent) - {self.peer_id}  # (a generator: read once)
        held = set(held) - {self.peer_id} - silent
        lagged = set(lagged) - {self.peer_id}
        strangers = {p for p in silent | held | lagged if self.wait_budget.stranger(p)}  # before anything marks them met
        senders = set(senders) - {self.peer_id}
        self._came.setdefault(round_no, set()).update(senders)
        self.wait_budget.met(senders)
        self.wait_budget.concluded()
        for r in [r for r in self._came if r < round_no - self.timing.carry_rounds - 1]:
            del self._came[r]  # bounded: only rounds the barrier may still judge
        for peer in senders:
            self.ledger.came(peer, round_no)
            if peer not in held:
                self.silent.came(peer, round_no)
        for struck, why in ((silent, "in our group, they sent nothing in time"), (held, "in our group, they held our requests")):
            if struck:
                until = {p: self.silent.missed(p, round_no + 1) for p in struck}  # judged for the next round's matchmaking
                logger.info(f"round {round_no}: not matching with {_names(struck)} until round {min(until.values())}: {why}")
        if strangers:
            self._charge_strangers(round_no, strangers, cost_s)
        self._refresh_no_shows(round_no)

    def came_late(self, round_no: int, senders: Iterable[str]) -> None:
        """Senders whose signed payload a set taken after ``round_no`` concluded put into our union of it,
        counted (peer/round/union.py ``take_named_sets``): they came, as ``came_in``'s senders do, so the
        barrier waits again for a slower honest group the merge struck while it has a single strike
        (its skip ends). Nothing else of that round is judged again, and a groupmate's refusal for
        sending us nothing (``silent``) stands: its payload in another group's set does not undo that
        (tests/round/test_late_sets.py)."""
        senders = set(senders) - {self.peer_id}
        if round_no in self._came:
            self._came[round_no].update(senders)
        self.wait_budget.met(senders)
        for peer in senders:
            self.ledger.came(peer, round_no)
        self._refresh_no_shows(round_no + 1)  # (the round under way)

    def _charge_strangers(self, round_no: int, strangers: Set[str], cost: float) -> None:
        """New identities (``strangers``: never seen to come, no standing) joined our group and sent
        nothing or held our requests: the matchmaking's and gather's time (``cost``) is charged to ``stranger_seats``, which
        refills at half of ``Timing.vain_wait_share`` of wall time; while it is in debt, our matchmaking admits
        no stranger (``refused``, ``admitted``). A new identity every round cannot be struck, and can
        always hold a group it is in to its deadlines; this keeps what the strangers we let in cost to that
        share of any window plus one exchange (a leader that still admits them can let one into a group of
        ours meanwhile, and then owes as well; docs/trust.md)
        (tests/round/test_strangers.py::test_strangers_that_cost_our_group_time_keep_strangers_out_for_a_share_of_it)."""
        now, cost = time.monotonic(), max(0.0, cost)
        # it holds no time in advance (a cap of 0): the first such exchange already keeps strangers out
        self.stranger_seats.spend(cost, now, 0.0, debt_s=STRANGER_DEBT_SLOTS * self.timing.gather_slot_s)
        out = self.stranger_seats.owed(now, 0.0) / self.stranger_seats.share
        logger.info(f"round {round_no}: {_names(strangers)}, new to us, joined our group and sent nothing "
                    f"({cost:.0f} s): matching with no new identity for about {out:.0f} s")

    def strangers_wait(self, peers: Iterable[str]) -> Optional[float]:
        """How long past the last arrival a wait for ``peers`` alone may last where every one is a
        stranger and the budget for strangers applies: what it grants (nothing while our matchmaking
        refuses strangers), one read of the view at least, as the barrier's. None where a peer we know
        is among them, or in our first round: the caller's whole allowance. The merge's wait for a group
        of new identities that never names its set (peer/round/merge.py;
        tests/round/test_strangers.py::test_the_merge_waits_for_strangers_alone_what_the_budget_grants)."""
        peers = set(peers)
        if not peers or not self.wait_budget.limiting or not all(self.wait_budget.stranger(p) for p in peers):
            return None
        return self.strangers_grant(time.monotonic(), self.straggler_allowance())

    def strangers_grant(self, now: float, cap: float) -> float:
        """The longest wait for strangers alone at ``now``: what the budget grants (nothing while our
        matchmaking refuses strangers), and at least one read of the view (its interval, and a read's
        latency for the store of a "ready" to land), so that a stranger ready a read after the others is
        still seen; never past ``cap``, one straggler allowance. The barrier's and the merge's alike."""
        grant = self.wait_budget.grant(now, cap) if self.admits_strangers() else 0.0
        return max(grant, min(cap, self.read_interval() + self.read_latency()))

    def waited_for_strangers(self, seconds: float) -> None:
        """``seconds`` past the last arrival were waited in vain for strangers alone: paid from the budget."""
        self.wait_budget.spend(seconds, time.monotonic(), self.straggler_allowance())

    def admits_strangers(self) -> bool:
        """Whether our matchmaking admits strangers now: ``stranger_seats`` owes nothing (``_charge_strangers``)."""
        return self.stranger_seats.owed(time.monotonic(), 0.0) <= 0.0

    def admitted(self) -> Optional[frozenset]:
        """The only peers our matchmaking accepts and follows now: None (anyone not ``refused``) while it
        admits strangers, else every peer that is none (seen to come, or with standing), ourselves included."""
        return None if self.admits_strangers() else self.known()

    def known(self) -> frozenset:
        """The peers that are no strangers to us (seen to come, or with standing), ourselves included: a
        stranger that holds a later agreement round's request is waited for only a grace after the answers of
        the members we know (peer/exchange/agreement_rounds.py)."""
        return self.wait_budget.known() | {self.peer_id}

    def leaders(self, ready: Iterable[str]) -> Optional[frozenset]:
        """The only peers our matchmaking follows as a leader: while a peer we know (seen to come, or with
        standing) is ready for the round, the peers we know, ourselves included; None (anyone not refused)
        otherwise, as at a run's start, or while ``admitted`` restricts whom we follow anyway. A leader decides its group alone: a new identity that leads can
        close it at whatever size suits it, leaving ready honest peers out of the round (their update
        waits, and they fall behind the others). The matchmaking applies it for its first matchmaking
        time only (peer/exchange/matchmaking.py ``refuse_peers``): long enough to find a leader we know
        that is looking, and no longer, so that newcomers left over (groups full, or the peers we know
        all in groups) still pair with whoever leads. We still accept strangers as followers
        (tests/round/test_strangers.py::test_a_stranger_leads_no_peer_that_knows_a_ready_peer)."""
        if not self.admits_strangers():
            return None  # ``admitted`` already follows only the peers we know, and for the whole matchmaking
        known = self.known()
        return known if known & (set(ready) - {self.peer_id}) else None

    def refused(self, round_no: int, unawaited: Iterable[str] = ()) -> frozenset:
        """The peers this peer's matchmaking of ``round_no`` neither accepts nor follows: groupmates that
        sent nothing or held our requests, for their refusal's period (``came_in``), and past it while this
        round's barrier does not wait for them (a no-show, or ``unawaited``: given up on or not waited for),
        which would otherwise take a seat in our group and hold it a grace
        (tests/round/test_rejoin.py::test_a_silent_groupmate_the_barrier_does_not_wait_for_takes_no_seat);
        and every stranger in our view while ``admits_strangers`` says no."""
        not_awaited = self.ledger.skipped(round_no) | set(unawaited)
        out = self.silent.skipped(round_no) | {p for p in not_awaited if self.silent.strikes(p)}
        if not self.admits_strangers():  # the strangers in our view take no seat either (``_charge_strangers``)
            out |= {v.peer_id for v in self.view() if v.peer_id != self.peer_id and self.wait_budget.stranger(v.peer_id)}
        return frozenset(out)

    def cut_off(self, round_no: int) -> bool:
        """Every other peer in rounds is one our matchmaking of ``round_no`` refuses (``refused``): a round
        with no group then trains alone (protocol/round/round_policy.py ``without_group``). Deferred, it
        would stay where it is, and a refusal that ends at a later round would never end: two peers, one
        refusing the other until round 6, deferred round 4 for ever (CI, 2026-12-03; tests/round/
        test_rejoin.py ``test_a_peer_that_refuses_every_other_peer_in_rounds_is_cut_off``)."""
        others = {v.peer_id for v in self.others()}
        return bool(others) and others <= self.refused(round_no)

    def refused_now(self, round_no: int, mates: Container[str], peers: Iterable[str]) -> Tuple[Set[str], Set[str]]:
        """Of ``peers`` (last round's groupmates, ``mates``, excepted), those our matchmaking of
        ``round_no`` refuses, so the barrier does not wait for a seat they could not take. Returns
        (struck, refused): ``struck``, members struck for sending nothing or holding our requests;
        ``refused``, those and, while ``admits_strangers`` says no, the strangers. Before, a struck
        member that announced the round was waited for the whole allowance, and a stranger one read of
        the view, 0.5 s a round (bench/hostile.py --attacks silent-fresh; tests/round/test_strangers.py::
        test_while_strangers_are_refused_the_barrier_waits_for_none_of_them,
        test_a_member_that_held_last_round_is_not_waited_for_while_it_finishes_it)."""
        struck = self.silent.skipped(round_no)
        # (in our first round nobody is a stranger: ``WaitBudget.limiting``)
        shut = self.wait_budget.limiting and not self.admits_strangers()
        out = {p for p in peers if p not in mates and (p in struck or (shut and self.wait_budget.stranger(p)))}
        return out & struck, out

    def missed(self, peers: Iterable[str], round_no: int) -> None:
        """``peers`` were waited for in vain in ``round_no`` (by the barrier or the merge): a strike each."""
        struck = {p: self.ledger.missed(p, round_no) for p in set(peers)}
        fresh = set(struck) - self.no_shows
        if fresh:
            first = all(self.ledger.strikes(p) <= 1 for p in fresh)
            logger.info(f"not waiting again for {_names(fresh)} until round {min(struck[p] for p in fresh)}"
                        f"{' or until they join a group of ours' if first else ' (they missed before: joining a group of ours does not end it)'}")
        self._refresh_no_shows(round_no)

    def _refresh_no_shows(self, round_no: int) -> None:
        expired = self.no_shows - self.ledger.skipped(round_no)
        if expired:
            logger.info(f"round {round_no}: waiting again for {_names(expired)} if they train this round")
        self.no_shows, self.absent = self.ledger.skipped(round_no), self.ledger.absent(round_no)

    def forgive(self, peers: Iterable[str]) -> None:
        """``peers`` are evidently training (this peer took their state): wait for them again."""
        for peer in peers:
            self.ledger.forgive(peer)
            self.no_shows.discard(peer)
            self.absent.discard(peer)

    def unawaited(self, views: Iterable[PeerView]) -> Set[str]:
        """Peers of ``views`` that no barrier waits a whole allowance for: skipped no-shows, and
        strangers once the budget for strangers applies (early close does not count them)."""
        limiting = self.wait_budget.limiting
        return {v.peer_id for v in views if v.peer_id != self.peer_id
                and (v.peer_id in self.no_shows or (limiting and self.wait_budget.stranger(v.peer_id)))}
