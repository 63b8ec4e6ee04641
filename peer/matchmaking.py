"""voloco's settings around hivemind's matchmaking (peer/exchange.py's gather): its times, stretched
on a host whose DHT reads are slow, and a new round's matchmaking kept apart from the last one's."""

from __future__ import annotations

import asyncio
import logging
from typing import Tuple

logger = logging.getLogger("peer.exchange")

LATENCY_TIMEOUTS = 3.0  # a matchmaking request waits at least this many DHT read latencies for its answer
STALE_MATCHMAKING_WAIT_S = 5.0  # the most a new round's matchmaking waits for the last one to end


def matchmaking_times(matchmaking_time: float, read_latency: float, limit: float) -> Tuple[float, float]:
    """(a leader's wait for followers, a follower's wait for a leader's answer) on a host where one
    DHT read takes ``read_latency`` seconds: the spec's ``matchmaking_time`` and a third of it,
    stretched to ``LATENCY_TIMEOUTS`` read latencies for the answer (and three answers for the wait)
    on a loaded host, at most ``limit``. At 32 peers on 2 cores a request timed out after 1 s again
    and again and no group formed in 3 rounds; with 3.3 s and 10 s every round gathered 31-32 peers."""
    request = max(matchmaking_time / 3, LATENCY_TIMEOUTS * max(0.0, read_latency))
    wait = min(max(matchmaking_time, 3 * request), max(matchmaking_time, limit))
    return wait, min(request, wait / 3)


async def end_stale_matchmaking(mm, round_no: int) -> None:
    """A matchmaking of an earlier round still winding down (cancelled by ``give_up``, and still
    discarding its followers) would look under the new round's key with its old announcement:
    cancel its step and let it end first (bounded: the new round's members leave a stale member
    out of their group anyway, ``reconcile.members_of_round``)."""
    stale = mm.step_control
    if stale is not None and not stale.done():
        stale.cancel()
    deadline = asyncio.get_running_loop().time() + STALE_MATCHMAKING_WAIT_S
    while mm.is_looking_for_group and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    if mm.is_looking_for_group:
        logger.info(f"round {round_no}: a matchmaking of an earlier round is still ending")
