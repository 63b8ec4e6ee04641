"""Round 1 of a group's agreement: every sender's own payload, fetched from the sender at once.

The fetches run side by side; a ``FetchClock`` (protocol/round/fetch_clock.py) is told when each
one's first bytes arrive and when it ends, and says when the senders that have sent nothing are cut:
their fetches are cancelled and they are not asked again in the agreement's later rounds (a member
that holds every request would otherwise cost each group it joins the whole slot, and half a slot
per later round). Guarded by tests/exchange/test_first_round.py.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Dict, FrozenSet, Hashable, Sequence, Tuple, TypeVar, Union

from hivemind.utils import get_logger

from protocol.round.fetch_clock import FetchClock

logger = get_logger(__name__)
P = TypeVar("P", bound=Hashable)
Fetched = Union[bytes, BaseException]


async def fetch_own_payloads(fetch: Callable[[P, Callable[[], None]], Awaitable[bytes]], sending: Sequence[P],
                             clock: FetchClock, round_no: int = -1) -> Tuple[Dict[P, Fetched], FrozenSet[P]]:
    """(each sender's envelope, or why its fetch failed; the senders cut for sending nothing).
    ``fetch(peer, began)`` fetches ``peer``'s own envelope, bounded by the slot, and calls ``began()``
    when its first bytes arrive."""
    loop = asyncio.get_running_loop()
    woken = asyncio.Event()

    def began(peer: P) -> None:
        clock.began(peer)
        woken.set()

    tasks = {asyncio.ensure_future(fetch(p, lambda p=p: began(p))): p for p in sending}
    got: Dict[P, Fetched] = {}
    cut: FrozenSet[P] = frozenset()
    pending = set(tasks)
    try:
        while pending:
            woken.clear()
            waker = asyncio.ensure_future(woken.wait())
            due = clock.deadline()
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
                got[tasks[task]] = asyncio.TimeoutError("sent nothing within the grace after the others' payloads")
            if now_cut:
                logger.info(f"round {round_no}: stopped waiting for the payload of {', '.join(map(str, now_cut))}: it sent "
                            f"nothing within the grace after the others' (it can still come through their relays)")
            cut |= now_cut
    finally:
        for task in pending:
            task.cancel()
    return {p: got[p] for p in sending}, cut
