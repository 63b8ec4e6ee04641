"""Liveness against records that lie: a peer announced but never arriving, forged rounds, poisoned
states. The round barrier and state sync run on scripted views and a fake clock: no processes,
no network, well under a second of waiting."""

from __future__ import annotations

import dataclasses
import logging
import threading
from types import SimpleNamespace

import pytest
import torch

from peer.round import membership as membership_mod
from peer.round import state_sync
from peer.round.membership import Membership
from peer.outer.engine import RoundEngine
from peer.checkpoints.files import params_hash
from peer.round.state_sync import MAX_ATTEMPTS, StateSync
from peer.outer.strategies import make_strategy
from protocol.errors import ProtocolError
from protocol.dht.records import Progress
from protocol.spec import RunSpec
from protocol.round.timing import Timing

SPEC = RunSpec().replace(
    model={"d_model": 16, "n_layers": 1, "n_heads": 2, "ffn_hidden": 32, "seq_len": 8},
    outer={"strategy": "diloco"},
    swarm={"round_wait": 60.0, "heartbeat_period": 0.5},
)


def progress(round_no, state, params_hash=""):
    return Progress(round=round_no, step=0, state=state, spec=SPEC.digest(), loss=0.0, val_loss=0.0, tokens=0,
                    tokens_per_s=0.0, bytes_sent=0, bytes_received=0, params_hash=params_hash, part=-1)


def view(peer, round_no, state="ready", params_hash=""):
    return SimpleNamespace(peer_id=peer, progress=progress(round_no, state, params_hash), expires=0.0)


def barrier_peer(monkeypatch, clock, script, train_seconds=4.0):
    """A Membership whose view at time t (seconds since the barrier started) is ``script(t)``."""
    m = Membership(dht=None, spec=SPEC, peer_id="me", progress=lambda: None, stop=threading.Event())
    m.train_seconds = train_seconds
    holder = {}
    monkeypatch.setattr(m, "view", lambda: script(clock.now - holder["t0"]))

    def wait(round_no, mates=frozenset()):
        holder["t0"] = clock.now
        barrier = m.wait_for_round(round_no, set(mates), first_round=False)
        return barrier, clock.now - holder["t0"]

    return m, wait


def honest_then_ready(at):
    """Honest peers a and b become ready at ``at`` seconds; x claims "training" for ever."""

    def script(t):
        return [view("me", 5, "ready"), view("x", 5, "training")] + [
            view(p, 5, "ready" if t >= at[p] else "training") for p in ("a", "b")
        ]

    return script


def test_a_peer_announced_but_never_arriving_delays_one_round_by_the_allowance_only(monkeypatch, clock, caplog):
    m, wait = barrier_peer(monkeypatch, clock, honest_then_ready({"a": 1.0, "b": 3.0}))
    assert m.straggler_allowance() == Timing.straggler_min_s  # half of 4 s of training is less than the minimum
    with caplog.at_level(logging.INFO):
        barrier, waited = wait(5)
    assert barrier.expected == 3 and not barrier.alone
    assert 3.0 + Timing.straggler_min_s <= waited <= 3.0 + Timing.straggler_min_s + 0.5  # not round_wait (60 s)
    assert "not waiting longer" in caplog.text and "x" in caplog.text

    # the next round's group was a and b: x did not show up, and is not waited for again
    barrier, waited = wait(5, mates={"a", "b"})
    assert waited <= 3.0 + 0.5 and m.no_shows == {"x"}

    # once x is in a group of ours it counts again
    m.wait_for_round(5, {"a", "b", "x"}, first_round=False)
    assert m.no_shows == set()


def test_reads_that_miss_every_peer_seen_live_lately_are_no_empty_swarm(monkeypatch, clock, caplog):
    # 32 peers on 2 cores: a peer that had just counted 32 started found an empty view at its first
    # barrier, trained round 1 alone and took a pair into a lineage of its own for two rounds
    m = Membership(dht=None, spec=SPEC, peer_id="me", progress=lambda: None, stop=threading.Event())
    t0 = clock.now

    def reads(dht, run_id):  # records expire at once (expires 0): only reads keep them in the view
        t = clock.now - t0
        if t < 1.0:
            return [view("a", 0, "training"), view("b", 0, "training"), view("gone", 0, "stopped")]
        return [] if t < 20.0 else [view("a", 0, "ready"), view("b", 0, "ready")]

    monkeypatch.setattr(membership_mod, "read_progress", reads)
    assert {v.peer_id for v in m.others()} == {"a", "b"}
    clock.sleep(5.0)
    assert not m.others() and m.lost_sight() and not m.swarm_is_empty()
    with caplog.at_level(logging.INFO):
        barrier = m.wait_for_round(0, set(), first_round=True)
    assert not barrier.alone and barrier.expected == 3 and clock.now - t0 >= 20.0
    assert "found no other peer, though 2 were live" in caplog.text
    # out of sight for LIVE_MEMORY_TTLS record TTLs: an empty view is an empty swarm again
    monkeypatch.setattr(membership_mod, "read_progress", lambda dht, run_id: [])
    clock.sleep(Timing.live_memory_ttls * m.ttl() + 1.0)
    assert m.swarm_is_empty() and m.wait_for_round(1, set(), first_round=False).alone


def test_a_no_show_is_nobody_to_meet_and_a_forged_round_does_not_put_us_behind(monkeypatch, clock):
    script = lambda t: [view("me", 5), view("b", 5), view("x", 5, "training"), view("far", 2**62, "training")]  # noqa: E731
    m, wait = barrier_peer(monkeypatch, clock, script)
    m.missed({"x"}, 4)  # waited for in vain in round 4
    barrier, waited = wait(5, mates=set())
    assert waited < 0.5 and barrier.expected == 2 and not barrier.behind and not barrier.alone  # "far" is not the swarm
    m, wait = barrier_peer(monkeypatch, clock, lambda t: [view("me", 5), view("x", 5, "training")])
    m.missed({"x"}, 4)  # waited for in vain in round 4
    barrier, _ = wait(5, mates=set())
    assert barrier.alone  # a lone honest peer beside a staller trains alone instead of waiting for a group


def test_slower_peers_that_then_gathered_in_a_group_of_their_own_are_not_no_shows(monkeypatch, clock):
    # a and b were still training when our barrier gave up on them; they then gathered together
    # (both name one set for round 5), while x only claims a set nobody else names: x is a no-show
    m, wait = barrier_peer(monkeypatch, clock, lambda t: [view("me", 5)] + [view(p, 5, "training") for p in "abx"])
    wait(5)
    later = [view("me", 5)] + [view(p, 6, "training") for p in "abx"]
    for v, digest in zip(later[1:], ("1" * 32, "1" * 32, "2" * 32)):
        v.progress = dataclasses.replace(v.progress, gathered_round=5, gathered=digest)
    monkeypatch.setattr(m, "view", lambda: later)
    m.wait_for_round(5, set(), first_round=False)  # our gather of round 5 found no group: we try the round again
    assert m.no_shows == {"x"}


def test_peers_still_coming_to_the_round_are_judged_later_not_struck(monkeypatch, clock):
    # a, b and x were training round 5 when our barrier gave up on them (step 3). By our next barrier,
    # a is matchmaking and b trained on; x has not moved: only x is a no-show now
    m, wait = barrier_peer(monkeypatch, clock, lambda t: [view("me", 5)] + [view(p, 5, "training") for p in "abx"])
    wait(5)
    now = [view("me", 6), view("a", 5, "exchanging"), view("b", 5, "training"), view("x", 5, "training")]
    now[2].progress = dataclasses.replace(now[2].progress, step=now[2].progress.step + 4)
    monkeypatch.setattr(m, "view", lambda: now)
    m.wait_for_round(6, set(), first_round=False)
    assert m.no_shows == {"x"} and set(m._carried) == {"a", "b"}
    # a and b then gathered in a group of their own: they came, and are never struck
    later = [view("me", 7)] + [view(p, 6, "training") for p in "ab"]
    for v in later[1:]:
        v.progress = dataclasses.replace(v.progress, gathered_round=5, gathered="1" * 32)
    monkeypatch.setattr(m, "view", lambda: later)
    m.wait_for_round(7, set(), first_round=False)
    # (round 6's barrier waited for a, still exchanging round 5 there: it trains round 6 now, so it is
    # judged later for that wait, not struck)
    assert m.no_shows == {"x"} and m._carried == {"a": 6}


def test_a_peer_that_claims_to_keep_coming_is_struck_after_the_carry(monkeypatch, clock):
    m, wait = barrier_peer(monkeypatch, clock, lambda t: [view("me", 5), view("liar", 5, "training")])
    wait(5)
    stuck = [view("me", 5), view("liar", 5, "ready")]  # ready in round 5 for ever, never gathering
    monkeypatch.setattr(m, "view", lambda: stuck)
    struck = []
    for round_no in range(6, 6 + Timing.carry_rounds + 1):
        m.wait_for_round(round_no, set(), first_round=False)
        struck.append("liar" in m.no_shows)
    # round 6's barrier waits for it (still exchanging round 5, as far as it says) and round 7's strikes it
    assert struck[1] and not m._carried


def test_ignored_peers_are_left_out_of_the_view_for_a_while(monkeypatch, clock):
    m = Membership(dht=None, spec=SPEC, peer_id="me", progress=lambda: None, stop=threading.Event())
    monkeypatch.setattr(membership_mod, "read_progress", lambda dht, run_id: [view("liar", 9), view("a", 3)])
    m.ignore("liar", 60.0)
    assert [v.peer_id for v in m.view()] == ["a"]
    clock.sleep(61.0)
    assert [v.peer_id for v in m.view()] == ["liar", "a"]


def test_a_first_round_waits_for_a_peer_still_starting_in_it_and_no_longer_than_the_allowance(monkeypatch, clock):
    # two peers started together: one reached round 0's barrier while the other still loaded its model
    # ("starting"). Trained alone, round 0 left the two on two lineages; with a --client-mode peer ahead the
    # other could not download its state, and the two trained apart for a minute (CI: 70-141 s, alone 16 s)
    m = Membership(dht=None, spec=SPEC, peer_id="me", progress=lambda: None, stop=threading.Event())
    m.train_seconds = 4.0
    t0 = clock.now

    def script(t):
        return [view("me", 0, "ready"), view("a", 0, "starting" if t < 2.0 else "training" if t < 3.0 else "ready")]

    monkeypatch.setattr(m, "view", lambda: script(clock.now - t0))
    barrier = m.wait_for_round(0, set(), first_round=True)
    assert barrier.expected == 2 and barrier.ready == {"a"} and 3.0 <= clock.now - t0 < 3.5
    # past the first round a peer still starting is not waited for (it may be loading for minutes)
    t0 = clock.now
    barrier = m.wait_for_round(0, set(), first_round=False)
    assert clock.now - t0 < 0.5 and barrier.expected == 1
    # one that stays "starting" holds a first round for the allowance only, not round_wait (60 s)
    monkeypatch.setattr(m, "view", lambda: [view("me", 0, "ready"), view("slow", 0, "starting")])
    t0 = clock.now
    barrier = m.wait_for_round(0, set(), first_round=True)
    assert barrier.expected == 1 and clock.now - t0 <= m.straggler_allowance() + 0.5


def test_honest_stragglers_arriving_one_after_another_are_all_waited_for(monkeypatch, clock):
    # each arrives within the allowance of the previous one: nobody is left behind
    at = {"a": 4.0, "b": 8.0}
    m, wait = barrier_peer(monkeypatch, clock, lambda t: [view("me", 5), *(view(p, 5, "ready" if t >= at[p] else "training") for p in at)])
    barrier, waited = wait(5)
    assert barrier.expected == 3 and 8.0 <= waited < 9.0 and m._waited == set()


def test_the_allowance_follows_the_training_time_and_never_exceeds_round_wait(monkeypatch, clock):
    m, _ = barrier_peer(monkeypatch, clock, lambda t: [], train_seconds=30.0)
    assert m.straggler_allowance() == 15.0
    m.train_seconds = 1000.0
    assert m.straggler_allowance() == SPEC.swarm.round_wait


def test_training_time_is_measured_from_the_published_states(monkeypatch, clock):
    m = Membership(dht=None, spec=SPEC, peer_id="me", progress=lambda: None, stop=threading.Event())
    m._note_state("training")
    clock.sleep(7.0)
    m._note_state("training")  # a heartbeat in the same state
    clock.sleep(1.0)
    m._note_state("ready")
    assert m.train_seconds == 8.0


def test_only_what_other_peers_act_on_is_published_at_once(monkeypatch, clock):
    stored = []
    monkeypatch.setattr(membership_mod, "publish_progress", lambda dht, run, peer, p, ttl: stored.append(p))
    now = {"p": progress(3, "training", "aa")}
    m = Membership(dht=None, spec=SPEC, peer_id="me", progress=lambda: now["p"], stop=threading.Event())
    m.publish()
    assert len(stored) == 1

    def step(**changes):
        now["p"] = dataclasses.replace(now["p"], **changes)
        m.publish(only_if_due=True)
        return len(stored)

    assert step(loss=2.5, tokens=900, step=7) == 1  # numbers only: the keep-alive carries them
    assert step(state="ready") == 2
    assert step(state="exchanging") == 2  # as good as "ready" to the round barrier
    assert step(gathered_round=3, gathered="ab" * 16) == 3  # other groups fetch the set it names
    assert step(round=4, params_hash="bb", state="training") == 4
    clock.sleep(m.keepalive_s())
    assert step(val_loss=1.9) == 5 and stored[-1].val_loss == 1.9  # the keep-alive


# ---- catching up against lying peers -------------------------------------------------------------
def served(engine, spec=SPEC, round_no=None, **changes):
    meta, tensors = engine.shareable()
    meta["spec"] = spec.digest()
    if round_no is not None:
        meta["round"] = round_no
    for index, tensor in changes.items():
        tensors[int(index[1:])] = tensor
    return meta, tensors


def syncing_peer(monkeypatch, views, serve, own_round=0, known=()):
    """A real StateSync (real engine and checks) whose view is ``views`` and whose downloads ``serve(peer)``;
    ``known``: the peers it has met or that have standing (none: a newcomer)."""
    monkeypatch.setattr(state_sync, "StateDownloader", lambda dht, gatherer, min_rate: None)
    theta = {n: torch.zeros(s) for n, s in SPEC.param_shapes().items()}
    engine = RoundEngine(make_strategy(SPEC), theta)
    engine.round = own_round
    shown, ignored = [], {}
    gatherer = SimpleNamespace()
    visible = lambda: [v for v in views if ignored.get(v.peer_id, 0) <= state_sync.time.monotonic()]  # noqa: E731
    membership = SimpleNamespace(
        dht=None, others=lambda excluding=(): visible(), fresh_view=lambda since, timeout: visible(), view=visible,
        lied=lambda peer: ignored.get(peer, 0) > state_sync.time.monotonic(), digest=SPEC.digest(),
        read_interval=lambda: 0.5, ignore=lambda peer, seconds, lied=True: ignored.__setitem__(peer, state_sync.time.monotonic() + seconds),
        forgiven=[], timing=Timing.from_spec(SPEC), known=lambda: frozenset(known) | {"me"},
    )
    membership.forgive = lambda peers: membership.forgiven.extend(peers)
    sync = StateSync(SPEC, engine, gatherer, membership, "me", set_state=lambda s: shown.append(s) or "training",
                     on_installed=lambda n: None)
    sync.asked = []

    def download(peer, timeout):
        sync.asked.append(peer)
        return serve(peer)

    sync.download = download
    return sync, engine


def honest_engine(round_no, seed=1):
    gen = torch.Generator().manual_seed(seed)
    engine = RoundEngine(make_strategy(SPEC), {n: torch.randn(s, generator=gen) * 0.02 for n, s in SPEC.param_shapes().items()})
    engine.strategy.momentum = {n: torch.randn(s, generator=gen) * 1e-3 for n, s in SPEC.param_shapes().items()}
    engine.round = round_no
    return engine


@pytest.mark.parametrize("poison", ["float64 1e300", "nan momentum", "beyond the bound", "hash", "older than claimed", "far ahead"])
def test_a_poisoned_state_is_refused_and_its_server_not_asked_again(monkeypatch, clock, poison):
    honest = honest_engine(10)
    n_theta = len(SPEC.param_shapes())
    meta, tensors = served(honest)
    if poison == "float64 1e300":
        bad = served(honest, t0=torch.full_like(tensors[0], 1e300, dtype=torch.float64))
    elif poison == "nan momentum":
        bad = served(honest, **{f"t{n_theta}": torch.full_like(tensors[n_theta], float("nan"))})
    elif poison == "beyond the bound":
        bad = served(honest, t0=tensors[0] + 1e7)
    elif poison == "hash":
        bad = served(honest, t0=tensors[0] + 0.5)
    elif poison == "older than claimed":
        bad = served(honest, round_no=3)
    else:
        bad = served(honest, round_no=500)
    views = [view("liar", 10, "ready", honest.params_hash()), view("a", 10, "ready", honest.params_hash()), view("b", 10, "training")]
    monkeypatch.setattr(state_sync, "order_sources", lambda views, target, **kw: list(views))  # the liar first
    sync, engine = syncing_peer(monkeypatch, views, lambda peer: bad if peer == "liar" else served(honest))
    sync.catch_up()
    assert sync.asked == ["liar", "a"] and engine.round == 10 and engine.params_hash() == honest.params_hash()
    assert all(torch.isfinite(t).all() for t in engine.strategy.momentum.values())
    engine.round = 9  # behind again: the liar is not asked again
    sync.catch_up()
    assert sync.asked[2:] == ["a"]


def test_a_state_newer_than_the_view_is_checked_against_a_view_read_after_the_download(monkeypatch, clock):
    """The first view shows the peers' round-10 records from before they applied the round's delayed
    update; the server's state has it. A view read after the download shows the new θ: installed, and
    nobody refused (before: every honest server refused, and left out of the view for 10 minutes)."""
    before, after = honest_engine(10, seed=1), honest_engine(10, seed=2)
    stale = [view(p, 10, "training", before.params_hash()) for p in ("a", "b", "c")]
    fresh = [view(p, 10, "training", after.params_hash()) for p in ("a", "b", "c")]
    sync, engine = syncing_peer(monkeypatch, stale, lambda peer: served(after))
    sync.membership.fresh_view = lambda since, timeout: fresh
    sync.catch_up()
    assert engine.round == 10 and engine.params_hash() == after.params_hash() and len(sync.asked) == 1
    # a state the later view does not report either is refused, as before
    sync2, engine2 = syncing_peer(monkeypatch, stale, lambda peer: served(honest_engine(10, seed=3)))
    sync2.membership.fresh_view = lambda since, timeout: fresh
    sync2.catch_up()
    assert engine2.round == 0 and sorted(sync2.asked) == ["a", "b", "c"]


def test_a_state_a_few_rounds_past_its_servers_record_is_installed(monkeypatch, clock):
    """A fast run (a netns test at 1.5 s a round) ends rounds faster than a record is stored: a state up to
    ``Timing.record_lag_rounds`` past its server's record read after the download is installed (before:
    every server refused and hidden for 10 minutes, the peer alone); one further past is refused."""
    lag = Timing.record_lag_rounds
    records = [view(p, 10, "training") for p in ("a", "b", "c")]
    sync, engine = syncing_peer(monkeypatch, records, lambda peer: served(honest_engine(11 + lag, seed=1)))
    sync.catch_up()
    assert engine.round == 11 + lag and len(sync.asked) == 1
    sync2, engine2 = syncing_peer(monkeypatch, records, lambda peer: served(honest_engine(12 + lag, seed=1)))
    sync2.catch_up()
    assert engine2.round == 0 and sorted(sync2.asked) == ["a", "b", "c"]


def test_downloads_are_bounded_and_an_unservable_round_is_not_chased_again(monkeypatch, clock):
    views = [view(p, 10, "training") for p in ("a", "b", "c", "d", "e")]
    sync, engine = syncing_peer(monkeypatch, views, lambda peer: None)  # nobody answers
    sync.catch_up()
    assert len(sync.asked) == MAX_ATTEMPTS and engine.round == 0
    sync.catch_up()
    assert len(sync.asked) == MAX_ATTEMPTS  # the same round, too soon: not tried again
    clock.sleep(Timing.retry_target_s + Timing.silent_source_s)
    sync.catch_up()
    assert len(sync.asked) == 2 * MAX_ATTEMPTS


def test_install_checks_every_tensor_after_the_cast(monkeypatch, clock):
    sync, engine = syncing_peer(monkeypatch, [], lambda peer: None)
    honest = honest_engine(4)
    meta, tensors = served(honest)
    with pytest.raises(ProtocolError, match="non-finite|beyond"):
        sync.install(meta, [tensors[0].double().fill_(1e300)] + tensors[1:])
    with pytest.raises(ProtocolError, match="not a real tensor"):
        sync.install(meta, [tensors[0].to(torch.complex64)] + tensors[1:])
    with pytest.raises(ProtocolError, match="none of those its peers report"):
        sync.install(meta, tensors, reported={4: {"0123456789abcdef"}})
    with pytest.raises(ProtocolError, match="standing"):
        sync.install(dict(meta, standing={"sybil": 10**9}), tensors)
    assert engine.round == 0
    honest.standing = {"a": 4, "b": 2}
    meta, tensors = served(honest)
    sync.install(meta, tensors, reported={4: {params_hash(honest.theta)}, 5: {"x"}})
    assert engine.round == 4 and engine.params_hash() == honest.params_hash()
    assert engine.standing == {"a": 4, "b": 2}  # the lineage's standing comes with its state


def test_a_served_state_whose_table_or_momentum_no_peer_reports_is_refused(monkeypatch, clock):
    # an honest θ with a standing table that makes the server established, or with a forged outer
    # momentum (DiLoCo): θ's hash alone passes both; the digest peers report with it does not
    sync, engine = syncing_peer(monkeypatch, [], lambda peer: None)
    honest = honest_engine(4)
    honest.standing = {"a": 4, "b": 2}
    theta_hash, digest = honest.hashes()
    reported = {4: {f"{theta_hash}:{digest}", "0123456789abcdef:00"}}
    meta, tensors = served(honest)
    with pytest.raises(ProtocolError, match="standing table and shared state"):
        sync.install(dict(meta, standing={"a": 4, "b": 2, "server": 9}), tensors, reported=reported)
    momentum = len(meta["names"])  # the first shared tensor
    with pytest.raises(ProtocolError, match="standing table and shared state"):
        sync.install(*served(honest, **{f"t{momentum}": tensors[momentum] * 3}), reported=reported)
    # a record of θ alone (no digest) does not vouch for another table where a peer reports one
    with pytest.raises(ProtocolError, match="standing table and shared state"):
        sync.install(dict(meta, standing={"server": 9}), tensors, reported={4: reported[4] | {theta_hash}})
    assert engine.round == 0
    sync.install(meta, tensors, reported=reported)
    assert engine.hashes() == (theta_hash, digest) and engine.standing == {"a": 4, "b": 2}


@pytest.mark.parametrize("own_round,served_round,forgets", [(4, 4, False), (4, 5, False), (4, 7, False), (4, 8, True),
                                                             (4, 30, True), (9, 5, True)])
def test_a_state_more_than_a_few_rounds_ahead_or_behind_clears_the_local_buffers(monkeypatch, clock, own_round,
                                                                                     served_round, forgets):
    sync, engine = syncing_peer(monkeypatch, [], lambda peer: None, own_round=own_round)
    calls = []
    monkeypatch.setattr(engine.strategy, "forget_local_state", lambda: calls.append(engine.round))
    sync.install(*served(honest_engine(served_round)))
    assert engine.round == served_round and calls == ([own_round] if forgets else [])


def test_forgetting_zeroes_the_error_feedback_and_the_checkpointed_copy_follows():
    spec = SPEC.replace(outer={"strategy": "sparseloco"})
    strategy = make_strategy(spec)
    for t in strategy.buffer.values():
        t.fill_(0.5)
    strategy.forget_local_state()
    assert all(float(t.abs().sum()) == 0.0 for t in strategy.local_state().values())


def test_a_peer_read_again_out_of_rounds_is_not_a_missed_read(monkeypatch, clock):
    # a chain stage that cannot link flips between "syncing" (catching up) and "linking" (not in
    # rounds): a full replica's barrier read it as a peer lost from sight and waited 11 s for it
    m = Membership(dht=None, spec=SPEC, peer_id="me", progress=lambda: None, stop=threading.Event())
    states = iter(["syncing", "linking"])
    monkeypatch.setattr(membership_mod, "read_progress", lambda dht, run_id: [view("stage", 0, next(states, "linking"))])
    assert [v.peer_id for v in m.others()] == ["stage"]
    clock.sleep(5.0)
    assert not m.others() and not m.lost_sight() and m.swarm_is_empty()
    t0 = clock.now
    assert m.wait_for_round(0, set(), first_round=False).alone and clock.now - t0 < 0.5


def test_a_peer_one_round_behind_for_ever_is_struck(monkeypatch, clock):
    # a staller that always shows itself still exchanging the round before ours: waited for once, then
    # struck, as it never names a set for that round; an honest peer as slow that names its set is
    # judged later (carried), not struck
    m, _ = barrier_peer(monkeypatch, clock, lambda t: [])
    for round_no in (6, 7):
        named = dataclasses.replace(progress(round_no - 1, "exchanging"), gathered_round=round_no - 2, gathered="1" * 32)
        honest = SimpleNamespace(peer_id="slow", progress=named, expires=0.0)
        now = [view("me", round_no), view("liar", round_no - 1, "exchanging"), honest]
        monkeypatch.setattr(m, "view", lambda: now)
        m.wait_for_round(round_no, set(), first_round=False)
    assert "liar" in m.no_shows and "slow" not in m.no_shows and m._carried == {"slow": 6}
