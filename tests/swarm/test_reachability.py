"""The reachability dial-back (swarm/access/reachability.py): real DHT nodes on loopback for the check,
a stand-in daemon for the helper's bounds on what a hostile asker can make it do."""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
from types import SimpleNamespace

import pytest
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from multiaddr import Multiaddr

from swarm.access import reachability as reach
from swarm.dht.node import start_dht

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def nodes():
    first = start_dht((), LOOPBACK)
    second = start_dht(first.get_visible_maddrs(), LOOPBACK)
    yield first, second
    for d in (second, first):
        d.shutdown()


def test_a_node_on_loopback_is_dialed_back_at_its_address(nodes):
    first, second = nodes
    check = reach.check_reachability(second, [first.peer_id.to_base58()])
    assert check.reach == reach.PUBLIC, check.answers
    (answer,) = check.answers.values()
    assert answer["ok"] is True and answer["seen"] == "127.0.0.1" and "/ip4/127.0.0.1/tcp/" in answer["addr"]
    level, message = reach.advice(check, client_mode=False, port=None)
    assert level == logging.INFO and "public" in message


def test_an_address_nobody_listens_at_is_reported_unreachable_with_what_to_do(nodes):
    first, second = nodes
    port = free_port()
    check = reach.check_reachability(first, [second.peer_id.to_base58()], addrs=[f"/ip4/127.0.0.1/tcp/{port}"])
    assert check.reach == reach.CLIENT, check.answers
    assert "refused" in check.reason
    level, message = reach.advice(check, client_mode=False, port=None)
    assert level == logging.WARNING
    for hint in ("forward (or open) TCP port", "--announce-maddrs /ip4/127.0.0.1/tcp/", "--client-mode", "--host-maddrs"):
        assert hint in message, message
    _, quiet = reach.advice(check, client_mode=True, port=31337)
    assert "--client-mode" in quiet and "still trains" in quiet


def test_no_helper_or_a_silent_one_is_unknown_and_never_raises(nodes):
    first, _ = nodes
    assert reach.check_reachability(first, []).reach == reach.UNKNOWN
    stranger = "QmXjP5fwkdJ9UytA8Zs8SYzqfg3Wzo5yz88RoE6Nxc3U5W"  # no such node: no answer
    check = reach.check_reachability(first, [stranger], timeout=3)
    assert check.reach == reach.UNKNOWN and check.answers[stranger]["ok"] is None


def test_watch_sets_reach_in_the_background(nodes):
    first, _ = nodes
    third = start_dht(first.get_visible_maddrs(), LOOPBACK)  # a helper answers one check per asker every 10 s
    try:
        owner = SimpleNamespace()
        thread = reach.watch_reachability(owner, third, first.get_visible_maddrs(), False, LOOPBACK)
        assert owner.reach == reach.UNKNOWN  # at once, before any answer
        thread.join(30)
        assert owner.reach == reach.PUBLIC
        client = SimpleNamespace()
        reach.watch_reachability(client, third, [], True, LOOPBACK).join(30)
        assert client.reach == reach.CLIENT  # a --client-mode peer is one, whatever the check finds
    finally:
        third.shutdown()


def test_an_unanswered_check_is_asked_again(monkeypatch, caplog):
    """A check no helper answered (e.g. the node was busy installing a state) is asked again, and only
    the last verdict is logged: a client-mode peer behind a NAT is told what it expects."""
    verdicts = [reach.Check(reach.UNKNOWN, {"QmHelper": {"ok": None, "why": "check failed (TimeoutError)"}}),
                reach.Check(reach.CLIENT, {"QmHelper": {"ok": False, "why": "timed out"}})]
    asked = []
    monkeypatch.setattr(reach, "pick_helpers", lambda dht, first: ["QmHelper"])
    monkeypatch.setattr(reach, "check_reachability", lambda dht, helpers: asked.append(helpers) or verdicts.pop(0))
    owner = SimpleNamespace()
    with caplog.at_level(logging.INFO, logger=reach.logger.name):
        reach.watch_reachability(owner, None, [], True, LOOPBACK, attempts=3, pause=0.01).join(10)
    assert len(asked) == 2 and owner.reach == reach.CLIENT
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("reachability:")]
    assert len(said) == 1 and "as expected with --client-mode" in said[0], said
    monkeypatch.setattr(reach, "check_reachability", lambda dht, helpers: asked.append(helpers) or reach.Check(
        reach.UNKNOWN, {"QmHelper": {"ok": None, "why": "no answer in 20 s"}}))
    asked.clear()
    reach.watch_reachability(SimpleNamespace(), None, [], False, LOOPBACK, attempts=3, pause=0.01).join(10)
    assert len(asked) == 3  # and no more: the last "unknown" is logged
    replied = reach.Check(reach.UNKNOWN, {"QmHelper": {"ok": None, "seen": "", "why": "no direct TCP address to dial"}})
    monkeypatch.setattr(reach, "check_reachability", lambda dht, helpers: asked.append(helpers) or replied)
    asked.clear()
    reach.watch_reachability(SimpleNamespace(), None, [], False, LOOPBACK, attempts=3, pause=0.01).join(10)
    assert len(asked) == 1  # a helper replied: asking again would not change its answer


def test_a_private_run_checks_with_its_token():
    token = "t" * 24
    first = start_dht((), LOOPBACK, join_token=token)
    try:
        second = start_dht(first.get_visible_maddrs(), LOOPBACK, join_token=token)
        try:
            assert reach.check_reachability(second, [first.peer_id.to_base58()]).reach == reach.PUBLIC
        finally:
            second.shutdown()
    finally:
        first.shutdown()


# ---- the helper's bounds, against a stand-in daemon ---------------------------------------------
class FakeP2P:
    def __init__(self, asker: PeerID, seen: str):
        self.asker, self.seen = asker, seen

    async def list_peers(self):
        return [SimpleNamespace(peer_id=self.asker, addrs=[Multiaddr(f"/ip4/{self.seen}/tcp/40000")])]


def test_the_helper_dials_only_where_the_asker_connects_from_and_bounds_requests(monkeypatch):
    asker = PeerID.from_base58("QmXjP5fwkdJ9UytA8Zs8SYzqfg3Wzo5yz88RoE6Nxc3U5W")
    dialed = []

    async def fake_dial(peer, targets, timeout):
        dialed.append((peer, [str(t) for t in targets], timeout))
        return False, "", "dial tcp: connection refused"

    monkeypatch.setattr(reach, "dial", fake_dial)
    servicer = reach.DialBack(FakeP2P(asker, "10.1.2.3"))

    def ask(keys):
        return asyncio.run(servicer._answer(asker, keys))

    # a third party's address is never dialed: only the ports, on the asker's own IP
    answer = ask([b"/ip4/8.8.8.8/tcp/53", b"/ip4/10.1.2.3/tcp/31337/p2p/QmXjP5fwkdJ9UytA8Zs8SYzqfg3Wzo5yz88RoE6Nxc3U5W"])
    assert dialed == [(asker, ["/ip4/10.1.2.3/tcp/53", "/ip4/10.1.2.3/tcp/31337"], reach.DIAL_TIMEOUT_S)]
    assert answer == {"ok": False, "addr": "", "seen": "10.1.2.3", "why": "connection refused"}
    with pytest.raises(reach.ReachError, match="too soon"):  # one request per asker every MIN_INTERVAL_S
        ask([b"/ip4/10.1.2.3/tcp/1"])
    servicer._last.clear()
    with pytest.raises(reach.ReachError, match="at most"):
        ask([b"/ip4/10.1.2.3/tcp/%d" % p for p in range(1, reach.MAX_ADDRS + 2)])
    with pytest.raises(reach.ReachError, match="at most"):
        ask([b"/ip4/10.1.2.3/tcp/1" + b"/" * reach.MAX_ADDR_BYTES])
    servicer._last.clear()
    assert ask([b"garbage", b"/dns4/example.com/tcp/80", b"/ip4/10.1.2.3/udp/9"])["ok"] is None  # nothing to dial
    assert len(dialed) == 1


def test_the_handler_answers_garbage_with_a_bounded_message(monkeypatch):
    from hivemind.proto import dht_pb2

    asker = PeerID.from_base58("QmXjP5fwkdJ9UytA8Zs8SYzqfg3Wzo5yz88RoE6Nxc3U5W")
    servicer = reach.DialBack(FakeP2P(asker, "10.1.2.3"))
    request = dht_pb2.FindRequest(keys=[b"x" * 10_000] * 50)
    response = asyncio.run(servicer.rpc_dial_back(request, SimpleNamespace(remote_id=asker)))
    assert len(response.results) == 1 and len(response.results[0].value) < reach.MAX_ANSWER_BYTES


def test_listen_port_and_endpoints():
    assert reach.listen_port(["/ip4/0.0.0.0/tcp/0"]) is None
    assert reach.listen_port(["/ip4/0.0.0.0/tcp/31337"]) == 31337
    assert reach.tcp_endpoints(["/ip4/1.2.3.4/tcp/5/p2p/QmXjP5fwkdJ9UytA8Zs8SYzqfg3Wzo5yz88RoE6Nxc3U5W", "junk",
                                "/ip6/::1/tcp/7", "/ip4/1.2.3.4/udp/5/quic"]) == [("ip4", "1.2.3.4", 5), ("ip6", "::1", 7)]


def test_state_sources_that_others_cannot_dial_come_last():
    from peer.round.state_sync import order_sources

    view = lambda name, reach_: SimpleNamespace(peer_id=name, progress=SimpleNamespace(round=5, reach=reach_))  # noqa: E731
    views = [view("hidden", "client"), view("open", "public"), view("new", "unknown")]
    for _ in range(5):
        assert [v.peer_id for v in order_sources(views, 5)][-1] == "hidden"


def test_an_asker_that_cancels_neither_kills_the_probe_nor_frees_its_permit(monkeypatch):
    # hivemind cancels the handler when the asker cancels its call: a probe daemon being started then
    # must still be shut down by its own task, and keep its permit (MAX_PROBES) until it is
    asker = PeerID.from_base58("QmXjP5fwkdJ9UytA8Zs8SYzqfg3Wzo5yz88RoE6Nxc3U5W")
    events = []

    async def slow_dial(peer, targets, timeout):
        events.append("start")
        try:
            await asyncio.sleep(0.3)
        except asyncio.CancelledError:
            events.append("cancelled")
            raise
        events.append("done")
        return True, str(targets[0]), ""

    monkeypatch.setattr(reach, "dial", slow_dial)
    servicer = reach.DialBack(FakeP2P(asker, "10.1.2.3"))

    async def scenario():
        handler = asyncio.ensure_future(servicer._answer(asker, [b"/ip4/10.1.2.3/tcp/31337"]))
        await asyncio.sleep(0.1)
        handler.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handler
        held = servicer._probes._value  # the probe is still running: its permit is still taken
        await asyncio.sleep(0.4)
        return held, servicer._probes._value

    held, after = asyncio.run(scenario())
    assert events == ["start", "done"]
    assert held == reach.MAX_PROBES - 1 and after == reach.MAX_PROBES


def test_a_probe_that_cannot_start_gives_no_verdict(monkeypatch):
    asker = PeerID.from_base58("QmXjP5fwkdJ9UytA8Zs8SYzqfg3Wzo5yz88RoE6Nxc3U5W")

    async def broken_dial(peer, targets, timeout):
        raise RuntimeError("p2pd did not start")

    monkeypatch.setattr(reach, "dial", broken_dial)
    servicer = reach.DialBack(FakeP2P(asker, "10.1.2.3"))
    answer = asyncio.run(servicer._answer(asker, [b"/ip4/10.1.2.3/tcp/31337"]))
    assert answer["ok"] is None and servicer._probes._value == reach.MAX_PROBES


class P2P:
    """hivemind's P2P.create as it fails on a loaded host: the daemon's first line comes after the
    start-up timeout, and its output reader then sets the result of a future already cancelled."""

    @classmethod
    async def create(cls, **kwargs):
        self = cls()
        ready = asyncio.get_running_loop().create_future()
        self._reader_task = asyncio.create_task(self._read_outputs(ready))
        try:
            await asyncio.wait_for(ready, 0.05)
        except asyncio.TimeoutError:
            raise P2PDaemonError("Daemon failed to start in 0.1 seconds") from None

    async def _read_outputs(self, ready):
        await asyncio.sleep(0.2)  # "Peer ID: ..." at last
        ready.set_result(None)


class SlowStopP2P(P2P):
    """... and the daemon's late first line comes while hivemind still stops it (``shutdown`` awaits the
    process): the reader has ended, with its error, before the start's failure is raised."""

    @classmethod
    async def create(cls, **kwargs):
        try:
            await super().create.__func__(cls, **kwargs)
        except P2PDaemonError:
            await asyncio.sleep(0.3)  # hivemind's ``await self.shutdown()``
            raise


def test_a_probe_daemon_that_starts_too_late_leaves_no_traceback(monkeypatch, caplog):
    """The reader of a probe daemon that missed its start-up timeout raises InvalidStateError when the
    daemon's first line comes; nobody awaits it, so asyncio printed "Task exception was never
    retrieved" with a traceback in a loaded peer's log. The probe's failure is still the caller's."""
    monkeypatch.setattr(reach, "P2P", P2P)

    async def go():
        with pytest.raises(P2PDaemonError):
            await reach.start_probe_daemon()
        await asyncio.sleep(0.4)

    with caplog.at_level(logging.DEBUG):
        asyncio.run(go())
        gc.collect()
    assert "never retrieved" not in caplog.text and "InvalidStateError" in caplog.text  # at debug, once


def test_a_late_line_that_comes_while_the_daemon_stops_leaves_no_traceback(monkeypatch, caplog):
    """Seen in a peer's log under 32 peers joining at once: the reader had already ended when the
    failure was raised, so a look at the readers still running then did not find it."""
    monkeypatch.setattr(reach, "P2P", SlowStopP2P)

    async def go():
        with pytest.raises(P2PDaemonError):
            await reach.start_probe_daemon()

    with caplog.at_level(logging.DEBUG):
        asyncio.run(go())
        gc.collect()
    assert "never retrieved" not in caplog.text and caplog.text.count("InvalidStateError") == 1


def test_every_throw_away_daemon_that_starts_too_late_leaves_no_traceback(monkeypatch, caplog):
    """The identity check at a node's start (``peer_answers``) and the question to join nodes
    (swarm/access/join_probe.py ``ask_run_access``) start their daemons as a dial-back does: a late one's
    reader raised "never retrieved" in a coordinator's log under 32 peers joining at once."""
    from swarm.access import join_probe

    monkeypatch.setattr(reach, "P2P", P2P)

    async def go():
        with pytest.raises(P2PDaemonError):
            await reach.peer_answers(None, [])
        with pytest.raises(P2PDaemonError):
            await join_probe.ask_run_access([], None, timeout=5.0)
        await asyncio.sleep(0.4)

    with caplog.at_level(logging.DEBUG):
        asyncio.run(go())
        gc.collect()
    assert "never retrieved" not in caplog.text and caplog.text.count("InvalidStateError") == 2
