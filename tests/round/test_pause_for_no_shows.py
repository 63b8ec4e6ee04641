"""peer/round/loop.py ``RoundLoop._pause_for_no_shows``: an overlapped peer takes no step while its
exchange in flight waits for peers that have not come, alone (its barrier for strangers, or its group
for a member that sent nothing: peer/exchange/side_by_side.py sets the gatherer's flag), and goes on as
soon as the wait ends, the exchange ends or the peer stops."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from types import SimpleNamespace

from peer.round.loop import RoundLoop
from protocol.round.timing import Timing


def loop_with_exchange():
    """The parts of a RoundLoop the pause reads (the peer's flags, the exchange thread), and the event
    that says the exchange thread is alive (set)."""
    exchange_alive = threading.Event()
    exchange_alive.set()
    peer = SimpleNamespace(
        round=4,
        stop_event=threading.Event(),
        membership=SimpleNamespace(waiting_for_strangers=threading.Event(), timing=Timing()),
        gatherer=SimpleNamespace(waiting_for_silent=mp.Event()),  # set in the averager's process
    )
    thread = SimpleNamespace(is_alive=exchange_alive.is_set)
    return SimpleNamespace(peer=peer, _thread=thread), exchange_alive


def paused_for(loop, release) -> float:
    """Seconds ``_pause_for_no_shows`` held the caller while ``release()`` runs 0.3 s after it began."""
    timer = threading.Timer(0.3, release)
    timer.start()
    t0 = time.monotonic()
    RoundLoop._pause_for_no_shows(loop)
    held = time.monotonic() - t0
    timer.join()
    return held


def test_steps_pause_while_the_group_waits_for_a_silent_member_and_resume_when_it_ends():
    loop, alive = loop_with_exchange()
    silent = loop.peer.gatherer.waiting_for_silent
    silent.set()
    assert paused_for(loop, silent.clear) >= 0.25  # held until the grace ended (the cut)
    silent.set()
    assert paused_for(loop, alive.clear) >= 0.25  # ... or the exchange ended


def test_steps_pause_for_strangers_and_not_at_all_without_a_wait():
    loop, alive = loop_with_exchange()
    strangers = loop.peer.membership.waiting_for_strangers
    strangers.set()
    assert paused_for(loop, strangers.clear) >= 0.25
    assert paused_for(loop, lambda: None) < 0.1  # nothing waited for alone: no pause


def test_a_stopping_peer_is_not_held_by_the_pause():
    loop, alive = loop_with_exchange()
    loop.peer.gatherer.waiting_for_silent.set()
    assert paused_for(loop, loop.peer.stop_event.set) >= 0.25
    loop.peer.stop_event.clear()
    alive.clear()  # a flag left set by an exchange that is over holds nothing
    assert paused_for(loop, lambda: None) < 0.1
