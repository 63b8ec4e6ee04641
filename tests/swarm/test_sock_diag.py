"""The netlink sock_diag parser (swarm/wire/sock_diag.py) on constructed replies: requests, replies,
attributes, skipped sockets, older kernels' tcp_info, errors and garbage. The ledger and the meter
on real sockets are tests/swarm/test_wire_bytes.py."""

from __future__ import annotations

import errno
import socket
import struct

import pytest

from swarm.wire.sock_diag import (INET_DIAG_INFO, NLMSG_DONE, NLMSG_ERROR, SOCK_DIAG_BY_FAMILY, TCP_LISTEN, NetlinkError,
                                  TcpCounters, dump_request, parse_diag_msg, parse_replies, parse_tcp_info)

ESTABLISHED = 1


# ---- constructed netlink replies -------------------------------------------------------------------
def tcp_info(sent=0, received=0, acked=None, retrans=0, segs_out=0, segs_in=0, size=232) -> bytes:
    info = bytearray(max(size, 232))
    struct.pack_into("=QQII", info, 120, sent if acked is None else acked, received, segs_out, segs_in)
    struct.pack_into("=QQ", info, 200, sent, retrans)
    return bytes(info[:size])


def diag_msg(cookie, inode, state=ESTABLISHED, src="10.0.0.1", sport=4000, dst="10.0.0.2", dport=5000,
             info=None, family=socket.AF_INET, extra=b"") -> bytes:
    n = 4 if family == socket.AF_INET else 16
    addr = lambda a: socket.inet_pton(family, a).ljust(16, b"\0")  # noqa: E731
    body = struct.pack("=BBBB", family, state, 0, 0) + struct.pack(">HH", sport, dport) + addr(src) + addr(dst)
    body += struct.pack("=III", 0, cookie & 0xFFFFFFFF, cookie >> 32) + struct.pack("=IIIII", 0, 0, 0, 0, inode)
    assert len(body) == 72 and n
    body += extra  # attributes before the wanted one must be skipped
    if info is not None:
        body += rta(INET_DIAG_INFO, info)
    return body


def rta(kind: int, data: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(data), kind) + data
    return raw + bytes(-len(raw) % 4)


def nlmsg(kind: int, body: bytes, seq: int = 1) -> bytes:
    raw = struct.pack("=IHHII", 16 + len(body), kind, 2, seq, 0) + body
    return raw + bytes(-len(raw) % 4)


def test_the_dump_request_asks_for_tcp_sockets_with_their_tcp_info():
    raw = dump_request(socket.AF_INET6, seq=7)
    length, kind, flags, seq, _ = struct.unpack_from("=IHHII", raw)
    assert (length, kind, flags, seq) == (len(raw), SOCK_DIAG_BY_FAMILY, 0x301, 7) and len(raw) == 16 + 56
    family, proto, ext, _, states = struct.unpack_from("=BBBBI", raw, 16)
    assert (family, proto, ext) == (socket.AF_INET6, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1))
    assert states & (1 << TCP_LISTEN) and not states & (1 << 6)  # listeners (their ports) yes; TIME_WAIT no


def test_replies_parse_into_sockets_with_their_counters():
    info = tcp_info(sent=1500, received=700, retrans=100, segs_out=9, segs_in=8)
    data = (nlmsg(SOCK_DIAG_BY_FAMILY, diag_msg(2**40 + 5, 77, info=info, extra=rta(8, b"\1")))
            + nlmsg(SOCK_DIAG_BY_FAMILY, diag_msg(6, 0, family=socket.AF_INET6, src="::1", dst="fe80::2", info=info))
            + nlmsg(SOCK_DIAG_BY_FAMILY, diag_msg(9, 0, state=6), seq=2)  # another dump's: skipped
            + nlmsg(NLMSG_DONE, struct.pack("=i", 0)))
    socks, done = parse_replies(data, seq=1)
    assert done and len(socks) == 2
    a, b = socks
    assert (a.cookie, a.inode, a.src, a.sport, a.dst, a.dport) == (2**40 + 5, 77, "10.0.0.1", 4000, "10.0.0.2", 5000)
    assert a.counters == TcpCounters(1500, 700, 100, 9, 8)
    assert (b.family, b.src, b.dst) == (socket.AF_INET6, "::1", "fe80::2")
    assert parse_replies(data[:len(data) - 20], seq=1) == (socks, False)  # the DONE in the next recv
    assert parse_diag_msg(diag_msg(1, 1)).counters is None  # no INET_DIAG_INFO: no counters


def test_a_skipped_socket_keeps_its_cookie_and_ports_only():
    info = tcp_info(sent=1500, received=700, retrans=100, segs_out=9, segs_in=8)
    data = (nlmsg(SOCK_DIAG_BY_FAMILY, diag_msg(2**40 + 5, 77, info=info))
            + nlmsg(SOCK_DIAG_BY_FAMILY, diag_msg(6, 78, info=info))
            + nlmsg(NLMSG_DONE, struct.pack("=i", 0)))
    (a, b), done = parse_replies(data, seq=1, skip={2**40 + 5})
    assert done
    assert (a.cookie, a.inode, a.family, a.state, a.sport, a.dport) == (2**40 + 5, 77, socket.AF_INET, ESTABLISHED, 4000, 5000)
    assert (a.src, a.dst, a.counters) == ("", "", None)  # not parsed
    assert b == parse_replies(data, seq=1)[0][1] and b.counters == TcpCounters(1500, 700, 100, 9, 8)


def test_older_kernels_tcp_info_is_read_as_far_as_it_goes():
    assert parse_tcp_info(tcp_info(sent=10, acked=8, received=5, size=136)) == TcpCounters(8, 5, 0, 0, 0)  # 4.1
    assert parse_tcp_info(tcp_info(sent=10, acked=8, received=5, segs_out=3, segs_in=2, size=160)) == TcpCounters(8, 5, 0, 3, 2)
    assert parse_tcp_info(tcp_info(sent=10, acked=8, received=5, retrans=1, size=216)) == TcpCounters(8, 5, 1, 0, 0)  # acked, not attempted
    assert parse_tcp_info(bytes(104)) is None  # before 4.1: no byte counters


def test_errors_and_garbage():
    with pytest.raises(NetlinkError) as e:
        parse_replies(nlmsg(NLMSG_ERROR, struct.pack("=i", -errno.EPERM) + bytes(16)))
    assert e.value.errno == errno.EPERM
    assert parse_replies(nlmsg(NLMSG_ERROR, struct.pack("=i", 0) + bytes(16))) == ([], False)  # an ack
    with pytest.raises(ValueError):
        parse_replies(struct.pack("=IHHII", 400, SOCK_DIAG_BY_FAMILY, 0, 1, 0) + bytes(20))  # longer than the data
    with pytest.raises(ValueError):
        parse_replies(nlmsg(SOCK_DIAG_BY_FAMILY, bytes(40)))  # shorter than an inet_diag_msg
    with pytest.raises(ValueError):
        parse_diag_msg(diag_msg(1, 1) + struct.pack("=HH", 200, INET_DIAG_INFO))  # an attribute past the end


def test_an_abortive_close_zeroes_the_counters_and_the_larger_reading_wins():
    before, zeroed = TcpCounters(900, 400, 10, 7, 6), TcpCounters()
    assert before.latest(zeroed) == zeroed.latest(before) == before
    assert TcpCounters(1, 9).latest(TcpCounters(5, 2)) == TcpCounters(5, 9)
