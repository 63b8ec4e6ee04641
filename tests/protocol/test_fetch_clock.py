"""protocol/round/fetch_clock.py: when a group's first agreement round stops waiting for a sender that
has sent nothing, with time as an input."""

from __future__ import annotations

from protocol.round.fetch_clock import FetchClock
from protocol.round.timing import Timing

GRACE = Timing().with_(answer_grace_s=5.0).answer_grace  # at least 5 s here, or as long again as the others took


def clock(senders="abc", patient=()) -> FetchClock:
    return FetchClock(list(senders), started=100.0, slot=30.0, grace=GRACE, patient=patient)


def test_a_sender_that_sent_nothing_is_cut_a_grace_after_the_others_came_and_not_before():
    c = clock()
    assert c.deadline() is None  # a and b still on their way: nothing is due
    c.began("a", 100.5), c.began("b", 100.5)
    c.ended("a", 101.0, came=True)
    assert c.deadline() is None and c.cut(120.0) == set()  # b still streams
    c.ended("b", 102.0, came=True)
    assert c.deadline() == 107.0  # 2 s after the start, so the 5-s floor
    assert c.cut(106.9) == set()
    assert c.cut(107.0) == {"c"} and c.deadline() is None  # cut once, then nothing is left to cut


def test_the_grace_grows_with_the_time_the_others_took_and_a_grace_to_the_deadline_cuts_nobody():
    c = clock("ab")
    c.ended("a", 112.0, came=True)  # 12 s: the grace is as long again
    assert c.deadline() == 124.0
    c = clock("ab")
    c.ended("a", 125.0, came=True)  # 25 s: as long again would pass the slot's end, where the fetch ends
    assert c.deadline() is None and c.cut(131.0) == set()  # anyway: "sent nothing in time" is the group's verdict


def test_a_slow_sender_whose_bytes_flow_is_never_cut():
    # a home link streaming its payload for 20 s is waited for: only a sender that sent nothing is cut
    c = clock("ab")
    c.began("a", 100.5)
    c.ended("b", 101.0, came=True)
    assert c.deadline() is None and c.cut(129.0) == set()


def test_a_sender_that_begins_within_the_grace_is_waited_for_like_the_others():
    c = clock("abc")
    c.ended("a", 101.0, came=True), c.ended("b", 101.0, came=True)
    assert c.deadline() == 106.0
    assert c.began("c", 105.0) == 4.0  # its first bytes came 4 s after the others': a late opener, not a silent one
    assert c.deadline() is None and c.cut(110.0) == set()
    c.ended("c", 111.0, came=True)
    assert c.deadline() is None  # nobody left


def test_patient_members_wait_the_slot_and_do_not_shield_the_others():
    c = clock("abc", patient={"c"})  # c is in client mode: reached late, over connections it opens
    c.ended("a", 101.0, came=True)
    assert c.deadline() == 106.0
    assert c.cut(106.0) == {"b"}
    assert c.deadline() is None and c.cut(129.0) == set()


def test_nobody_is_cut_before_another_payload_came():
    # every member opening the group late (a loaded host) is not a group of silent members; and a fetch
    # that failed at once (a reset stream) is no payload that came
    c = clock("ab")
    assert c.deadline() is None and c.cut(129.0) == set()
    c.ended("a", 100.5, came=False)
    assert c.deadline() is None and c.cut(129.0) == set()
    c = clock("ab")
    c.ended("a", 103.0, came=True)
    assert c.deadline() == 108.0 and c.cut(108.0) == {"b"}
    c = clock("a")  # a group of two: the slot, then the matchmaking's refusal, bound a silent mate
    assert c.deadline() is None


def test_unknown_and_repeated_reports_change_nothing():
    c = clock("ab")
    c.began("x", 100.5), c.ended("x", 200.0, came=True), c.ended("a", 101.0, came=True), c.ended("a", 150.0, came=True)
    assert c.deadline() == 106.0


def test_how_late_a_sender_began_is_measured_only_once_the_others_ended():
    # what the caller logs of a near miss: an honest opener that came close to its grace
    c = clock("abc")
    assert c.grace() is None  # nothing came: nobody has a grace yet
    assert c.began("a", 100.2) is None  # another fetch still under way: not late
    c.ended("a", 101.0, came=True)
    assert c.began("b", 101.5) == 0.5  # nothing streamed once a's payload came: b's grace had begun
    c.ended("b", 102.0, came=True)
    assert c.grace() == 5.0
    assert c.began("c", 104.5) == 2.5  # 2.5 s after the last payload came
    assert c.began("c", 105.0) is None  # reported once


def test_the_wait_is_for_silent_senders_alone_from_a_share_of_their_grace():
    c = clock("abc")
    assert c.alone_from(0.25) is None
    c.ended("a", 101.0, came=True), c.ended("b", 102.0, came=True)
    assert c.deadline() == 107.0 and c.alone_from(0.25) == 103.25  # a quarter of the 5-s grace on
    c.began("c", 103.0)
    assert c.alone_from(0.25) is None  # it began: nobody is waited for alone


def test_nobody_is_cut_while_an_awaited_member_has_not_answered():
    # a later agreement round waits for the members we know to the deadline anyway: a stranger is cut a
    # grace after the last of their answers, not while one of them is still pending
    c = FetchClock(list("akx"), started=100.0, slot=30.0, grace=GRACE, awaited={"k"})
    c.ended("a", 101.0, came=True)
    assert c.deadline() is None and c.cut(107.0) == set()
    c.ended("k", 103.0, came=True)
    assert c.deadline() == 108.0 and c.cut(108.0) == {"x"}
