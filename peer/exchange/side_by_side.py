"""One round of a group's agreement: the same call to every other member at once, paced by a clock.

A ``FetchClock`` (protocol/round/fetch_clock.py) is told when each call's first bytes arrive and when
it ends, and says when the members that have sent nothing are cut: their calls are cancelled and the
caller asks them nothing more in this group. Without it a member that holds every request costs each
group it joins every agreement round's deadline. Guarded by tests/exchange/test_side_by_side.py.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Collection, Dict, FrozenSet, Hashable, Optional, Protocol, Sequence, Set, Tuple, TypeVar, Union

from hivemind.utils import get_logger

from protocol.round.fetch_clock import FetchClock

logger = get_logger(__name__)
P = TypeVar("P", bound=Hashable)
Answered = Union[bytes, BaseException]
# a sender that has sent nothing this share of its grace after the others' payloads came is waited for
# alone (the steps pause); one that begins that late or later is logged: what the grace's length rests on
NEAR_MISS = 0.25


class Flag(Protocol):
    """An event another process reads (a ``multiprocessing.Event``)."""

    def set(self) -> None: ...

    def clear(self) -> None: ...


class Unanswered(asyncio.TimeoutError):
    """A member sent nothing within the grace after the others' answers (``FetchClock``)."""


async def call_side_by_side(call: Callable[[P, Callable[[], None]], Awaitable[bytes]], peers: Sequence[P],
                            clock: FetchClock, what: str = "answer",
                            silent_wait: Optional[Flag] = None) -> Tuple[Dict[P, Answered], FrozenSet[P]]:
    """(each member's answer, or why its call failed; the members cut for sending nothing). ``call(peer,
    began)`` makes the call, bounded by the round's deadline, and calls ``began()`` when its first bytes
    arrive (a unary call may never: its answer comes whole). ``silent_wait`` is set while the call waits
    for members that have sent nothing alone (from ``NEAR_MISS`` of their grace to the cut), and cleared
    otherwise: the peer's steps pause meanwhile (peer/round/loop.py, ``_pause_for_no_shows``)."""
    loop = asyncio.get_running_loop()
    woken = asyncio.Event()

    def began(peer: P) -> None:
        late, grace = clock.began(peer, loop.time()), clock.grace()
        if late is not None and grace is not None and late >= NEAR_MISS * grace:  # an honest opener close to a cut
            logger.info(f"the {what} of {peer} began {late:.1f} s after the others' came (the grace was {grace:.1f} s)")
        woken.set()

    tasks = {asyncio.ensure_future(call(p, lambda p=p: began(p))): p for p in peers}
    for task in tasks:  # a cut call may still fail as it is cancelled: its exception is read, never logged
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
    got: Dict[P, Answered] = {}
    cut: FrozenSet[P] = frozenset()
    pending = set(tasks)
    flagging = False  # whether this call set ``silent_wait``
    try:
        while pending:
            woken.clear()
            waker = asyncio.ensure_future(woken.wait())
            due, alone = clock.deadline(), clock.alone_from(NEAR_MISS)
            if alone is not None and loop.time() < alone:  # an honest opener may still begin: wake then
                due = alone
            flagged = alone is not None and loop.time() >= alone
            if silent_wait is not None and flagged != flagging:  # only ever cleared by the call that set it
                silent_wait.set() if flagged else silent_wait.clear()
                flagging = flagged
            try:
                done, _ = await asyncio.wait(pending | {waker}, return_when=asyncio.FIRST_COMPLETED,
                                             timeout=None if due is None else max(0.0, due - loop.time()))
            finally:
                waker.cancel()
            for task in done - {waker}:
                pending.discard(task)
                failed = asyncio.CancelledError() if task.cancelled() else task.exception()
                got[tasks[task]] = failed if failed is not None else task.result()
                clock.ended(tasks[task], loop.time(), came=failed is None)
            now_cut = clock.cut(loop.time())
            for task in [t for t in pending if tasks[t] in now_cut]:
                task.cancel()
                pending.discard(task)
                got[tasks[task]] = Unanswered(f"sent no {what} within the grace after the others'")
            cut |= now_cut
    finally:
        if silent_wait is not None and flagging:
            silent_wait.clear()
        for task in pending:
            task.cancel()
    return {p: got[p] for p in peers}, cut


async def ask_each(call: Callable[[P, float, Callable[[], None]], Awaitable[bytes]], peers: Sequence[P], deadline: float,
                   grace: Callable[[float], float], patient: Collection[P], held: Set[P], what: str,
                   round_no: int, silent_wait: Optional[Flag] = None, mute: Optional[Set[P]] = None,
                   awaited: Collection[P] = ()) -> Dict[P, Answered]:
    """One agreement round's ``call(peer, deadline, began)`` to each of ``peers``, from now to
    ``deadline``, paced by a ``FetchClock`` (``patient`` never cut; ``awaited`` never cut, and nobody
    cut before they all answered); the members cut are added to
    ``held`` (the caller asks them nothing more in this group). ``mute``, if given, gets the members
    not cut and not patient that sent not a byte by the deadline (the caller decides what that means:
    peer/exchange/agreement_rounds.py; tests/exchange/test_side_by_side.py). ``silent_wait``:
    ``call_side_by_side``'s."""
    loop = asyncio.get_running_loop()
    clock = FetchClock(peers, loop.time(), deadline - loop.time(), grace, [p for p in peers if p in patient],
                       [p for p in peers if p in awaited])
    opened: Set[P] = set()

    def calling(p: P, began: Callable[[], None]) -> Awaitable[bytes]:
        return call(p, deadline, lambda: (opened.add(p), began()))

    got, cut = await call_side_by_side(calling, peers, clock, what, silent_wait)
    if cut:
        logger.info(f"round {round_no}: stopped waiting for the {what} of {', '.join(map(str, cut))}: it sent "
                    f"nothing within the grace after the others'")
        held.update(cut)
    if mute is not None:
        mute.update(p for p, a in got.items() if isinstance(a, asyncio.TimeoutError) and p not in cut
                    and p not in opened and p not in patient)
    return got
