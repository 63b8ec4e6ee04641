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
