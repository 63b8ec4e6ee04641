"""A peer that ended a round off its group's parameters takes the group's state of that round,
even when its groupmates have not published the round yet (the race a SIGKILL test once hit:
two peers flip-flopping between two parameter sets, each refusing the other's older state)."""

from types import SimpleNamespace

import pytest

from peer.round import state_sync
from peer.round.state_sync import StateSync
from protocol.dht.records import Progress
from protocol.round.timing import Timing
from swarm.records import PeerView


@pytest.fixture
def clock(monkeypatch):
    """state_sync's time, advanced by its sleeps only."""
    now = [1000.0]
    monkeypatch.setattr(state_sync, "time", SimpleNamespace(monotonic=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s)))
    return now


class Gatherer:
    """Serves the groupmate's state: first the round it is still finishing, then the new one."""

    def __init__(self, rounds):
        self.rounds = list(rounds)
        self.calls = 0

    def load_state(self, timeout):
        self.calls += 1
        served = self.rounds.pop(0) if self.rounds else None
        return None if served is None else ({"round": served}, [])


def make_peer(own_round, others_round, served_rounds):
    """A StateSync of a peer at ``own_round`` whose one groupmate shows ``others_round``."""
    view = PeerView("mate", Progress(others_round, 0, "exchanging", "d", 0.0, 0.0, 0, 0.0, 0, 0, "e" * 16), 0.0)
    shown = {"state": "exchanging"}

    def set_state(state):
        previous, shown["state"] = shown["state"], state
        return previous

    peer = object.__new__(StateSync)
    peer.spec = SimpleNamespace(swarm=SimpleNamespace(gather_timeout=1.0))
    peer.engine = SimpleNamespace(round=own_round, params_hash=lambda: "0" * 16, standing={})
    peer.gatherer = Gatherer(served_rounds)
    peer.hidden = []
    peer.membership = SimpleNamespace(others=lambda excluding=(): [view], ignore=lambda who, seconds, lied=True: peer.hidden.append(who),
                                      view=lambda: [view], lied=lambda who: who in peer.hidden, digest="d",
                                      timing=Timing(gather_slot_s=1.0), known=lambda: frozenset({"me"}))
    peer.peer_id, peer.consistent, peer._spared = "me", False, {}
    peer._set_state, peer.enable_sharing = set_state, lambda: None
    peer.installed, peer.shown = [], shown
    peer._failed_target = (-1, 0.0)
    peer.download = lambda source, timeout: peer.gatherer.load_state(timeout)

    def install(meta, tensors, min_round=0, **checks):
        if meta["round"] < min_round:
            raise state_sync.StateTooOld(f"state of round {meta['round']} is older than the swarm's round {min_round}")
        peer.installed.append(meta["round"])

    peer.install = install
    return peer


def test_resync_waits_for_the_groupmate_to_publish_the_round(monkeypatch):
    monkeypatch.setattr(state_sync.time, "sleep", lambda s: None)
    # we finished round 2 -> 3; the groupmate still shows round 2 and first serves its round-2 state
    peer = make_peer(own_round=3, others_round=2, served_rounds=[2, 3])
    peer.catch_up(even_at_same_round=True)
    assert peer.installed == [3] and peer.consistent and peer.gatherer.calls == 2
    assert peer.shown["state"] == "exchanging"  # restored after syncing


def test_resync_gives_up_cleanly_when_nobody_serves_the_round(monkeypatch):
    monkeypatch.setattr(state_sync.time, "sleep", lambda s: None)
    peer = make_peer(own_round=3, others_round=2, served_rounds=[2, 2, 2])
    peer.catch_up(even_at_same_round=True)
    assert peer.installed == [] and not peer.consistent and peer.gatherer.calls == 3


def test_ordinary_catch_up_only_downloads_from_peers_ahead(monkeypatch):
    monkeypatch.setattr(state_sync.time, "sleep", lambda s: None)
    peer = make_peer(own_round=3, others_round=3, served_rounds=[3])
    peer.catch_up()
    assert peer.gatherer.calls == 0
    peer = make_peer(own_round=3, others_round=5, served_rounds=[5])
    peer.catch_up()
    assert peer.installed == [5]


def test_a_peer_that_installs_another_round_shows_no_done_state_for_it(monkeypatch):
    # a peer that found no group ("exchanging" round 2) takes the swarm's round 4: it has not trained
    # round 4, so it shows "training" there, not "exchanging" (a barrier of round 4 would count it ready)
    monkeypatch.setattr(state_sync.time, "sleep", lambda s: None)
    peer = make_peer(own_round=2, others_round=4, served_rounds=[4])
    install = peer.install

    def install_round(meta, tensors, **checks):
        install(meta, tensors, **checks)
        peer.engine.round = meta["round"]

    peer.install = install_round
    peer.catch_up()
    assert peer.installed == [4] and peer.shown["state"] == "training"


def test_a_repair_asks_its_groupmate_again_and_hides_it_from_nobody(monkeypatch):
    """The groupmate our start vote named already shows the round we concluded, yet first serves the
    round before (its round still ending) and then nothing (a stream that broke): a repair asks it
    again and takes its state. An ordinary download from the same sequence refuses the source and
    hides it; a repair that hid its only source would leave the peer off its group's θ for rounds
    (CI: two peers of one group ended round 3 on two θ, the loser's one download refused)."""
    monkeypatch.setattr(state_sync.time, "sleep", lambda s: None)
    peer = make_peer(own_round=3, others_round=3, served_rounds=[2, None, 3])
    peer.catch_up(even_at_same_round=True, only={"mate"})
    assert peer.installed == [3] and peer.consistent and peer.gatherer.calls == 3 and peer.hidden == []
    peer = make_peer(own_round=3, others_round=3, served_rounds=[2, None, 3])
    peer.catch_up(even_at_same_round=True)  # not a repair: an older state than announced is refused
    assert peer.installed == [] and not peer.consistent and peer.hidden == ["mate"]


def test_a_repair_asks_the_groupmates_its_view_does_not_show_yet(monkeypatch):
    """The groupmates our start vote named are asked for the group's state whatever their records say
    yet: one whose last record we read still says "starting" in round 0, and one we have read no
    record of (before, both were left out, and the repair returned at once without a word). A
    groupmate ignored for lying, or whose record says it stopped, is not asked."""
    monkeypatch.setattr(state_sync.time, "sleep", lambda s: None)
    lagging = PeerView("lagging", Progress(0, 0, "starting", "d", 0.0, 0.0, 0, 0.0, 0, 0, "e" * 16), 0.0)
    stopped = PeerView("stopped", Progress(3, 0, "stopped", "d", 0.0, 0.0, 0, 0.0, 0, 0, ""), 0.0)
    for mates, served, asked in (({"lagging"}, [3], ["lagging"]), ({"unread"}, [3], ["unread"]),
                                 ({"liar", "stopped"}, [3], []), ({"lagging", "mate"}, [3], ["mate"])):
        peer = make_peer(own_round=3, others_round=3, served_rounds=served)
        peer.hidden.append("liar")
        peer.hidden.append("silent")  # left out for silence, not for lying: still a groupmate to ask
        peer.membership.others = lambda excluding=(): [v for v in (lagging, stopped) if v.progress.state not in excluding]
        peer.membership.view = lambda: [lagging, stopped, peer_view("mate", 3)]
        peer.membership.lied = lambda who: who == "liar"
        calls = []
        peer.download = lambda source, timeout: calls.append(source) or peer.gatherer.load_state(timeout)
        peer.catch_up(even_at_same_round=True, only=mates)
        assert calls == asked and peer.installed == ([3] if asked else [])


def peer_view(peer, round_no):
    return PeerView(peer, Progress(round_no, 0, "exchanging", "d", 0.0, 0.0, 0, 0.0, 0, 0, "e" * 16), 0.0)


def test_a_repair_waits_for_its_groupmate_a_gather_slot_and_a_set_fetch_then_gives_up_without_hiding_it(clock):
    """A groupmate whose merge of other groups' sets is slow serves the round before for a while, or
    nothing: the repair asks again, a pause growing by a second each time, past the 3 downloads of a
    catch-up, until a gather slot and a set fetch (1 + 10 s here) have passed; then it gives up,
    and hides the groupmate from nobody: the next round's repair may ask it again."""
    peer = make_peer(own_round=3, others_round=3, served_rounds=[2, None, 2, 2, 3])
    peer.catch_up(even_at_same_round=True, only={"mate"})
    assert peer.installed == [3] and peer.consistent and peer.gatherer.calls == 5 and peer.hidden == []
    began = clock[0]
    peer = make_peer(own_round=3, others_round=3, served_rounds=[2] * 50)
    peer.catch_up(even_at_same_round=True, only={"mate"})
    assert peer.installed == [] and not peer.consistent and peer.hidden == []
    assert 3 < peer.gatherer.calls < 10 and clock[0] - began <= 1.0 + peer.membership.timing.set_fetch_s + 1e-6
