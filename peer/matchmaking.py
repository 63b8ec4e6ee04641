"""voloco's side of hivemind's matchmaking (peer/exchange.py's gather): its times, stretched on a
host whose DHT reads are slow, and each member's matchmaking data read back."""

from __future__ import annotations

from typing import Any, Optional, Tuple

LATENCY_TIMEOUTS = 3.0  # a matchmaking request waits at least this many DHT read latencies for its answer


def matchmaking_times(matchmaking_time: float, read_latency: float, limit: float) -> Tuple[float, float]:
    """(a leader's wait for followers, a follower's wait for a leader's answer) on a host where one
    DHT read takes ``read_latency`` seconds: the spec's ``matchmaking_time`` and a third of it,
    stretched to ``LATENCY_TIMEOUTS`` read latencies for the answer (and three answers for the wait)
    on a loaded host, at most ``limit``. At 32 peers on 2 cores a request timed out after 1 s again
    and again and no group formed in 3 rounds; with 3.3 s and 10 s every round gathered 31-32 peers."""
    request = max(matchmaking_time / 3, LATENCY_TIMEOUTS * max(0.0, read_latency))
    wait = min(max(matchmaking_time, 3 * request), max(matchmaking_time, limit))
    return wait, min(request, wait / 3)



def read_gathered(serializer: Any, raw: bytes) -> Optional[list]:
    """One member's matchmaking data as hivemind's ``step`` writes it, [bandwidth, mode, announcement]
    (the announcement serialized inside); None if it is not that."""
    try:
        value = serializer.loads(raw)
        if isinstance(value, (list, tuple)) and len(value) == 3 and isinstance(value[2], bytes):
            return [value[0], value[1], serializer.loads(value[2])]
    except Exception:
        pass
    return None
