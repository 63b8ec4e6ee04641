"""Who was waited for in vain, and for how many rounds it is not waited for again. Pure: time is
the round number, and every fact comes in as an argument.

A progress record is a claim: a peer may announce "training" every round and never come. Each
round a peer waited for in vain costs the swarm one wait (the barrier's straggler allowance, the
merge's allowance), so the ledger gives every such miss a **strike**, and a peer with strikes is
skipped (not waited for) for ``skip_length(strikes)`` rounds: 2, 4, ... ``longest``, ending on a
multiple of that length (``retry_round``), so peers that struck it in neighbouring rounds wait for
it again in the same round.

What keeps this a bound over any window, and not one wait per doubling:

- **strikes outlive an appearance.** They fall by one for every ``forgive_after`` rounds in which
  the peer came (in one of our groups, its signed payload in our union) since its last miss; a peer
  that never comes keeps them. A peer that comes when it is not waited for ends its skip only while
  it has a single strike (an honest peer that fell behind once: a lost matchmaking reply, an
  overloaded host). Before, one appearance wiped the slate, so a peer that came every other round
  cost one wait every two rounds; now a peer that stalls whenever it is waited for is waited for
  about once per ``forgive_after`` rounds
  (``test_an_alternating_staller_costs_one_wait_per_forgive_period``).
- **a claim is not an appearance.** A peer waited for that then names, with another peer, a set of
  the round that we do not hold says it gathered in another group; two colluding identities can say
  that every round. Such a claim excuses a miss at most once per ``excuse_every`` rounds; an
  appearance that counts is one we can check: a groupmate, or a sender whose signed payload is in
  the union this peer merged.

Skips bound how often a peer is waited for; ``WaitBudget`` bounds how long a peer waits for
**strangers**: peers it never saw come (in its groups, or with a signed payload in its union) and
that have no standing in its lineage, as a new identity has. A wait past the last arrival that
serves only strangers is paid from a budget that grows at half of ``Timing.vain_wait_share`` of wall time
and holds at most one straggler allowance; a wait that ended without them spends it (down to a
debt of one allowance). So a new stalling identity every round, which the ledger cannot strike
twice, costs at most that share of any window plus one allowance
(``test_waits_for_strangers_take_a_bounded_share_of_any_window``), and one read of the view a
round (the barrier's least wait, peer/round/membership.py). A peer that came before (an
honest one back from a stall, a groupmate, a sender in our union) is waited for the whole
allowance; a record that says it ended a round we stopped waiting for it in is a claim, and
leaves it a stranger. In its first round
(``Timing.budget_after_rounds``) a peer limits nobody (at a run's start everyone is a stranger;
tests/round/test_rejoin.py), though its waits in vain are paid later.

A peer skipped and not seen since its last miss is also nobody to meet (``absent``): a lone honest
peer beside a staller trains alone instead of waiting for a group that never forms; one that came
since (an honest peer with a second strike, still in our groups) is met, only not waited for.

Guarded by tests/protocol/test_no_shows.py and the barrier tests (tests/round/test_rejoin.py,
tests/round/test_liveness.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Container, Dict, FrozenSet, Iterable, Optional, Set, Tuple

from protocol.round.timing import Timing

_NEVER = -(1 << 62)
MAX_ENTRIES = 4096  # peers a ledger remembers; past it, the one with the oldest news is forgotten


def skip_length(strikes: int, longest: int = Timing.max_skip_rounds) -> int:
    """Rounds in a skip period of a peer with ``strikes`` strikes (at most ``longest``)."""
    return min(2 ** min(max(strikes, 0), 16), longest)


def retry_round(round_no: int, strikes: int, longest: int = Timing.max_skip_rounds) -> int:
    """The first round from ``round_no`` on in which a peer with ``strikes`` strikes is waited for
    again: a multiple of its skip length, the same round for every peer that struck it."""
    length = skip_length(strikes, longest)
    return -(-round_no // length) * length


def claimed_elsewhere(named: Iterable[Tuple[str, int, str]], round_no: int) -> Set[str]:
    """The peers that claim to have gathered in a group in ``round_no`` or later (``named``: each
    peer's (id, round of its last set, that set's name) from its progress record): a slower peer of
    a round whose own group formed after ours says so. A set counts when two peers name it (a group
    has at least two members), so one identity's claim alone does not; two can make it, so a claim
    only excuses a miss now and then (``NoShowLedger.excuse``)."""
    by_set: Dict[Tuple[int, str], Set[str]] = {}
    for peer, gathered_round, name in named:
        if name and gathered_round >= round_no >= 0:
            by_set.setdefault((gathered_round, name), set()).add(peer)
    return set().union(*(peers for peers in by_set.values() if len(peers) >= 2))


@dataclass
class _Entry:
    strikes: int = 0
    comes: int = 0  # rounds it came in since its last miss
    last_miss: int = _NEVER
    until: int = 0  # the first round it is waited for again
    came: int = _NEVER  # the last round it was seen to come (an appearance we could check)
    excused: int = _NEVER  # the last round a claim excused a miss


class NoShowLedger:
    """Strikes, skips and excuses of the peers this peer waited for (see the module docstring)."""

    def __init__(self, longest: int, forgive_after: int, excuse_every: int):
        if longest < 1 or forgive_after < 1 or excuse_every < 1:
            raise ValueError("longest, forgive_after and excuse_every are at least 1 round")
        self.longest, self.forgive_after, self.excuse_every = longest, forgive_after, excuse_every
        self._entries: Dict[str, _Entry] = {}

    @classmethod
    def from_timing(cls, timing: Timing) -> "NoShowLedger":
        """A ledger with the run's ``max_skip_rounds``, ``forgive_after_rounds`` and ``excuse_every_rounds``."""
        return cls(timing.max_skip_rounds, timing.forgive_after_rounds, timing.excuse_every_rounds)

    def strikes(self, peer: str) -> int:
        """``peer``'s strikes: one fewer for every ``forgive_after`` rounds it came in since its last miss."""
        e = self._entries.get(peer)
        return 0 if e is None else max(0, e.strikes - e.comes // self.forgive_after)

    def missed(self, peer: str, round_no: int) -> int:
        """``peer`` was waited for in vain in ``round_no``: one strike more; the round it is waited for
        again. A miss in the round after the last one is the same absence (the merge of round r and the
        barrier of round r + 1 judge one round): no second strike."""
        e = self._entry(peer)
        if e.strikes and round_no - e.last_miss <= 1:
            return e.until
        e.strikes, e.comes = self.strikes(peer) + 1, 0
        e.last_miss = round_no
        e.until = max(e.until, retry_round(round_no + 1, e.strikes, self.longest))
        return e.until

    def came(self, peer: str, round_no: int) -> None:
        """``peer`` came in ``round_no`` (a groupmate, or its signed payload in our union): its skip
        ends if that was its only strike; later strikes stay until they are forgiven by time."""
        e = self._entries.get(peer)
        if e is None:
            return
        if round_no > e.came:
            e.came, e.comes = round_no, e.comes + (round_no > e.last_miss)
        left = self.strikes(peer)
        if left <= 1:
            e.until = min(e.until, round_no)
        if left == 0 and round_no - e.excused >= self.excuse_every:
            del self._entries[peer]  # a clean slate, and no excuse to remember

    def excuse(self, peer: str, round_no: int) -> bool:
        """Whether a claim that ``peer`` gathered elsewhere in ``round_no`` excuses its miss: at most
        once per ``excuse_every`` rounds (a True is spent)."""
        e = self._entry(peer)
        if round_no - e.excused < self.excuse_every:
            return False
        e.excused = round_no
        return True

    def _entry(self, peer: str) -> _Entry:
        """``peer``'s entry, made if new; bounded: a flood of identities evicts the stalest entries,
        never more than ``MAX_ENTRIES`` kept."""
        e = self._entries.get(peer)
        if e is None:
            if len(self._entries) >= MAX_ENTRIES:
                del self._entries[min(self._entries, key=lambda p: max(self._entries[p].last_miss,
                                                                       self._entries[p].came, self._entries[p].excused))]
            e = self._entries[peer] = _Entry()
        return e

    def forgive(self, peer: str) -> None:
        """Evidence that ``peer`` trains our lineage (this peer took its state): a clean slate."""
        self._entries.pop(peer, None)

    def waits_again(self, peer: str) -> int:
        """The round ``peer`` is waited for again (0: it is not skipped)."""
        e = self._entries.get(peer)
        return e.until if e is not None else 0

    def skipped(self, round_no: int) -> Set[str]:
        """The peers not waited for in ``round_no``."""
        return {p for p, e in self._entries.items() if e.until > round_no}

    def absent(self, round_no: int) -> Set[str]:
        """The skipped peers not seen to come since their last miss: nobody to meet in ``round_no``."""
        return {p for p, e in self._entries.items() if e.until > round_no and e.came < e.last_miss}


class WaitBudget:
    """How long a peer may still wait past the last arrival for strangers (see the module docstring).
    Time is an argument; the budget starts full (one allowance)."""

    def __init__(self, share: float, after_rounds: int = Timing.budget_after_rounds):
        if not 0.0 < share < 1.0 or after_rounds < 0:
            raise ValueError("share must be in (0, 1), after_rounds at least 0")
        self.share, self.after_rounds = share, after_rounds
        self.balance: float = float("inf")  # clipped to the cap at the first grant
        self._at: float = float("nan")
        self._met: "OrderedDict[str, None]" = OrderedDict()  # peers seen to come, the latest last (bounded)
        self._lineage: Container[str] = ()  # senders with standing in our lineage (its own bound)
        self.rounds = 0  # rounds this peer concluded since it started

    def met(self, peers: Iterable[str]) -> None:
        """``peers`` came: groupmates, senders in our union (senders with standing are ``lineage``'s;
        a record saying a peer ended a round is a claim, and makes it no acquaintance)."""
        for peer in peers:
            self._met[peer] = None
            self._met.move_to_end(peer)
        while len(self._met) > MAX_ENTRIES:
            self._met.popitem(last=False)

    def forget(self, peers: Iterable[str]) -> None:
        """``peers``' contributions were refused by a round's checks (direction, values): they are no
        acquaintances from those (an identity whose only payloads are refused, a silent one that serves
        one member its zero update, stays a stranger whose waits the budget pays; standing is the
        lineage's and unaffected; tests/protocol/test_no_shows.py)."""
        for peer in peers:
            self._met.pop(peer, None)

    def lineage(self, senders: Container[str]) -> None:
        """``senders``: those with standing in our lineage (the engine's table, kept by reference, not
        copied: a full table must not push the peers we met out of ``_met``)."""
        self._lineage = senders

    def concluded(self) -> None:
        """This peer concluded a round."""
        self.rounds += 1

    def stranger(self, peer: str) -> bool:
        """Whether ``peer`` was never seen to come (nor has standing): a wait for it alone is paid from
        the budget, and limited by it once this peer is ``limiting``."""
        return peer not in self._met and peer not in self._lineage

    @property
    def limiting(self) -> bool:
        """Past this peer's first round: waits for strangers last at most what ``grant`` says. Before,
        they are waited for the whole allowance, and still spend the budget."""
        return self.rounds >= self.after_rounds

    def _accrue(self, now: float, cap_s: float) -> None:
        if self._at == self._at:  # not NaN: a time was seen
            self.balance += self.share * max(0.0, now - self._at)
        self.balance, self._at = min(self.balance, cap_s), now

    def grant(self, now: float, cap_s: float) -> float:
        """The longest wait past the last arrival at ``now`` for strangers only: what the budget holds
        (at most ``cap_s``, one straggler allowance), nothing while it is in debt. No floor of its own:
        the barrier waits one read of the view in any case, so that a stranger ready a read after the
        others is still met; a floor here (it was a heartbeat, 2 s) was paid every round whatever the
        balance, and with rounds under 20 s it, not the share, set a new staller's cost."""
        self._accrue(now, cap_s)
        return min(cap_s, max(0.0, self.balance))

    def spend(self, seconds: float, now: float, cap_s: float, debt_s: Optional[float] = None) -> None:
        """``seconds`` were waited in vain for strangers (the barrier ended without them): spent, down
        to a debt of ``debt_s`` (default one allowance; waits in our first round, not limited, are paid later)."""
        self._accrue(now, cap_s)
        self.balance = max(-(cap_s if debt_s is None else debt_s), self.balance - max(0.0, seconds))

    def owed(self, now: float, cap_s: float) -> float:
        """How far in debt the budget is at ``now`` (0 while it holds time; at most ``cap_s`` held)."""
        self._accrue(now, cap_s)
        return max(0.0, -self.balance)

    def known(self) -> FrozenSet[str]:
        """Every peer that is no stranger: seen to come, or with standing in our lineage."""
        return frozenset(self._met) | frozenset(self._lineage)
