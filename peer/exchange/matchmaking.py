"""voloco's side of hivemind's matchmaking (peer/exchange/gatherer.py's gather): each member's
matchmaking data read back, which members send a payload (``senders_of``), a step's outcome (given up while still looking), a step cancelled
without a race, the peers it refuses or alone admits, whom a leader's group target counts (``count_seats``), and what a search still holds. Its
times, stretched on a host whose DHT reads are slow, are ``Timing.matchmaking`` (protocol/round/timing.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Any, Callable, Dict, FrozenSet, Iterable, List, Mapping, Optional, Tuple

from hivemind.averaging.control import AveragingStage
from hivemind.p2p import PeerID

from hivemind.proto import averaging_pb2
from hivemind.utils.mpfuture import MPFuture

from protocol.round.reconcile import MAX_GATHER_BYTES, Announced
from protocol.round.timing import Timing
from protocol.wire.bounded_unpack import MAX_DEPTH, packed_nesting

logger = logging.getLogger(__name__)


def read_gathered(serializer: Any, raw: bytes) -> Optional[list]:
    """One member's matchmaking data as hivemind's ``step`` writes it, [bandwidth, mode, announcement]
    (the announcement serialized inside); None if it is not that
    (tests/exchange/test_exchange_bounds.py::test_a_deeply_nested_announcement_is_left_out_of_the_group)."""
    try:
        # nested deeper than anything we send: hivemind's decoder can overflow the C stack on it, and
        # quoting it in an error would raise RecursionError
        if packed_nesting(raw) > MAX_DEPTH:
            return None
        value = serializer.loads(raw)
        if isinstance(value, (list, tuple)) and len(value) == 3 and isinstance(value[2], bytes):
            if packed_nesting(value[2]) <= MAX_DEPTH:
                return [value[0], value[1], serializer.loads(value[2])]
    except Exception:
        pass
    return None


def senders_of(announced: Mapping[Any, Announced]) -> Tuple[List[bytes], Dict[bytes, Any]]:
    """In a round of at most K a part: (the members that send a payload, their announced parts), by peer
    id bytes, from each member's announcement (PeerID -> it). A member announces a part only when the
    lineage's eligibility table lets it send (protocol/round/eligibility.py, decided with its own
    seed and table); reading the decision from the announcements, which every member holds alike,
    keeps the group's agreement one even where members start from different θ. The round's draw
    checks eligibility again (``RoundEngine.draw``): announcing falsely only ships a payload."""
    sending = {peer: a.part for peer, a in announced.items() if a.part is not None}
    return sorted(peer.to_bytes() for peer in sending), {peer.to_bytes(): part for peer, part in sending.items()}


def cancel_step(control: Any) -> None:
    """Cancel a hivemind averaging step (a ``StepControl``) so that its matchmaking ends now.

    hivemind's ``StepControl.cancel`` first signals the averager process, then marks the step
    cancelled. An averager that wakes on the signal before the mark (a loaded host) finds the step
    not cancelled and goes on awaiting its ``look_for_group`` until the step's own timeout (the
    round's whole wait), and every later step of this peer queues behind it ("Another
    look_for_group is already in progress"): the peer is stuck for minutes, or a stale step joins a
    later round's group. Marking the step first (its state is in shared memory) closes the race
    (tests/exchange/test_cancel_step.py)."""
    if isinstance(control, MPFuture):
        MPFuture.cancel(control)
    control.cancel()


def step_outcome(control: Any, give_up: Optional[Callable[[], bool]], poll: float = Timing.give_up_poll_s):
    """A hivemind step's (``StepControl``) result; None once ``give_up`` says so while its matchmaking
    is still looking (a step already gathering is never cancelled: its group counts on our payload;
    tests/exchange/test_gather_give_up.py)."""
    while True:
        try:
            return control.result(timeout=poll if give_up is not None else None)
        except FuturesTimeout:
            if control.stage == AveragingStage.LOOKING_FOR_GROUP and give_up():
                cancel_step(control)
                return None


def describe_search(mm: Any) -> str:
    """What a hivemind ``Matchmaking`` still looking for a group holds and awaits (for a log line when
    a new round's step would queue behind it): followers, leader, and the stacks of its tasks."""
    parts = [f"{len(getattr(mm, 'current_followers', {}))} followers",
             f"leader {getattr(mm, 'current_leader', None)}",
             f"group {'assembled' if mm.assembled_group.done() else 'pending'}"]
    for task in asyncio.all_tasks():
        frames, coro = [], task.get_coro()
        while coro is not None and len(frames) < 16:  # the chain of awaits, outermost first
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
            if frame is not None:
                frames.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
            coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
        if any(f.split(":")[0] in ("look_for_group", "_request_join_potential_leaders", "rpc_join_group",
                                   "begin_search", "find_peers_or_notify_cancel", "_declare_averager_periodically",
                                   "_update_queue_periodically") for f in frames):
            parts.append(f"task {' > '.join(frames)}")
    return "; ".join(parts)


def as_peer_ids(names: Iterable[str]) -> List[Any]:
    """PeerIDs of ``names`` (base58); a name that is none (a standing table names senders) is skipped."""
    out = []
    for name in names:
        if not name:
            continue
        try:
            out.append(PeerID.from_base58(name))
        except ValueError:
            pass
    return out


def refuse_peers(mm: Any, refused: FrozenSet[Any], admitted: Optional[FrozenSet[Any]] = None,
                 leaders: Optional[FrozenSet[Any]] = None, leaders_for: float = float("inf")) -> None:
    """Make hivemind's ``Matchmaking`` ``mm`` refuse ``refused`` (PeerIDs) from now on, and, unless
    ``admitted`` is None, every peer outside ``admitted``: a join request from one of them is answered
    as if this peer were not looking for a group, and a leader among them is passed over (the next
    potential leader is asked), as is a leader outside ``leaders`` (unless None) for the next
    ``leaders_for`` seconds (a leader passed over is asked again only once it declares itself anew,
    as hivemind's leaders do when their matchmaking time is over). Each peer decides
    alone whom it refuses (peer/round/no_show_views.py ``refused``: members that joined its groups and
    sent nothing; ``admitted``: only peers it knows, while new identities cost its groups too much;
    ``leaders``: only peers it knows, while one of them is ready); the group is still the leader's
    list, the same for every member. A join request whose matchmaking data exceeds
    ``reconcile.MAX_GATHER_BYTES`` is refused as a protocol violation (the leader would relay it to
    every member). Installed on the instance once, the sets replaced each round
    (tests/exchange/test_refused_peers.py)."""
    mm.voloco_refused, mm.voloco_admitted, mm.voloco_leaders = refused, admitted, leaders
    mm.voloco_leaders_until = time.monotonic() + leaders_for
    if getattr(mm, "_voloco_refusing", False):
        return
    mm._voloco_refusing = True
    check, join = mm._check_reasons_to_reject, mm._request_join_group

    def shunned(peer) -> bool:
        return peer in mm.voloco_refused or (mm.voloco_admitted is not None and peer not in mm.voloco_admitted)

    def check_reasons_to_reject(request, context):
        if shunned(context.remote_id):
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
        if len(request.gather) > MAX_GATHER_BYTES:  # relayed to every member, who each decode it
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        return check(request, context)

    async def request_join_group(leader):  # (hivemind's redirect to a suggested leader comes through here too)
        if shunned(leader) or (mm.voloco_leaders is not None and leader not in mm.voloco_leaders
                               and time.monotonic() < mm.voloco_leaders_until):
            logger.debug(f"not following {leader}: refused this round, or not a leader we know")
            return None
        return await join(leader)

    mm._check_reasons_to_reject, mm._request_join_group = check_reasons_to_reject, request_join_group


def count_seats(mm: Any, counted: FrozenSet[Any], spare: int, largest: int) -> None:
    """Make hivemind's ``Matchmaking`` ``mm``, as a leader, count toward its group target (set for the
    round: ``mm.target_group_size``) only the members it waited for: ``counted`` (PeerIDs: the peers its
    barrier found ready) and ``spare`` more of anyone (the gather's pair while peers of the round are
    still coming, peer/round/barrier.py ``gather_size``). Every other follower adds a seat, up to
    ``largest``: hivemind's leader closes a group as soon as it reaches its target, so such a member (a
    new identity, a peer given up on) would fill a ready peer's seat and leave that one out of the
    round's group, its update waiting a round. The target is worked out again from the followers
    there are at each join request (hivemind compares it only then), so one that joined and left
    holds no seat. Installed on the instance once, the counts set each round (tests/exchange/test_seats.py)."""
    mm.voloco_seats = (mm.target_group_size, counted, max(0, spare), largest)
    if getattr(mm, "_voloco_seating", False):
        return
    mm._voloco_seating = True
    check = mm._check_reasons_to_reject

    def target(joining: Any = None) -> int:
        base, counted, spare, largest = mm.voloco_seats
        others = sum(1 for p in [*mm.current_followers, *([joining] if joining is not None else [])] if p not in counted)
        return max(base, min(largest, base + others - spare))

    def check_reasons_to_reject(request, context):
        mm.target_group_size = target(context.remote_id)  # hivemind compares with it once this is accepted
        answer = check(request, context)
        if answer is not None:
            mm.target_group_size = target()
        return answer

    mm._check_reasons_to_reject = check_reasons_to_reject
