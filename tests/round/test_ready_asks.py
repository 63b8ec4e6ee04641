"""peer/exchange/ready_notices.py ``ReadyAsks``: a round barrier asks the peers it waits for directly, and their answers
stand in for a view that is a read interval old (peer/round/membership.py), with a scripted view, a
fake clock and fake answers."""

from __future__ import annotations

import dataclasses
import threading
from types import SimpleNamespace

from peer.round.membership import Membership
from peer.exchange.ready_notices import SET, ReadyAsks
from protocol.dht.records import encode_body, parse_progress
from protocol.round.timing import Timing
from tests.round.test_liveness import SPEC, progress, view


class Answer:
    """A question's future: done once the clock reaches ``at``."""

    def __init__(self, clock, at, body):
        self.clock, self.at, self.body = clock, at, body

    def done(self):
        return self.clock.now >= self.at

    def result(self):
        return self.body


class Notices:
    """Each peer answers ``answers[peer] = (seconds after it is asked, its record's bytes or None)``."""

    def __init__(self, clock, answers):
        self.clock, self.answers, self.asked = clock, answers, []

    def ask_ready(self, peer, round_no, wait, until=b"", with_list=False):
        self.asked.append((peer, round_no))
        self.kinds = [*getattr(self, "kinds", []), until]
        delay, body = self.answers.get(peer, (1e9, None))
        return Answer(self.clock, self.clock.now + delay, body)


def record(round_no, state, spec=None):
    p = progress(round_no, state)
    if spec is not None:
        p = dataclasses.replace(p, spec=spec)
    return encode_body(p.to_wire())


def membership(monkeypatch, clock, script) -> Membership:
    m = Membership(dht=None, spec=SPEC, peer_id="me", progress=lambda: None, stop=threading.Event())
    m.train_seconds = 20.0  # a straggler allowance of 10 s
    t0 = clock.now
    monkeypatch.setattr(m, "view", lambda: script(clock.now - t0))
    return m


def stale(t):
    """The view: "a" and "b" show training until a read at 8 s."""
    state = "ready" if t >= 8.0 else "training"
    return [view("me", 5, "ready"), view("a", 5, state), view("b", 5, state)]


def test_the_barrier_ends_when_the_peers_it_waits_for_say_they_are_done_not_at_the_next_read(monkeypatch, clock):
    notices = Notices(clock, {"a": (1.0, record(5, "ready")), "b": (2.0, record(5, "exchanging"))})
    m = membership(monkeypatch, clock, stale)
    t0 = clock.now
    barrier = m.wait_for_round(5, set(), first_round=False, notices=notices)
    assert 2.0 <= clock.now - t0 < 2.6
    assert barrier.ready == {"a", "b"} and barrier.expected == 3 and not barrier.gave_up
    assert sorted(notices.asked) == [("a", 5), ("b", 5)]  # one question each
    # without questions, the view's read at 8 s ends it
    m = membership(monkeypatch, clock, stale)
    t0 = clock.now
    m.wait_for_round(5, set(), first_round=False)
    assert clock.now - t0 >= 8.0


def test_an_answer_that_does_not_end_the_wait_is_asked_again_and_a_silent_peer_is_not(monkeypatch, clock):
    # "a" answers "still training" after its hold (1 s), then is asked again and answers ready; "b"
    # does not answer at all (an older voloco): not asked again, seen through the view at 8 s
    calls = {"a": 0}

    class Again(Notices):
        def ask_ready(self, peer, round_no, wait, until=b"", with_list=False):
            if peer == "a":
                calls["a"] += 1
                self.answers["a"] = (1.0, record(5, "training" if calls["a"] == 1 else "ready"))
            return super().ask_ready(peer, round_no, wait, until)

    notices = Again(clock, {"b": (0.5, None)})
    m = membership(monkeypatch, clock, stale)
    barrier = m.wait_for_round(5, set(), first_round=False, notices=notices)
    assert calls["a"] == 2 and [p for p, _ in notices.asked].count("b") == 1
    assert barrier.ready == {"a", "b"}


def test_answers_are_bounded_checked_and_stand_in_only_for_an_older_or_less_advanced_record(clock):
    timing = Timing().with_(ready_asked_max=2)
    notices = Notices(clock, {"a": (0.0, record(5, "ready")), "b": (0.0, b"\xc1 garbage"),
                              "c": (0.0, record(5, "ready", spec="another spec")), "m": (0.0, record(4, "exchanging"))})
    asks = ReadyAsks(notices, 5, SPEC.digest(), timing, clock.monotonic)
    asks.ask(["c", "b", "a", "m"], first={"m"})
    assert len(notices.asked) == 2 and notices.asked[0][0] == "m"  # the mate first, two at most
    asks.timing = Timing()
    asks.ask(["a", "b", "c"])
    assert {p for p, _ in notices.asked} == {"m", "a", "b", "c"}
    clock.sleep(0.1)
    views = [view("a", 5, "training"), view("m", 4, "exchanging"), view("b", 5, "training"), view("c", 5, "training")]
    # an answer that shows its peer further on stands in, even for a read that began after it (the
    # read can carry a record older than the answer)
    assert [v.progress.state for v in asks.overlay(views, read_began=clock.now + 1.0)][:2] == ["ready", "exchanging"]
    # an answer that does not parse or names another spec is dropped, and its peer not asked again
    assert [v.progress.state for v in asks.overlay(views, read_began=0.0)][2:] == ["training", "training"]
    asks.ask(["b", "c"])
    assert [p for p, _ in notices.asked].count("b") == 1 and [p for p, _ in notices.asked].count("c") == 1


def test_a_read_that_shows_a_peer_further_on_than_its_answer_wins(clock):
    # "a" answered "still training" (its hold ran out), then a read shows it ready: the read stands
    notices = Notices(clock, {"a": (0.0, record(5, "training"))})
    asks = ReadyAsks(notices, 5, SPEC.digest(), Timing(), clock.monotonic)
    asks.ask(["a"])
    clock.sleep(0.1)
    assert asks.overlay([view("a", 5, "ready")], read_began=0.0)[0].progress.state == "ready"
    # as far on: the later of the two stands
    later = asks.overlay([view("a", 5, "syncing")], read_began=clock.now + 1.0)
    assert later[0].progress.state == "syncing"
    assert asks.overlay([view("a", 5, "syncing")], read_began=0.0)[0].progress.state == "training"


def test_a_merges_answer_that_names_the_set_stands_in_for_a_read_that_does_not(clock):
    named = dataclasses.replace(progress(5, "exchanging"), gathered_round=5, gathered="e" * 32)
    notices = Notices(clock, {"a": (0.0, encode_body(named.to_wire())), "b": (0.0, record(5, "exchanging"))})
    asks = ReadyAsks(notices, 5, SPEC.digest(), Timing(), clock.monotonic, until=SET)
    asks.ask(["a", "b"])
    assert notices.kinds == [SET, SET]
    clock.sleep(0.1)
    # a read that began after the answer, of a replica that has not stored the record naming the set yet
    out = asks.overlay([view("a", 5, "exchanging"), view("b", 5, "exchanging")], read_began=clock.now + 1.0)
    assert out[0].progress.set_of(5) == "e" * 32 and out[1].progress.set_of(5) == ""
    # and a read that names a set wins over an answer that does not
    b_named = SimpleNamespace(peer_id="b", progress=dataclasses.replace(named, gathered="f" * 32), expires=0.0)
    assert asks.overlay([b_named], read_began=0.0)[0].progress.set_of(5) == "f" * 32


def test_silent_peers_take_no_slot_of_the_bound(clock):
    notices = Notices(clock, {p: (0.0, None) for p in "abc"})
    asks = ReadyAsks(notices, 5, SPEC.digest(), Timing().with_(ready_asked_max=2), clock.monotonic)
    for _ in range(3):
        asks.ask(["a", "b", "c", "d"])
        clock.sleep(0.1)
    assert {p for p, _ in notices.asked} == {"a", "b", "c", "d"}


def test_every_record_published_is_told_to_the_gatherer_and_a_failing_tell_stops_no_store(monkeypatch):
    from peer.round import membership as membership_mod

    stored, told = [], []
    monkeypatch.setattr(membership_mod, "publish_progress", lambda dht, run, peer, progress, ttl: stored.append(progress))
    m = Membership(dht=None, spec=SPEC, peer_id="me", progress=lambda: progress(5, "ready"), stop=threading.Event())
    m.publish()
    m.tell = told.append
    m.publish()
    assert len(stored) == 2 and [parse_progress(b).state for b in told] == ["ready"]

    def broken(body):
        raise BrokenPipeError

    m.tell = broken
    m.publish()
    assert len(stored) == 3


def test_a_peer_still_exchanging_the_round_before_is_waited_for(monkeypatch, clock):
    # "x" (no groupmate of ours) still exchanges round 4 when our barrier of round 5 begins; it is about
    # to train round 5 (with overlap it has already): a group whose exchange ended first would
    # otherwise take round 5 alone
    script = lambda t: [view("me", 5, "ready"), view("x", 5, "ready") if t >= 3.0 else view("x", 4, "exchanging")]
    m = membership(monkeypatch, clock, script)
    t0 = clock.now
    barrier = m.wait_for_round(5, set(), first_round=False)
    assert 3.0 <= clock.now - t0 < 3.5 and barrier.ready == {"x"}
    # asked directly, it answers once it is done with round 5
    notices = Notices(clock, {"x": (1.0, record(5, "ready"))})
    m = membership(monkeypatch, clock, lambda t: [view("me", 5, "ready"), view("x", 4, "exchanging")])
    t0 = clock.now
    assert m.wait_for_round(5, set(), first_round=False, notices=notices).ready == {"x"} and clock.now - t0 < 1.5
    # one still training the round before (it fell behind) is not: it joins a later round
    m = membership(monkeypatch, clock, lambda t: [view("me", 5, "ready"), view("x", 4, "training")])
    t0 = clock.now
    assert m.wait_for_round(5, set(), first_round=False).ready == frozenset() and clock.now - t0 < 0.5
