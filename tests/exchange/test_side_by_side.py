"""peer/exchange/side_by_side.py: an agreement round's calls run side by side, and a member that holds
its request while the others' answers came is cut a grace later, not at the round's deadline (the
rules themselves: tests/protocol/test_fetch_clock.py)."""

from __future__ import annotations

import asyncio

from peer.exchange.side_by_side import Unanswered, ask_each, call_side_by_side
from protocol.round.fetch_clock import FetchClock

SLOT, GRACE = 20.0, 0.3


class Flag:
    """Records when the caller says it waits for silent members alone (what the peer's steps pause on)."""

    def __init__(self):
        self.on, self.spans, self._since = False, [], None

    def set(self):
        if not self.on:
            self.on, self._since = True, asyncio.get_running_loop().time()

    def clear(self):
        if self.on:
            self.on = False
            self.spans.append(asyncio.get_running_loop().time() - self._since)


def run(behaviours, flag=None, grace=GRACE):
    """Fetch from fake senders: ``behaviours[p] = (first bytes after, payload after)`` seconds, None: never."""
    cancelled = []

    async def fetch(peer, began):
        first, whole = behaviours[peer]
        try:
            if first is None:
                await asyncio.sleep(3600)  # holds the request, as a silent member does
            await asyncio.sleep(first)
            began()
            await asyncio.sleep(whole - first)
            return peer.encode()
        except asyncio.CancelledError:
            cancelled.append(peer)
            raise

    async def main():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        clock = FetchClock(list(behaviours), t0, SLOT, lambda took: grace)
        got, cut = await call_side_by_side(fetch, list(behaviours), clock, "payload", flag)
        return got, cut, loop.time() - t0

    got, cut, took = asyncio.run(main())
    return got, cut, took, cancelled


def test_a_silent_sender_is_cut_a_grace_after_the_last_payload_came():
    got, cut, took, cancelled = run({"a": (0.05, 0.1), "b": (0.05, 0.2), "s": (None, None)})
    assert got["a"] == b"a" and got["b"] == b"b"
    assert cut == {"s"} and isinstance(got["s"], Unanswered) and cancelled == ["s"]
    assert took < 0.2 + GRACE + 1.0  # the slot (20 s) is not waited out


def test_the_wait_for_a_silent_sender_alone_is_flagged_from_the_last_payload_to_the_cut():
    # the flag is what pauses an overlapped peer's steps (peer/round/loop.py): on for the grace, off after
    flag = Flag()
    _, cut, _, _ = run({"a": (0.05, 0.1), "b": (0.05, 0.2), "s": (None, None)}, flag)
    assert cut == {"s"} and not flag.on and len(flag.spans) == 1
    assert 0.5 * GRACE <= flag.spans[0] <= 0.75 * GRACE + 0.5  # from a quarter of the grace (NEAR_MISS) to the cut
    flag = Flag()  # a late opener within a quarter of its grace (0.05 s late of 2 s): never flagged
    _, cut, _, _ = run({"a": (0.05, 0.1), "late": (0.15, 0.6)}, flag, grace=2.0)
    assert cut == set() and not flag.on and flag.spans == []
    flag = Flag()  # a later one (0.6 s late of 1 s): flagged only until its first bytes came, then waited for unflagged
    _, cut, _, _ = run({"a": (0.05, 0.1), "late": (0.7, 0.9)}, flag, grace=1.0)
    assert cut == set() and not flag.on and len(flag.spans) == 1 and 0.2 <= flag.spans[0] <= 0.5


def test_a_slow_stream_and_a_late_opener_are_waited_for():
    # "slow" streams for 1 s after its first bytes; "late" opens its group 0.2 s after the others came
    got, cut, took, _ = run({"a": (0.05, 0.1), "slow": (0.05, 1.0), "late": (0.3, 0.4)})
    assert cut == set() and got == {"a": b"a", "slow": b"slow", "late": b"late"}


def test_a_failed_fetch_is_returned_and_no_payload_means_no_cut():
    async def fetch(peer, began):
        if peer == "gone":
            raise KeyError("gone sent nothing")
        await asyncio.sleep(0.3)
        return b"x"

    async def main():
        loop = asyncio.get_running_loop()
        clock = FetchClock(["gone", "x"], loop.time(), SLOT, lambda took: 0.01)
        return await call_side_by_side(fetch, ["gone", "x"], clock)

    got, cut = asyncio.run(main())
    # "x" sent no first bytes (began never called) and still came: nothing else had come before it
    assert isinstance(got["gone"], KeyError) and got["x"] == b"x" and cut == set()


def test_ask_each_adds_the_cut_to_held_and_never_cuts_a_patient_member():
    async def relay(peer, deadline, began):  # a unary answer: no first bytes before the whole
        if peer in ("s", "client"):
            await asyncio.sleep(max(0.0, deadline - asyncio.get_running_loop().time()))
            raise asyncio.TimeoutError()
        return peer.encode()

    async def main():
        loop = asyncio.get_running_loop()
        held = {"earlier"}
        got = await ask_each(relay, ["a", "s", "client"], loop.time() + 1.5, lambda took: 0.2, {"client"}, held,
                             "agreement round 2 answer", 7)
        return got, held, loop.time()

    got, held, _ = asyncio.run(main())
    assert got["a"] == b"a" and isinstance(got["s"], Unanswered) and isinstance(got["client"], asyncio.TimeoutError)
    assert held == {"earlier", "s"}  # the client-mode member was waited for to the deadline, not cut



def test_only_a_sole_mute_sender_is_left_unasked():
    """With no other sender there is no grace to cut from: the deadline ends the fetch. ``ask_each``
    reports a member that sent not a byte by then (``mute``), not one whose payload began to stream,
    and holds neither; the agreement's later rounds leave it unasked only where it was the only
    other sender and other members can relay (a sole mute sender cost a 32-peer run's round half a
    slot more: bench/RESULTS.md, 2026-12-01, fifty-second session). A member that heard from nobody
    keeps asking everyone: relays are how it learns what the others got."""
    from peer.exchange.agreement_rounds import unasked

    async def fetch(peer, deadline, began):
        if peer == "streaming":
            began()
        await asyncio.sleep(max(0.0, deadline - asyncio.get_running_loop().time()))
        raise asyncio.TimeoutError()

    async def main():
        loop = asyncio.get_running_loop()
        held, mute = set(), set()
        got = await ask_each(fetch, ["mute", "streaming"], loop.time() + 0.5, lambda took: 0.2, set(), held, "payload", 7,
                             mute=mute)
        return got, held, mute

    got, held, mute = asyncio.run(main())
    assert isinstance(got["mute"], asyncio.TimeoutError) and not isinstance(got["mute"], Unanswered)
    assert mute == {"mute"} and held == set()
    assert unasked(["s"], ["s", "a", "b"], {"s"}) == {"s"}  # the only other sender, others to relay
    assert unasked(["s"], ["s"], {"s"}) == set()  # a group of two: nobody else to relay
    assert unasked(["s", "t"], ["s", "t", "a"], {"s", "t"}) == set()  # heard from no sender: ask on


def agree_with_a_holder(complete: bool = True, stranger: bool = True, known_answers_after: float = 0.0):
    """``PayloadGatherer._agree`` in a group of four (three agreement rounds): two honest members we know
    answer relay requests, one at once, the other after ``known_answers_after`` seconds in round 2; a third served us
    its payload and then holds every relay request (a new identity's stall, bench/hostile.py
    ``silent-fresh``). ``complete=False``: one honest sender's payload streams to its deadline and never
    comes, so we lack a value. ``stranger``: the holder is new to us. (seconds _agree took, the members
    held: struck by our matchmaking, the strangers not waited for: charged only)."""
    from types import SimpleNamespace

    from hivemind.p2p import PeerID

    from peer.exchange.gatherer import PayloadGatherer
    from protocol.round.reconcile import Agreement
    from protocol.round.timing import Timing
    from tests.support.agreement_sim import MAX_PAYLOAD, Member, binding_of, signer

    keys = [signer(i) for i in range(4)]
    binding = binding_of([k.peer_id for k in keys])
    me, a, b, holder = keys
    members = {k.peer_id: Member(k, binding, b"payload %d" % i) for i, k in enumerate(keys)}
    slot = 2.0

    g = PayloadGatherer.__new__(PayloadGatherer)  # the asking side only: no DHT, no process
    g.gather_timeout, g._round_no, g.waiting_for_silent = slot, 7, None
    g.timing = Timing().with_(answer_grace_s=0.2, answer_grace_factor=1.0)
    g._parent_pid = None

    async def fetch(peer, gid, owner, digest, deadline, began=None):
        loop = asyncio.get_running_loop()
        if not complete and owner == b.peer_id:
            began()  # a stream that began is waited for to the deadline, and never ends
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            raise asyncio.TimeoutError()
        if began is not None:
            began()
        return members[owner].envelope

    async def relay(peer, gid, request, deadline):
        if peer.to_bytes() == holder.peer_id:
            await asyncio.sleep(max(0.0, deadline - asyncio.get_running_loop().time()))
            raise asyncio.TimeoutError()
        if peer.to_bytes() == b.peer_id and not slowed:  # round 2 only
            slowed.append(peer)
            await asyncio.sleep(known_answers_after)
        return members[peer.to_bytes()].answer_for(me.peer_id, request, 2)

    g._fetch, g._relay = fetch, relay
    slowed: list = []

    async def main():
        loop = asyncio.get_running_loop()
        agreement = Agreement(binding, me, MAX_PAYLOAD)
        agreement.seal(b"payload 0")
        group = SimpleNamespace(agreement=agreement, group_id=b"group-1", held=set(), lagged=set(),
                                done=[asyncio.Event() for _ in range(agreement.rounds + 1)])
        t0 = loop.time()
        others = [PeerID(k.peer_id) for k in (a, b, holder)]
        await g._agree(group, others, strangers=frozenset({others[2].to_base58()} if stranger else ()))
        return loop.time() - t0, {p.to_bytes() for p in group.held}, {p.to_bytes() for p in group.lagged}

    return asyncio.run(main()), slot, holder.peer_id


def test_a_stranger_that_holds_a_later_round_is_cut_a_grace_after_the_others_once_we_hold_every_payload():
    """Holding a value of every sender, a later agreement round stops waiting for a stranger that holds
    our request a grace after the answers of the members we know (never before the last of them), and
    strikes it not (an honest newcomer on a slow link answers late too); lacking a value, it waits the
    round's deadline, as the member may hold what we lack (protocol/round/reconcile.py
    ``Agreement.may_stop_asking``), and so it does for a member we know, which may be an honest one
    still in its previous round. Before, the holder kept the round to half a slot past a slot: a new
    identity that served one member its payload held that member's exchange 23 s (bench/RESULTS.md, "A
    stranger that holds a later agreement round")."""
    (took, held, lagged), slot, holder = agree_with_a_holder()
    assert took < 0.5 * slot and held == set() and lagged == {holder}  # charged to the strangers' budget only
    (took, held, lagged), slot, holder = agree_with_a_holder(known_answers_after=1.0)
    assert 2 * 1.0 <= took < 1.5 * slot - 0.1 and held == set()  # a grace (as long again) after the slow known member
    (took, held, lagged), slot, holder = agree_with_a_holder(complete=False)
    assert took >= 1.5 * slot - 0.1 and holder in held  # round 1 to its deadline, round 2 to its own
    (took, held, lagged), slot, holder = agree_with_a_holder(stranger=False)
    assert took >= 1.5 * slot - 0.1 and holder in held and lagged == set()  # round 2 to its deadline


def test_only_strangers_may_be_cut_in_later_rounds():
    from peer.exchange.agreement_rounds import cuttable

    assert cuttable(frozenset({"a", "b", "x"}), frozenset({"a", "b", "me"})) == {"x"}
    assert cuttable(frozenset({"a", "x"}), frozenset({"me"})) == {"a", "x"}  # a run's first round: all new
    assert cuttable(frozenset({"a", "x"}), None) == set()
    assert cuttable(frozenset({"a", "b"}), frozenset({"a", "b"})) == set()
