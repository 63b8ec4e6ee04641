"""When the first round of a group's agreement stops waiting for a sender that has sent nothing.

Round 1 fetches each sender's own payload from the sender (protocol/round/reconcile.py), each fetch
bounded by the round's deadline. A member that joins a group and then holds our requests unanswered
would make every group it joins wait out that deadline, and the next agreement round's half slot for
its relay answer. An honest sender answers as soon as it has opened the group, and its bytes flow from
then on. So this member:

- waits for a sender whose payload has begun to arrive until the deadline: a slow link is no reason
  to drop an update;
- once every other sender's fetch has ended, at least one with its payload, waits for a sender that
  has sent nothing yet a grace past the last payload that came (``Timing.answer_grace`` of the time it
  took from the round's start); one that begins within the grace is waited for like any other, and a
  grace that would reach the deadline cuts nobody (the deadline ends the fetch). While no payload has
  come, nobody is cut: a group whose members all open it late (a loaded host, a slow matchmaking
  answer) is not a group of silent members, so a group of two with a silent member waits the deadline
  (and its matchmaking refuses that member afterwards);
- waits the whole deadline for a member in hivemind's client mode (``patient``): it is reached only
  over connections it opened, which may come late.

A sender cut this way is not asked in the group's later rounds (peer/exchange/gatherer.py); its payload
still counts if another member got it and relays it. Nor is the only other sender once it has sent
not a byte by the deadline, where other members can relay (peer/exchange/agreement_rounds.py
``unasked``). A later round stops waiting for a stranger the same way, once every member it knows has
answered (``awaited``), and only while the cutting member can lose nothing by it (protocol/round/
reconcile.py ``Agreement.may_stop_asking``): an honest member answers round k only once its own round
k - 1 is over, which may run to its deadline for a sender streaming to it alone, and cut early, its
relay of that payload would reach the members that waited and not the one that cut. The cut is
this member's own judgement: members that cut differently still decide alike through the agreement's
later rounds (a member cut in a later round may decide apart from the one that cut it, only it:
``Agreement.may_stop_asking``), and an honest member cut by everyone counts as "sent nothing in time"
(protocol/round/reconcile.py, "timeliness"). Time is an input, never read here. Guarded by
tests/protocol/test_fetch_clock.py.
"""

from __future__ import annotations

from typing import Callable, FrozenSet, Generic, Hashable, Iterable, Optional, Set, TypeVar

T = TypeVar("T", bound=Hashable)


class FetchClock(Generic[T]):
    """One member's calls of one agreement round of one group (round 1's fetches, or a later round's relay
    requests): which senders have begun, ended, or may be cut."""

    def __init__(self, senders: Iterable[T], started: float, slot: float, grace: Callable[[float], float],
                 patient: Iterable[T] = (), awaited: Iterable[T] = ()):
        """``senders``: the senders fetched from (from ``started``, until ``started + slot``); ``grace(took)``:
        how long one that has sent nothing is waited for once the others' payloads took ``took`` seconds.
        ``patient``: never cut. ``awaited``: never cut either, and nobody is cut while one of them has not
        answered (the call waits for it anyway: a cut then saves no time)."""
        self.started, self.end = started, started + slot
        self._grace = grace
        self._idle: Set[T] = set(senders)
        self._streaming: Set[T] = set()
        self._awaited: Set[T] = set(awaited) & self._idle
        self._patient: FrozenSet[T] = frozenset(patient) | frozenset(self._awaited)
        self._last_came: Optional[float] = None

    def began(self, sender: T, now: float) -> Optional[float]:
        """The first bytes of ``sender``'s answer arrived at ``now``: how long after the others' payloads
        (the grace it was within), or None if another fetch was still under way."""
        if sender not in self._idle:
            return None
        late = None if self._streaming or self._last_came is None else now - self._last_came
        self._idle.discard(sender)
        self._streaming.add(sender)
        return late

    def grace(self) -> Optional[float]:
        """The grace a sender that has sent nothing has now, or None while no payload came."""
        return None if self._last_came is None else self._grace(self._last_came - self.started)

    def ended(self, sender: T, now: float, came: bool) -> None:
        """``sender``'s fetch ended at ``now``: with its payload (``came``), or failed."""
        if sender in self._idle or sender in self._streaming:
            self._idle.discard(sender)
            self._streaming.discard(sender)
            self._awaited.discard(sender)
            if came:
                self._last_came = max(now, self._last_came if self._last_came is not None else now)

    def deadline(self) -> Optional[float]:
        """When the senders that have sent nothing may be cut; None while no cut is due (a fetch still
        streams, nothing came yet, an awaited sender has not answered, or only patient senders are left):
        the slot's end bounds them."""
        if self._streaming or self._awaited or self._last_came is None or not (self._idle - self._patient):
            return None
        due = self._last_came + self.grace()
        return due if due < self.end else None  # at the deadline the calls end anyway, and nobody is cut

    def alone_from(self, share: float) -> Optional[float]:
        """From when the wait is for senders that have sent nothing alone: ``share`` of the grace past the
        last payload that came (honest senders begin within a fraction of it); None while no cut is due.
        The caller pauses its peer's steps from then to the cut (peer/exchange/side_by_side.py)."""
        due = self.deadline()
        return None if due is None else self._last_came + share * (due - self._last_came)

    def cut(self, now: float) -> FrozenSet[T]:
        """The senders to stop waiting for at ``now`` (none before ``deadline``); they leave the clock."""
        due = self.deadline()
        if due is None or now < due:
            return frozenset()
        out = frozenset(self._idle - self._patient)
        self._idle -= out
        return out
