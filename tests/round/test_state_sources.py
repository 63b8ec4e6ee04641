"""The round a catching-up peer takes, whom it asks for the state, peers that lie about both, and a fast
honest server whose rounds go by while its state travels: scripted views, a real StateSync and
engine, no processes."""

from __future__ import annotations

import dataclasses
import threading
from types import SimpleNamespace

import pytest

from peer.round import membership as membership_mod
from peer.round import state_sync
from peer.round.membership import Membership
from peer.round.state_sync import Basis
from protocol.dht.records import Progress
from peer.round.state_sync import order_sources
from protocol.round.round_policy import swarm_round
from tests.round.test_liveness import SPEC, honest_engine, progress, served, syncing_peer, view


def test_a_fast_server_whose_round_moved_on_during_the_download_is_believed_after_a_fresh_read(monkeypatch, clock):
    fast = honest_engine(12)
    views = [view("fast", 10, "ready")]

    def serve(peer):  # two solo rounds went by while its state travelled; its record now says so
        views[0] = view("fast", 12, "ready", fast.params_hash())
        views[0].progress = dataclasses.replace(views[0].progress, gathered_round=11, gathered="cd" * 16)
        return served(fast)

    sync, engine = syncing_peer(monkeypatch, views, serve)
    sync.catch_up()
    assert sync.asked == ["fast"] and engine.round == 12 and engine.params_hash() == fast.params_hash()
    assert [v.peer_id for v in sync.membership.others()] == ["fast"]  # not refused, not left out
    # the state's basis is read from the server's record after the download, not the stale one
    assert sync.basis == Basis(12, fast.params_hash(), "cd" * 16)


def test_a_server_still_announcing_less_than_it_served_is_refused(monkeypatch, clock):
    liar = honest_engine(500)
    views = [view("liar", 10, "ready"), view("a", 10, "ready")]
    honest = honest_engine(10, seed=2)
    sync, engine = syncing_peer(monkeypatch, views, lambda peer: served(liar) if peer == "liar" else served(honest))
    monkeypatch.setattr("peer.round.state_sync.order_sources", lambda views, target, **kw: list(views))  # the liar first
    sync.catch_up()
    assert sync.asked == ["liar", "a"] and engine.round == 10 and engine.params_hash() == honest.params_hash()
    assert [v.peer_id for v in sync.membership.others()] == ["a"]


def test_a_fresh_view_comes_from_a_read_begun_after_the_given_moment(monkeypatch, clock):
    m = Membership(dht=None, spec=SPEC, peer_id="me", progress=lambda: None, stop=threading.Event())
    claims = {"a": 3}
    monkeypatch.setattr(membership_mod, "read_progress", lambda dht, run_id: [view("a", claims["a"])])
    monkeypatch.setattr(membership_mod, "get_dht_time", lambda: 0.0)
    assert m.view()[0].progress.round == 3
    since = clock.now
    claims["a"] = 5
    assert m.view()[0].progress.round == 3  # within the read interval: the cached view
    assert m.fresh_view(since, timeout=5.0)[0].progress.round == 5 and m.read_began > since


def grouped(peer, round_no, params_hash, gathered=True):
    p = Progress(round=round_no, step=0, state="training", spec=SPEC.digest(), loss=0.0, val_loss=0.0, tokens=0,
                 tokens_per_s=0.0, bytes_sent=0, bytes_received=0, params_hash=params_hash, part=-1,
                 gathered_round=round_no - 1 if gathered else 0, gathered="ab" * 16 if gathered else "")
    return SimpleNamespace(peer_id=peer, progress=p, expires=0.0)


@pytest.mark.parametrize("case", ["solo", "not solo", "newcomers", "one peer"])
def test_a_peer_whose_solo_rounds_raced_ahead_takes_the_state_of_the_swarm_it_lost(monkeypatch, clock, case):
    swarm = honest_engine(20)
    h = swarm.params_hash()
    views = {
        "solo": [grouped("a", 20, h), grouped("b", 20, h)],
        "not solo": [grouped("a", 20, h), grouped("b", 20, h)],
        "newcomers": [grouped("a", 20, h, gathered=False), grouped("b", 20, h, gathered=False)],  # never in a group
        "one peer": [grouped("a", 20, h), grouped("b", 20, h, gathered=False)],
    }[case]
    sync, engine = syncing_peer(monkeypatch, views, lambda peer: served(swarm), own_round=30)
    sync.catch_up(solo=case != "not solo")
    if case == "solo":  # two peers that gather in groups, at an earlier round: their lineage wins
        assert engine.round == 20 and engine.params_hash() == h and len(sync.asked) == 1
        assert sorted(sync.membership.forgiven) == ["a", "b"]  # its no-shows are waited for again
        # what the state derives from: its round and θ, and the set its server named for the round before
        assert sync.basis == Basis(20, h, "ab" * 16)
    else:
        assert engine.round == 30 and sync.asked == []


def test_a_state_of_an_earlier_round_drops_the_abandoned_rounds_from_the_history():
    from peer.round.report import RoundRecord, Totals
    from peer.host.runtime import Peer

    records = [RoundRecord(r, f"{r:016x}", ["me"], 1, {}, 0, 0, 0.0, 0.0, 1.0) for r in range(1, 9)]
    peer = SimpleNamespace(totals=Totals(history=list(records)), engine=SimpleNamespace(round=5), _load_theta=lambda: None)
    Peer._installed(peer, 1000)
    assert [r.round for r in peer.totals.history] == [1, 2, 3, 4] and peer.totals.bytes_received == 1000
    peer.engine.round = 9  # a catch-up forward keeps every record
    Peer._installed(peer, 10)
    assert [r.round for r in peer.totals.history] == [1, 2, 3, 4]


def test_a_basis_is_a_lineage_only_for_its_round_and_its_theta():
    basis = Basis(12, "ab" * 8, "cd" * 16)
    assert basis.lineage(12, "ab" * 8) == (11, "cd" * 16)
    assert basis.lineage(13, "ab" * 8) is None  # a later round: the state is not this round's θ
    assert basis.lineage(12, "ef" * 8) is None  # θ changed since (a repair, a newer state)
    assert Basis(12, "ab" * 8, "").lineage(12, "ab" * 8) is None  # its server named no set


@pytest.mark.parametrize("frees_up", [True, False])
def test_a_busy_source_is_asked_again_after_the_others_and_never_left_out(monkeypatch, clock, frees_up):
    """A source that serves as many downloads as it will answers "busy" (protocol/round/serve_gate.py):
    not a silent source (no 60 s out of the view), asked again after the others, a bounded number of times."""
    from peer.round import state_sync
    honest = honest_engine(10)
    views = [view("busy", 10, "ready"), view("a", 10, "ready")]
    answers = {"busy": 0}

    def serve(peer):
        if peer == "busy":
            answers["busy"] += 1
            if frees_up and answers["busy"] == 3:
                return served(honest)
        return state_sync.BUSY

    sync, engine = syncing_peer(monkeypatch, views, serve)
    monkeypatch.setattr("peer.round.state_sync.order_sources", lambda views, target, **kw: list(views))
    sync.catch_up()
    if frees_up:
        assert sync.asked == ["busy", "a", "busy", "a", "busy"] and engine.params_hash() == honest.params_hash()
    else:  # every source busy: the catch-up gives up after BUSY_TRIES answers and a last one from each
        assert sync.asked == ["busy", "a", "busy", "a", "busy", "a"] and engine.round == 0
    assert [v.peer_id for v in sync.membership.others()] == ["busy", "a"]


def test_one_forged_round_far_ahead_does_not_set_the_swarm_round():
    assert swarm_round([2**62, 10, 10]) == 10
    assert swarm_round([2**62, 10]) == 10
    assert swarm_round([2**62, 0]) == 0
    assert swarm_round([11, 11, 10]) == 11
    assert swarm_round([7]) == 7 and swarm_round([]) == -1
    views = [view("liar", 2**62), view("a", 10), view("b", 11), view("c", 10)]
    ordered = [v.peer_id for v in order_sources(views, 10)]
    assert "liar" not in ordered and ordered[-1] == "b"  # rounds two peers report first
    assert [v.peer_id for v in order_sources([view("mate", 4)], 5, slack=1)] == ["mate"]


def test_sources_of_the_parameters_most_peers_of_a_round_report_come_first():
    # a pair that stopped waiting for the round's other groups holds θ of its own: a peer catching up
    # takes the majority's lineage, whichever order the views come in
    for _ in range(20):
        views = [view("p1", 7, params_hash="pair"), view("p2", 7, params_hash="pair")] + [
            view(f"m{i}", 7, params_hash="most") for i in range(3)]
        ordered = order_sources(views, 7)
        assert [v.progress.params_hash for v in ordered] == ["most"] * 3 + ["pair"] * 2
    # at the majority's θ, a few peers whose union differed unseen hold other tables: the tables most
    # peers at that θ report come first, so a newcomer does not take the minority's
    for _ in range(20):
        views = [view("odd", 7, params_hash="most"), view("pair", 7, params_hash="pair"),
                 view("pair2", 7, params_hash="pair")] + [view(f"m{i}", 7, params_hash="most") for i in range(3)]
        for v in views:
            v.progress = dataclasses.replace(v.progress, state_digest="other" if v.peer_id == "odd" else "usual")
        ordered = [v.peer_id for v in order_sources(views, 7)]
        assert sorted(ordered[:3]) == ["m0", "m1", "m2"] and ordered[3] == "odd"


def test_a_forged_round_far_ahead_does_not_block_a_newcomers_catch_up(monkeypatch, clock):
    honest = honest_engine(10)
    views = [view("liar", 2**62, "training"), view("a", 10, "training"), view("b", 10, "training")]
    sync, engine = syncing_peer(monkeypatch, views, lambda peer: served(honest) if peer != "liar" else served(honest, round_no=2**62))
    sync.catch_up()
    assert engine.round == 10 and engine.params_hash() == honest.params_hash() and "liar" not in sync.asked


@pytest.mark.parametrize("ahead", [1, 2**62])
def test_two_new_identities_vouching_for_each_other_cannot_hand_their_theta_to_a_peer(monkeypatch, clock, ahead):
    """Two new identities announce a round ahead of the swarm, each reporting the θ (and state digest)
    the other serves. A peer that knows live peers takes the round they report and only their state
    and reports; a newcomer takes the round most of the peers it sees report, from peers at that round
    (before: both followed the two, and every honest peer installed their θ; protocol/round/round_policy.py
    ``sync_target``)."""
    honest, forged = honest_engine(10, seed=1), honest_engine(10 + ahead, seed=9)
    theta_hash, digest = forged.hashes()
    liars = [SimpleNamespace(peer_id=p, progress=dataclasses.replace(progress(10 + ahead, "ready", theta_hash), state_digest=digest),
                             expires=0.0) for p in ("x", "y")]
    views = liars + [view(p, 10, "training") for p in ("a", "b", "c")]
    serve = lambda peer: served(forged) if peer in ("x", "y") else served(honest)  # noqa: E731
    for known, standing in (({"a", "b"}, {}), ((), {}), ((), {"a": 4, "c": 4})):  # met a, b; a newcomer; restored
        sync, engine = syncing_peer(monkeypatch, views, serve, known=known)
        engine.standing = dict(standing)  # a peer restored from a checkpoint knows its lineage's senders
        sync.catch_up()
        assert engine.round == 10 and engine.params_hash() == honest.params_hash()
        assert not {"x", "y"} & set(sync.asked)


def test_training_peers_report_their_theta_so_liars_at_the_round_cannot_hand_a_newcomer_theirs(monkeypatch, clock):
    """Two new identities at the swarm's round report a θ of their own while the honest peers train. A
    training peer's record reports θ's hash and state digest too (``Peer._progress``), so a newcomer
    takes the honest θ (before, training peers reported none, and the newcomer refused the honest θ
    as unreported and did not catch up)."""
    from peer.host.runtime import Peer

    honest, forged = honest_engine(10, seed=1), honest_engine(10, seed=9)
    fields = dict(state="training", step=3, membership=SimpleNamespace(digest=SPEC.digest()), last_loss=0.0, val_loss=0.0,
                  totals=SimpleNamespace(tokens=0, bytes_sent=0, bytes_received=0), tokens_per_s=0.0, role=None,
                  gathered=(9, ""), gathered_before="", gathered_from="")
    record = Peer._progress(SimpleNamespace(engine=honest, **fields))
    assert (record.round, record.params_hash, record.state_digest) == (10, *honest.hashes())
    theta_hash, digest = forged.hashes()
    liars = [SimpleNamespace(peer_id=p, progress=dataclasses.replace(progress(10, "ready", theta_hash), state_digest=digest),
                             expires=0.0) for p in ("x", "y")]
    honest_views = [SimpleNamespace(peer_id=p, progress=record, expires=0.0) for p in ("a", "b", "c")]
    serve = lambda peer: served(forged) if peer in ("x", "y") else served(honest)  # noqa: E731
    for order in (liars + honest_views, honest_views + liars):
        sync, engine = syncing_peer(monkeypatch, order, serve)
        sync.catch_up()
        assert engine.round == 10 and engine.params_hash() == honest.params_hash()


def test_a_state_unreported_only_because_its_round_is_still_finishing_does_not_hide_its_server(monkeypatch, clock):
    """A round ended in two θ: d, alone, published its record of round 48 first; a and c, the majority,
    still announce round 47 while their states are of round 48. A peer catching up refuses their
    states as unreported (d's θ is the only one reported), but does not hide a and c: when its next
    start vote names their θ, they are the sources of the repair (before: both hidden for ten
    minutes, and the peer kept the minority's θ for rounds). A server is spared once in
    ``Timing.refuse_source_s``, and only where it and another live peer, not this one, announce
    the round before; otherwise a state no peer reports hides its server, as before."""
    majority, minority = honest_engine(48, seed=1), honest_engine(48, seed=2)
    views = [view("a", 47, "ready", "1" * 16), view("c", 47, "ready", "1" * 16), view("d", 48, "ready", minority.params_hash())]
    monkeypatch.setattr(state_sync, "order_sources", lambda views, target, **kw: list(views))
    serve = lambda peer: served(minority if peer == "d" else majority)  # noqa: E731
    sync, engine = syncing_peer(monkeypatch, views, serve, own_round=40, known=("a", "c", "d"))
    sync.catch_up()
    assert sync.asked == ["a", "c", "d"] and engine.round == 48 and engine.params_hash() == minority.params_hash()
    assert {v.peer_id for v in sync.membership.others()} == {"a", "c", "d"}  # nobody hidden
    sync.catch_up(even_at_same_round=True, only={"a", "c"})  # the repair its next start vote asks for
    assert sync.asked[3:] == ["a"] and engine.params_hash() == majority.params_hash()
    engine.round = 40  # behind again within the window: a's unreported θ hides it now
    sync.catch_up()
    assert sync.asked[4:6] == ["a", "c"] and "a" not in {v.peer_id for v in sync.membership.others()}

    def hidden(views, fresh_extra=(), repair=False):
        """Whether x, serving a θ no peer reports, is left out of the view of a peer catching up (or,
        ``repair``, of one at round 47 whose start vote named x's and a's start: no vouchers then)."""
        sync, engine = syncing_peer(monkeypatch, views, lambda peer: served(minority if peer == "x" else majority),
                                    own_round=47 if repair else 40, known={v.peer_id for v in views})
        shown = sync.membership.fresh_view
        sync.membership.fresh_view = lambda since, timeout: shown(since, timeout) + list(fresh_extra)
        sync.catch_up(even_at_same_round=True, only={"x", "a"}) if repair else sync.catch_up()
        assert sync.asked[0] == "x" and engine.params_hash() != minority.params_hash()
        return "x" not in {v.peer_id for v in sync.membership.others()}

    at_48 = [view(p, 48, "ready", majority.params_hash()) for p in ("a", "c")]
    assert not hidden([view("x", 47, "ready"), view("b", 47, "ready")] + at_48)  # b may yet report x's θ
    assert hidden([view(p, 48, "ready", majority.params_hash()) for p in ("x", "a", "c")])  # nobody at 47
    # (x's record reports a θ of round 47, so that a repair asks it first: records with a hash come first)
    assert hidden([view("x", 47, "ready", "9" * 16)] + at_48, fresh_extra=[view("me", 47, "training")], repair=True)  # only we are
    assert not hidden([view("x", 47, "ready", "9" * 16), view("b", 47, "ready")] + at_48, repair=True)
    assert hidden([view("x", 47, "ready"), view("b", 47, "starting")] + at_48)  # b's record says nothing yet
