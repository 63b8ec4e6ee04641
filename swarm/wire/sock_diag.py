"""The kernel's own byte counters of every TCP socket, over NETLINK_SOCK_DIAG (what ``ss -ti`` reads).

One dump asks the kernel for every TCP socket of this network namespace with its ``tcp_info``;
``dump_tcp`` sends it for IPv4 and IPv6 and returns one ``SockStat`` per socket. ``DestroyFeed``
subscribes to the kernel's notice of every TCP socket it destroys, with its final ``tcp_info``
(``ss -E``; joining that multicast group takes CAP_NET_ADMIN in the namespace). Building the
request and parsing the replies are pure functions of bytes (``dump_request``, ``parse_replies``,
``parse_tcp_info``), tested on constructed replies; only ``dump_tcp`` and ``DestroyFeed`` touch a
socket. Linux only: elsewhere ``socket.AF_NETLINK`` does not exist and both raise ``OSError``.

Layouts (include/uapi/linux/netlink.h, inet_diag.h, tcp.h; host byte order except ports and
addresses, which are big-endian):

    nlmsghdr        u32 len, u16 type, u16 flags, u32 seq, u32 pid                          16 bytes
    inet_diag_req_v2  u8 family, u8 protocol, u8 ext, u8 pad, u32 states, inet_diag_sockid  56 bytes
    inet_diag_sockid  be16 sport, be16 dport, be32 src[4], be32 dst[4], u32 if, u32 cookie[2] 48 bytes
    inet_diag_msg   u8 family, u8 state, u8 timer, u8 retrans, sockid, u32 expires, rqueue,
                    wqueue, uid, inode                                                       72 bytes
    then rtattrs (u16 len, u16 type, data padded to 4); INET_DIAG_INFO (2) holds struct tcp_info.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from dataclasses import astuple, dataclass
from typing import Container, List, Optional, Tuple

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
INET_DIAG_INFO = 2
TCP_TIME_WAIT, TCP_LISTEN, TCP_NEW_SYN_RECV = 6, 10, 12
# TIME_WAIT and request sockets keep no counters (and a busy machine has thousands): not asked for
WITH_COUNTERS = 0xFFFFFFFF & ~(1 << TCP_TIME_WAIT | 1 << TCP_NEW_SYN_RECV)
SOL_NETLINK, NETLINK_ADD_MEMBERSHIP = 270, 1
SKNLGRP_INET_TCP_DESTROY, SKNLGRP_INET6_TCP_DESTROY = 1, 3

_NLMSG = struct.Struct("=IHHII")
_ERR = struct.Struct("=i")
_REQ = struct.Struct("=BBBBI")  # inet_diag_req_v2 up to its sockid
_MSG_HEAD = struct.Struct("=BB")  # inet_diag_msg: family, state
_PORTS = struct.Struct(">HH")  # at 4: sport, dport (big-endian); at 8 and 24: src, dst
_MSG_TAIL = struct.Struct("=4xII16xI")  # at 40, after the interface: cookie[2], (expires, queues, uid), inode
_RTA = struct.Struct("=HH")
SOCKID_LEN = 48
MSG_LEN = 72
# struct tcp_info: offset of each counter used here (the struct only grows; older kernels send less)
TCPI_BYTES_ACKED = 120  # u64, Linux 4.1
TCPI_BYTES_RECEIVED = 128  # u64, 4.1
TCPI_SEGS_OUT = 136  # u32, 4.2: every segment sent, pure ACKs and retransmissions included
TCPI_SEGS_IN = 140  # u32, 4.2
TCPI_BYTES_SENT = 200  # u64, 4.19: payload bytes handed to the device, local drops and retransmissions included
TCPI_BYTES_RETRANS = 208  # u64, 4.19
_TCPI_BYTES = struct.Struct("=QQII")  # bytes_acked, bytes_received, segs_out, segs_in
_TCPI_SENT = struct.Struct("=QQ")  # bytes_sent, bytes_retrans (or bytes_acked, bytes_received)


class NetlinkError(OSError):
    """The kernel answered a sock_diag request with an error (errno in ``errno``)."""


@dataclass(frozen=True)
class TcpCounters:
    """One socket's counters from its ``tcp_info``. ``sent`` is the bytes the other end acknowledged:
    the kernel's own ``bytes_sent`` also counts every attempt a local queue dropped (a full ``tbf``
    on the host), which never reached the wire: 15.7-16.5 MB against 9.06 MB on the interface for
    9.0 MB written over 10 Mbit/s. ``retransmitted`` is the kernel's retransmitted bytes, apart;
    ``received`` counts each byte once, in order."""

    sent: int = 0
    received: int = 0
    retransmitted: int = 0
    segs_out: int = 0
    segs_in: int = 0

    def latest(self, other: "TcpCounters") -> "TcpCounters":
        """The later of two readings of one socket: each counter only grows, except that an abortive
        close (SO_LINGER 0, as libp2p closes its connections) zeroes them all: keep the larger."""
        return TcpCounters(*(max(a, b) for a, b in zip(astuple(self), astuple(other))))


@dataclass(frozen=True)
class SockStat:
    cookie: int  # the kernel's id of the socket, unique while the machine runs
    inode: int  # of the socket's file; 0 once no process holds it (orphaned, in TIME_WAIT)
    family: int
    state: int
    src: str
    sport: int
    dst: str
    dport: int
    counters: Optional[TcpCounters]  # None: the kernel sent no tcp_info (TIME_WAIT, a request socket)


def dump_request(family: int, seq: int = 1, states: int = WITH_COUNTERS) -> bytes:
    """A SOCK_DIAG_BY_FAMILY dump request for every TCP socket of ``family`` in ``states``, with tcp_info."""
    body = _REQ.pack(family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), 0, states) + bytes(SOCKID_LEN)
    return _NLMSG.pack(_NLMSG.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + body


def lookup_request(sock: "SockStat", seq: int) -> bytes:
    """A SOCK_DIAG_BY_FAMILY request for one known socket (its addresses, ports and cookie): the
    kernel answers from its hash lookup, without the walk of every bucket a dump costs (~1 ms on a
    machine with a large table), or with ENOENT once the socket has gone (ESTALE: another socket
    took its addresses)."""
    n = 4 if sock.family == socket.AF_INET else 16
    src = socket.inet_pton(sock.family, sock.src).ljust(16, b"\0")
    dst = socket.inet_pton(sock.family, sock.dst).ljust(16, b"\0")
    if len(src) != 16 or len(dst) != 16 or n not in (4, 16):
        raise ValueError(f"not an IPv4 or IPv6 socket: {sock}")
    sockid = _PORTS.pack(sock.sport, sock.dport) + src + dst + struct.pack("=III", 0, sock.cookie & 0xFFFFFFFF,
                                                                          sock.cookie >> 32)
    body = _REQ.pack(sock.family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), 0, 0xFFFFFFFF) + sockid
    return _NLMSG.pack(_NLMSG.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, seq, 0) + body


def parse_tcp_info(info: bytes, start: int = 0, end: Optional[int] = None) -> Optional[TcpCounters]:
    """The counters of a ``struct tcp_info`` as the kernel sent it (``info[start:end]``); None if it
    is too short to hold the byte counters (a kernel before 4.1). Before 4.19 there is no
    ``retransmitted``; before 4.2 the segment counts are 0."""
    size = (len(info) if end is None else end) - start
    if size < TCPI_BYTES_RECEIVED + 8:
        return None
    if size >= TCPI_BYTES_RETRANS + 8:
        acked, received, segs_out, segs_in = _TCPI_BYTES.unpack_from(info, start + TCPI_BYTES_ACKED)
        _, retrans = _TCPI_SENT.unpack_from(info, start + TCPI_BYTES_SENT)
        return TcpCounters(acked, received, retrans, segs_out, segs_in)
    if size >= TCPI_SEGS_IN + 4:
        acked, received, segs_out, segs_in = _TCPI_BYTES.unpack_from(info, start + TCPI_BYTES_ACKED)
        return TcpCounters(acked, received, 0, segs_out, segs_in)
    acked, received = _TCPI_SENT.unpack_from(info, start + TCPI_BYTES_ACKED)
    return TcpCounters(acked, received)


def parse_diag_msg(payload: bytes, start: int = 0, end: Optional[int] = None, skip: Container[int] = ()) -> SockStat:
    """One ``inet_diag_msg`` and its attributes (``payload[start:end]``: the body of one netlink message).

    A socket whose cookie is in ``skip`` (one a reader has already classified, e.g. another process's)
    comes back without addresses or counters: on a host with many peers most of a dump is other
    processes' sockets, and their addresses and tcp_info are two thirds of its parse
    (tests/swarm/test_sock_diag.py, test_a_skipped_socket_keeps_its_cookie_and_ports_only)."""
    end = len(payload) if end is None else end
    if end - start < MSG_LEN:
        raise ValueError(f"inet_diag_msg of {end - start} bytes (at least {MSG_LEN})")
    family, state = _MSG_HEAD.unpack_from(payload, start)
    sport, dport = _PORTS.unpack_from(payload, start + 4)
    c0, c1, inode = _MSG_TAIL.unpack_from(payload, start + 40)
    cookie = c0 | c1 << 32
    if cookie in skip:
        return SockStat(cookie, inode, family, state, "", sport, "", dport, None)
    n = 4 if family == socket.AF_INET else 16
    src = socket.inet_ntop(family, payload[start + 8:start + 8 + n])
    dst = socket.inet_ntop(family, payload[start + 24:start + 24 + n])
    counters = None
    offset = start + MSG_LEN
    while offset + _RTA.size <= end:  # the attributes: INET_DIAG_INFO is the one wanted
        length, kind = _RTA.unpack_from(payload, offset)
        if length < _RTA.size or offset + length > end:
            raise ValueError(f"rtattr of length {length} at {offset - start} in {end - start} bytes")
        if kind == INET_DIAG_INFO:
            counters = parse_tcp_info(payload, offset + _RTA.size, offset + length)
        offset += (length + 3) & ~3
    return SockStat(cookie, inode, family, state, src, sport, dst, dport, counters)


def parse_replies(data: bytes, seq: Optional[int] = None, skip: Container[int] = ()) -> Tuple[List[SockStat], bool]:
    """The sockets in one ``recv`` of a dump's replies, and whether the dump is done (NLMSG_DONE).
    Raises NetlinkError for an NLMSG_ERROR, ValueError for bytes that are not netlink messages;
    messages of another sequence number (a stale dump) are skipped."""
    socks: List[SockStat] = []
    for kind, msg_seq, body, end in _messages(data):
        if seq is not None and msg_seq != seq:
            continue
        if kind == NLMSG_DONE:
            return socks, True
        if kind == NLMSG_ERROR:
            code = _error_code(data, body, end)
            if code:
                raise NetlinkError(code, f"sock_diag: {os.strerror(code)}")
            continue  # an acknowledgement
        if kind == SOCK_DIAG_BY_FAMILY:
            socks.append(parse_diag_msg(data, body, end, skip))
    return socks, False


def _messages(data: bytes):
    """(type, sequence number, body start, body end) of each netlink message in ``data``; ValueError
    for bytes that are not netlink messages."""
    offset = 0
    while offset + _NLMSG.size <= len(data):
        length, kind, _, seq, _ = _NLMSG.unpack_from(data, offset)
        if length < _NLMSG.size or offset + length > len(data):
            raise ValueError(f"netlink message of length {length} at {offset} in {len(data)} bytes")
        yield kind, seq, offset + _NLMSG.size, offset + length
        offset += (length + 3) & ~3


def _error_code(data: bytes, body: int, end: int) -> int:
    """The errno of an NLMSG_ERROR message's body (0: an acknowledgement)."""
    return -_ERR.unpack_from(data, body)[0] if end - body >= 4 else 0


def _netlink() -> socket.socket:
    if not hasattr(socket, "AF_NETLINK"):
        raise OSError("no netlink on this platform")
    return socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG)


def dump_tcp(families: Tuple[int, ...] = (socket.AF_INET, socket.AF_INET6), timeout: float = 2.0,
             skip: Container[int] = ()) -> List[SockStat]:
    """Every TCP socket of this network namespace that has counters (listeners too, for their ports);
    those whose cookie is in ``skip`` with their cookie, inode, state and ports only (``parse_diag_msg``).

    Raises OSError where netlink's sock_diag is unavailable (not Linux, a sandbox without it)."""
    out: List[SockStat] = []
    with _netlink() as nl:
        nl.settimeout(timeout)
        for seq, family in enumerate(families, start=1):
            nl.send(dump_request(family, seq))
            while True:
                socks, done = parse_replies(nl.recv(1 << 17), seq, skip)
                out.extend(socks)
                if done:
                    break
    return out


def lookup_tcp(socks: List["SockStat"], timeout: float = 2.0) -> List[SockStat]:
    """The current entries of the sockets ``socks`` (known from a dump), asked one by one in a single
    send: those still there, in any order; a socket gone since (ENOENT, ESTALE) is left out."""
    out: List[SockStat] = []
    if not socks:
        return out
    with _netlink() as nl:
        nl.settimeout(timeout)
        nl.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        nl.send(b"".join(lookup_request(s, seq) for seq, s in enumerate(socks, start=1)))
        pending = set(range(1, len(socks) + 1))
        while pending:
            data = nl.recv(1 << 17)
            for kind, seq, body, end in _messages(data):  # one reply (a message or an error) per request
                pending.discard(seq)
                if kind == SOCK_DIAG_BY_FAMILY:
                    out.append(parse_diag_msg(data, body, end))
                elif kind == NLMSG_ERROR:
                    code = _error_code(data, body, end)
                    if code not in (0, errno.ENOENT, errno.ESTALE):
                        raise NetlinkError(code, f"sock_diag: {os.strerror(code)}")
    return out


class DestroyFeed:
    """The TCP sockets the kernel destroys in this network namespace, each with its final counters.

    Raises OSError (EPERM) without CAP_NET_ADMIN. ``fileno`` for ``select``; ``read`` returns what
    has arrived (never blocks once ``select`` said readable)."""

    def __init__(self) -> None:
        self._nl = _netlink()
        self.lost = 0  # how many times notices were dropped (the socket's buffer was full)
        try:
            self._nl.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            self._nl.bind((0, 0))
            for group in (SKNLGRP_INET_TCP_DESTROY, SKNLGRP_INET6_TCP_DESTROY):
                self._nl.setsockopt(SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, group)
            self._nl.setblocking(False)
        except OSError:
            self._nl.close()
            raise

    def fileno(self) -> int:
        return self._nl.fileno()

    def read(self) -> List[SockStat]:
        out: List[SockStat] = []
        while True:
            try:
                data = self._nl.recv(1 << 17)
            except BlockingIOError:
                return out
            except OSError as e:  # ENOBUFS: the kernel dropped notices the buffer had no room for
                if e.errno != errno.ENOBUFS:
                    raise
                self.lost += 1
                continue
            out.extend(parse_replies(data)[0])

    def close(self) -> None:
        self._nl.close()
