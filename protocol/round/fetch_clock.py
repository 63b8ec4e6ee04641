"""When a round of a group's agreement stops waiting for members that have sent nothing.

Each agreement round asks every other member for something at once: in round 1 each sender's own
payload, in round k > 1 the signed values it accepted (protocol/round/reconcile.py), each call bounded
by the round's deadline. A member that joins a group and then holds our requests unanswered would make
every group it joins wait out every deadline; one that serves its payload to a single member and holds
the others' would make that member wait out round 2's, and everyone else wait for that member. An
honest member answers as soon as it can (its payload once it has opened the group, its relay answer
once its own previous round is over). So this member:

- waits for a member whose answer has begun to arrive until the deadline: a slow link is no reason
  to drop an update;
- once every other member's call has ended, at least one with its answer, waits for a member that has
  sent nothing yet a grace past the last answer that came (``Timing.answer_grace`` of the time it
  took from the round's start), never past the deadline; one that begins within the grace is waited
  for like any other. While no answer has come, nobody is cut: a group whose members all open it late
  (a loaded host, a slow matchmaking answer) is not a group of silent members, so a group of two with
  a silent member waits the deadline (and its matchmaking refuses that member afterwards);
- waits the whole deadline for a member in hivemind's client mode (``patient``): it is reached only
  over connections it opened, which may come late.

A member cut this way is not asked again in the group's later rounds (peer/exchange/gatherer.py); its
payload still counts if another member got it and relays it. The cut is this member's own judgement:
members that cut differently still decide alike through the agreement's later rounds, and an honest
member cut by everyone counts as "sent nothing in time" (protocol/round/reconcile.py, "timeliness").
Time is an input, never read here. Guarded by tests/protocol/test_fetch_clock.py.
"""

from __future__ import annotations

from typing import Callable, FrozenSet, Generic, Hashable, Iterable, Optional, Set, TypeVar

T = TypeVar("T", bound=Hashable)


class FetchClock(Generic[T]):
    """One member's calls of one agreement round: which members have begun answering, ended, or may be cut."""

    def __init__(self, senders: Iterable[T], started: float, slot: float, grace: Callable[[float], float],
                 patient: Iterable[T] = ()):
        """``senders``: the members called (from ``started``, until ``started + slot``); ``grace(took)``:
        how long one that has sent nothing is waited for once the others' answers took ``took`` seconds."""
        self.started, self.end = started, started + slot
        self._grace = grace
        self._idle: Set[T] = set(senders)
        self._streaming: Set[T] = set()
        self._patient: FrozenSet[T] = frozenset(patient)
        self._last_came: Optional[float] = None

    def began(self, sender: T) -> None:
        """The first bytes of ``sender``'s answer arrived."""
        if sender in self._idle:
            self._idle.discard(sender)
            self._streaming.add(sender)

    def ended(self, sender: T, now: float, came: bool) -> None:
        """``sender``'s fetch ended at ``now``: with its payload (``came``), or failed."""
        if sender in self._idle or sender in self._streaming:
            self._idle.discard(sender)
            self._streaming.discard(sender)
            if came:
                self._last_came = max(now, self._last_came if self._last_came is not None else now)

    def deadline(self) -> Optional[float]:
        """When the senders that have sent nothing may be cut; None while no cut is due (a fetch still
        streams, nothing came yet, or only patient senders are left): the slot's end bounds them."""
        if self._streaming or self._last_came is None or not (self._idle - self._patient):
            return None
        return min(self.end, self._last_came + self._grace(self._last_came - self.started))

    def cut(self, now: float) -> FrozenSet[T]:
        """The senders to stop waiting for at ``now`` (none before ``deadline``); they leave the clock."""
        due = self.deadline()
        if due is None or now < due:
            return frozenset()
        out = frozenset(self._idle - self._patient)
        self._idle -= out
        return out
