"""True wire bytes (swarm/wire/ledger.py, swarm/wire/meter.py, swarm/wire/sock_diag.py's dumps and
lookups): the ledger's bookkeeping across polls and closed sockets, the meter on real sockets of a
child process, and how it degrades where netlink cannot be used. The netlink parser on constructed
replies is tests/swarm/test_sock_diag.py."""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace

import pytest

from peer.host.lifecycle import wire_status
from peer.host.metrics import MetricsServer
from swarm.wire import sock_diag
from swarm.wire.sock_diag import (INET_DIAG_INFO, SOCK_DIAG_BY_FAMILY, TCP_LISTEN, DestroyFeed, SockStat, TcpCounters,
                                  dump_tcp, lookup_request, lookup_tcp)
from swarm.wire.meter import CPU_BUDGET, WireMeter, budget, wire_report
from swarm.wire.ledger import KEEP_GONE_POLLS, WireLedger, WireTotals
from tests.coordinator.test_dashboard_records import progress

ESTABLISHED = 1
FIN = 1  # tcpi_bytes_acked counts the FIN of a connection closed gracefully


def stat(cookie, inode=0, state=ESTABLISHED, sport=4000, dport=5000, src="10.0.0.1", dst="10.0.0.2", sent=0, received=0,
         counters=True) -> SockStat:
    c = TcpCounters(sent, received, 0, 1, 1) if counters else None
    return SockStat(cookie, inode, socket.AF_INET, state, src, sport, dst, dport, c)


def test_the_meter_skips_what_its_ledger_has_classified_and_counts_the_same():
    """Another process's socket is parsed once, then dumped unparsed: the totals do not change."""
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        port, inode = listener.getsockname()[1], os.fstat(listener.fileno()).st_ino
        skips = []

        def dump(skip=()):
            skips.append(set(skip))
            socks = [stat(1, inode, state=TCP_LISTEN, sport=port), stat(2, sport=port, sent=10 * len(skips)),
                     stat(3, inode=999_999_999, sport=6000, sent=5)]  # not ours: another process's socket
            return [s if s.cookie not in skip else SockStat(s.cookie, s.inode, s.family, s.state, "", s.sport, "",
                                                            s.dport, None) for s in socks]

        meter = WireMeter(dump=dump, feed=None, lookup=None, period=60.0)
        assert meter.totals().sent == 10
        assert meter.totals().sent == 20
        assert skips[0] == set() and skips[1] == {1, 3}  # the listener and the foreign socket, not ours (2)
        assert meter._ledger.live() and [s.cookie for s in meter._ledger.live()] == [2]
    finally:
        listener.close()


# ---- the ledger -----------------------------------------------------------------------------------
def never():
    raise AssertionError("the /proc walk should not be needed")


def test_the_trees_listening_port_claims_its_connections_without_a_proc_walk():
    ledger = WireLedger()
    ledger.update([stat(1, inode=10, state=TCP_LISTEN, sport=4000, dport=0, counters=False)], {10})
    assert ledger.ports == {4000}
    ledger.update([stat(2, inode=11, sport=4000, sent=100, received=50)], never)  # libp2p dials from its port
    ledger.update([stat(2, inode=0, sport=4000, sent=300, received=80)], never)  # orphaned: still followed
    assert ledger.totals() == WireTotals(300, 80, 0, 1, 1, 1)


def test_sockets_by_inode_and_foreign_ones_are_decided_once():
    walks = []

    def owned():
        walks.append(1)
        return {21}

    ledger = WireLedger()
    dump = [stat(1, inode=20, sport=6000, sent=999), stat(2, inode=21, sport=7000, sent=40, received=4),
            stat(3, inode=0, sport=8000, sent=5)]  # not yet accept()ed: no inode, decided later
    ledger.update(dump, owned)
    ledger.update(dump, owned)
    assert len(walks) == 1 and ledger.totals().sent == 40
    ledger.update(dump[:2] + [stat(3, inode=22, sport=8000, sent=6)], lambda: {21, 22})
    assert ledger.totals().sent == 46


def test_closed_sockets_keep_their_bytes():
    ledger = WireLedger()
    ledger.update([stat(1, inode=5, sent=100, received=10), stat(2, inode=6, sent=1, received=2)], {5, 6})
    ledger.update([stat(1, inode=5, sent=150, received=10), stat(2, inode=0, sent=0, received=0)], set())  # 2 reset
    ledger.update([], set())  # both gone
    assert ledger.totals() == WireTotals(151, 12, 0, 2, 2, 2)
    for _ in range(KEEP_GONE_POLLS + 2):
        ledger.update([stat(9, inode=99, sent=7)], set())
    assert ledger.totals() == WireTotals(151, 12, 0, 2, 2, 2) and ledger.closed == ledger.totals()


def test_destroy_notices_give_final_counts_and_short_lived_connections():
    ledger = WireLedger()
    ledger.update([stat(1, inode=10, state=TCP_LISTEN, sport=4000, dport=0, counters=False),
                   stat(2, inode=11, sport=4000, sent=100)], {10, 11})
    ledger.destroyed([stat(2, sport=4000, sent=180, received=3)])  # its final counters
    ledger.destroyed([stat(3, sport=4000, sent=50)])  # born and gone between two polls, from the tree's port
    ledger.destroyed([stat(4, sport=4001, sent=7000)])  # someone else's
    ledger.destroyed([stat(5, sport=4000, sent=0, received=0)])  # an abortive close before any poll: nothing to add
    ledger.update([], set())
    assert ledger.totals() == WireTotals(230, 3, 0, 3, 3, 3)
    ledger.destroyed([stat(2, sport=4000, sent=0)])  # a late, zeroed notice never lowers a count
    assert ledger.totals().sent == 230


def test_a_connection_between_two_processes_of_the_tree_never_counts():
    ledger = WireLedger()
    a = stat(1, inode=1, src="127.0.0.1", sport=4000, dst="127.0.0.1", dport=4001, sent=10)
    b = stat(2, inode=2, src="127.0.0.1", sport=4001, dst="127.0.0.1", dport=4000, received=10)
    ledger.update([a, b], {1, 2})
    assert ledger.totals() == WireTotals()


def test_the_report_splits_the_wire_into_payload_chain_and_control():
    totals = WireTotals(1000, 800, 5, 20, 19, 3)
    report = wire_report(totals, payload=(300, 200), chain=(100, 0))
    assert report["sent"] == 1000 and report["sockets"] == 3
    assert report["sent_by"] == {"payload": 300, "chain": 100, "control": 600}
    assert report["received_by"] == {"payload": 200, "chain": 0, "control": 600}
    assert wire_report(totals, payload=(5000, 0))["sent_by"]["control"] == 0  # never negative
    assert wire_report(None, (0, 0)) is None


# ---- where the counters cannot be read -------------------------------------------------------------
def test_without_netlink_the_meter_says_unknown_once_and_never_raises(caplog):
    def no_netlink(**_):
        raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")

    meter = WireMeter(dump=no_netlink)
    with caplog.at_level(logging.INFO, logger="voloco.swarm"):
        meter.start()
        assert meter.totals() is None and meter.totals() is None
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "wire bytes: unknown" in caplog.records[0].message and meter._thread is None
    meter.shutdown()

    class Peer:  # what the status and the metrics read
        wire, role = meter, None
        totals = type("T", (), {"bytes_sent": 1, "bytes_received": 2})()

    assert wire_status(Peer()) is None and wire_status(object()) is None


def test_without_a_socket_family_for_netlink_the_dump_raises_oserror(monkeypatch):
    monkeypatch.delattr(sock_diag.socket, "AF_NETLINK", raising=False)
    with pytest.raises(OSError):
        dump_tcp()
    with pytest.raises(OSError):
        DestroyFeed()


def test_the_metrics_carry_the_wire_bytes_when_known():
    wire = {"w": wire_report(WireTotals(1000, 800, 5, 20, 19, 3), (300, 200))}
    srv = MetricsServer(lambda: progress(), lambda: "12D3KooWpeer", 0, host="127.0.0.1", wire=lambda: wire["w"])
    try:
        read = lambda: urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=10).read().decode()  # noqa: E731
        text = read()
        assert 'voloco_peer_wire_bytes_sent_total{peer="12D3KooWpeer"} 1000.0' in text
        assert 'voloco_peer_wire_packets_received_total{peer="12D3KooWpeer"} 19.0' in text
        assert 'voloco_peer_wire_sent_by_kind_bytes{kind="control",peer="12D3KooWpeer"} 700.0' in text
        wire["w"] = None
        assert "voloco_peer_wire" not in read() and "voloco_peer_round" in read()
    finally:
        srv.shutdown()


# ---- real sockets --------------------------------------------------------------------------------
def _netlink_or_skip() -> None:
    try:
        dump_tcp()
    except OSError as e:
        pytest.skip(f"no sock_diag here: {e}")


# a child that connects to argv[1]'s port, sends argv[2] bytes, reads argv[3] bytes, says so, and
# closes and exits when told
CLIENT = r"""
import socket, sys
c = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
c.sendall(b"x" * int(sys.argv[2]))
want, got = int(sys.argv[3]), 0
while got < want:
    got += len(c.recv(65536))
print("read", flush=True)
sys.stdin.readline()
c.close()
"""

# a child that listens, prints its port, sends argv[1] bytes to whoever connects, closes, and exits
SERVER = r"""
import socket, sys
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)
sys.stdin.readline()
conn, _ = srv.accept()
conn.sendall(b"y" * int(sys.argv[1]))
conn.close()
"""


def test_the_meter_counts_a_child_processs_connection_to_the_byte_after_it_is_gone():
    _netlink_or_skip()
    srv = socket.create_server(("127.0.0.1", 0))
    child = subprocess.Popen([sys.executable, "-c", CLIENT, str(srv.getsockname()[1]), "123456", "54321"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    conn = None
    try:
        meter = WireMeter(root=child.pid, feed=None)  # only the child's tree: this process's end is not its
        conn, _ = srv.accept()
        got = 0
        while got < 123456:
            got += len(conn.recv(65536))
        conn.sendall(b"z" * 54321)
        assert child.stdout.readline().strip() == "read"
        meter.poll()  # sees the child's socket while it lives
        child.stdin.write("bye\n")
        child.stdin.flush()
        child.wait(30)
        time.sleep(0.2)
        totals = meter.totals()  # the socket and the process are gone: the bytes stay
        # sent: acknowledged bytes, and a closed connection's FIN takes one sequence number
        assert (totals.sent - FIN, totals.received, totals.sockets) == (123456, 54321, 1)
    finally:
        child.kill()
        for s in (conn, srv):
            if s is not None:
                s.close()


def test_a_connection_inside_the_tree_is_not_on_the_wire():
    _netlink_or_skip()
    srv = socket.create_server(("127.0.0.1", 0))
    c = socket.create_connection(srv.getsockname())
    a, _ = srv.accept()
    try:
        meter = WireMeter(feed=None)  # this process holds both ends
        before = meter.totals()  # what sockets an earlier test left open here (closing) count meanwhile
        c.sendall(b"q" * 5000)
        a.recv(10000)
        after = meter.totals()
        assert after.sent - before.sent < 5000 and after.received - before.received < 5000
    finally:
        for s in (a, c, srv):
            s.close()


def test_with_destroy_notices_a_connection_shorter_than_a_poll_counts():
    _netlink_or_skip()
    try:
        DestroyFeed().close()
    except OSError as e:
        pytest.skip(f"no destroy notices without CAP_NET_ADMIN: {e}")
    child = subprocess.Popen([sys.executable, "-c", SERVER, "77777"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        port = int(child.stdout.readline())
        # the polls see only listeners (the child's port): the connection can count by its notice alone
        listeners = lambda **kw: [s for s in dump_tcp(**kw) if s.state == TCP_LISTEN]  # noqa: E731
        meter = WireMeter(root=child.pid, dump=listeners).start()
        child.stdin.write("go\n")
        child.stdin.flush()
        with socket.create_connection(("127.0.0.1", port)) as c:
            got = 0
            while chunk := c.recv(65536):
                got += len(chunk)
        child.wait(30)
        deadline = time.monotonic() + 10
        while (meter.totals() or WireTotals()).sent < 77777 + FIN and time.monotonic() < deadline:
            time.sleep(0.05)
        totals = meter.totals()
        assert got == 77777 and (totals.sent - FIN, totals.sockets) == (77777, 1)
        assert totals.received in (0, 1)  # the client's FIN takes a sequence number: 1 if it came before the end
        meter.shutdown()
    finally:
        child.kill()


def _one_followed_socket(listener):
    """A dump of ``listener`` (the tree's port) and one socket on it that sent 10 bytes, and a lookup of
    that socket whose count grows by 10 a call: (dump, lookup, the dumps' times, the lookups' cookies)."""
    port, inode = listener.getsockname()[1], os.fstat(listener.fileno()).st_ino
    dumps, lookups = [], []

    def dump(**_):
        dumps.append(time.monotonic())
        return [stat(1, inode, state=TCP_LISTEN, sport=port), stat(2, sport=port, sent=10)]

    def lookup(live):
        lookups.append([s.cookie for s in live])
        return [stat(2, sport=port, sent=10 * (len(lookups) + 1))]

    return dump, lookup, dumps, lookups


def test_a_totals_that_need_not_be_fresh_takes_no_dump():
    """A round record and a status ask for totals twice a round: while the meter's thread runs, those
    re-read the followed sockets by lookup and take no dump (a dump walks the whole machine's socket
    table: 60 ms with 32 peers on one host); a fresh one, or one with no thread running, dumps."""
    listener = socket.create_server(("127.0.0.1", 0))  # gives the tree (this process) its port
    try:
        dump, lookup, dumps, lookups = _one_followed_socket(listener)

        idle = WireMeter(dump=dump, feed=None, lookup=lookup, period=60.0)  # no thread: every call dumps
        assert idle.totals(fresh=False).sent == 10 and len(dumps) == 1
        dumps.clear()
        meter = WireMeter(dump=dump, feed=None, lookup=lookup, period=60.0).start()
        started, before = len(dumps), len(lookups)
        assert meter.totals(fresh=False).sent == 10 * (len(lookups) + 1) and len(dumps) == started
        assert len(lookups) == before + 1  # the followed socket, re-read now
        meter.totals()
        assert len(dumps) == started + 1
        meter.shutdown()
        meter.totals(fresh=False)  # the thread has stopped: read whole
        assert len(dumps) == started + 2
    finally:
        listener.close()


def test_around_a_shutdown_the_meter_reads_closely_by_lookup_with_a_dump_now_and_then():
    listener = socket.create_server(("127.0.0.1", 0))  # gives the tree (this process) its port
    try:
        dump, lookup, dumps, lookups = _one_followed_socket(listener)

        meter = WireMeter(dump=dump, feed=None, lookup=lookup, period=60.0).start()
        before = len(dumps)
        with meter.closely(period=0.01):
            time.sleep(0.3)
        meter.shutdown()
        assert len(lookups) >= 10 and all(c == [2] for c in lookups)  # every 10 ms, not once a minute
        assert len(dumps) - before >= 2  # new sockets still found now and then
        assert meter.totals().sent == 10 * (len(lookups) + 1)  # the last lookup's reading counts
    finally:
        listener.close()


def test_between_dumps_the_meter_re_reads_its_sockets_by_lookup():
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        port, inode = listener.getsockname()[1], os.fstat(listener.fileno()).st_ino
        reads = []
        dump = lambda **_: [stat(1, inode, state=TCP_LISTEN, sport=port), stat(2, sport=port, sent=5)]  # noqa: E731
        meter = WireMeter(dump=dump, feed=None, lookup=lambda live: reads.append(1) or [stat(2, sport=port, sent=99)])
        meter.start()
        time.sleep(0.5)
        meter.shutdown()
        assert len(reads) >= 3  # several lookups between the dumps (every REFRESH_MIN_S at this cost)
        assert meter._ledger.totals().sent == 99  # a dump's older reading never lowers a counter
    finally:
        listener.close()


def test_a_failing_lookup_leaves_the_meter_on_dumps():
    def broken(live):
        raise OSError("no lookups here")

    listener = socket.create_server(("127.0.0.1", 0))
    try:
        port, inode = listener.getsockname()[1], os.fstat(listener.fileno()).st_ino
        meter = WireMeter(dump=lambda **_: [stat(1, inode, state=TCP_LISTEN, sport=port), stat(2, sport=port, sent=7)],
                          feed=None, lookup=broken, period=60.0)
        meter.poll()
        meter.refresh()
        meter.refresh()  # said once, then never tried again
        assert meter._lookup is None and meter.unavailable is None and meter.totals().sent == 7
    finally:
        listener.close()


def test_the_lookup_request_names_one_socket_by_its_addresses_and_cookie():
    six = SockStat((7 << 32) | 9, 0, socket.AF_INET6, ESTABLISHED, "::1", 4000, "fe80::2", 5000, None)
    raw = lookup_request(six, seq=3)
    length, kind, flags, seq, _ = struct.unpack_from("=IHHII", raw)
    assert (length, kind, flags, seq) == (len(raw), SOCK_DIAG_BY_FAMILY, 1, 3)  # a request, not a dump
    family, proto, ext, _, states = struct.unpack_from("=BBBBI", raw, 16)
    assert (family, proto, ext, states) == (socket.AF_INET6, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), 0xFFFFFFFF)
    sport, dport = struct.unpack_from(">HH", raw, 24)
    assert (sport, dport) == (4000, 5000)
    assert raw[28:44] == socket.inet_pton(socket.AF_INET6, "::1")
    assert raw[44:60] == socket.inet_pton(socket.AF_INET6, "fe80::2")
    assert struct.unpack_from("=III", raw, 60) == (0, 9, 7)
    four = lookup_request(stat(1, src="10.0.0.1"), seq=1)
    assert four[28:44] == socket.inet_pton(socket.AF_INET, "10.0.0.1") + bytes(12) and len(four) == len(raw)


def test_lookups_read_live_sockets_counters_and_leave_out_gone_ones():
    _netlink_or_skip()
    srv = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(srv.getsockname())
    b, _ = srv.accept()
    try:
        mine = [s for s in dump_tcp() if s.state == ESTABLISHED and srv.getsockname()[1] in (s.sport, s.dport)]
        assert len(mine) == 2
        a.sendall(b"q" * 5000)
        got = 0
        while got < 5000:
            got += len(b.recv(65536))
        fresh = {s.cookie: s for s in lookup_tcp(mine)}
        assert {fresh[s.cookie].counters.received for s in mine} == {0, 5000}
        gone = replace(mine[0], cookie=mine[0].cookie + 1)  # another socket's cookie: not this one
        assert lookup_tcp([gone]) == [] and lookup_tcp([]) == []
    finally:
        for s in (a, b, srv):
            s.close()


def test_the_meters_budget_shrinks_on_an_oversubscribed_machine():
    """A peer on a machine of its own may spend CPU_BUDGET of a core on its meter; 32 peers on 2
    cores (load 32) together spend about what one would, and a poll's cost spreads the polls out by
    as much (``meter.budget``)."""
    assert budget(load=lambda: 1.5, cores=2) == CPU_BUDGET
    assert budget(load=lambda: 32.0, cores=2) == pytest.approx(CPU_BUDGET / 16)

    def no_load_average():
        raise OSError("no /proc/loadavg")

    assert budget(load=no_load_average, cores=2) == CPU_BUDGET
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        port, inode = listener.getsockname()[1], os.fstat(listener.fileno()).st_ino

        def dump(**_):
            spent = time.thread_time() + 0.002  # a dump of a large table: 2 ms of CPU
            while time.thread_time() < spent:
                pass
            return [stat(1, inode, state=TCP_LISTEN, sport=port), stat(2, sport=port, sent=5)]

        alone = WireMeter(dump=dump, feed=None, lookup=None, share=lambda: CPU_BUDGET)
        crowded = WireMeter(dump=dump, feed=None, lookup=None, share=lambda: CPU_BUDGET / 16)
        alone.poll(), crowded.poll()
        assert alone.period < 0.5 and crowded.period > 2.5  # 2 ms at 1 % of a core, and at 1/16 of that
    finally:
        listener.close()
