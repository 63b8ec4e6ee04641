"""Which TCP sockets are a process tree's, and the sum of their byte counters across polls (pure).

``WireLedger`` is fed what the kernel says (swarm/wire/sock_diag.py): dumps of every TCP socket of the
network namespace (``update``) and, where the peer may subscribe to them, the notices of destroyed
sockets with their final counters (``destroyed``). It decides which sockets are the tree's:

- a listening socket whose inode a process of the tree holds gives the tree its port; a
  connection from that local port is the tree's (libp2p dials out from its listening port too,
  SO_REUSEPORT), even one first seen orphaned or only in its destroy notice;
- any other socket is the tree's when a process of the tree holds its inode (``owned``: called only
  when a dump holds a socket no port decides, so the /proc walk is rare);
- a connection whose two ends are the tree's never leaves the machine: left out.

A socket is then followed by its cookie (the kernel's id of a socket, never reused): it counts
after its process closed it, and once it is gone its last counters (or its final ones, from its
destroy notice) stay in the totals.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import AbstractSet, Callable, Dict, Iterable, Set, Tuple, Union

from swarm.wire.sock_diag import TCP_LISTEN, SockStat, TcpCounters

KEEP_GONE_POLLS = 10  # a gone socket's destroy notice may come this many polls late and still replace its last counters


@dataclass(frozen=True)
class WireTotals:
    sent: int = 0  # TCP payload bytes, retransmissions included
    received: int = 0
    retransmitted: int = 0
    packets_sent: int = 0  # every TCP segment, pure ACKs included
    packets_received: int = 0
    sockets: int = 0  # connections counted so far

    def add(self, c: TcpCounters) -> "WireTotals":
        return WireTotals(self.sent + c.sent, self.received + c.received, self.retransmitted + c.retransmitted,
                          self.packets_sent + c.segs_out, self.packets_received + c.segs_in, self.sockets + 1)


Owned = Union[Set[int], Callable[[], Set[int]]]


class WireLedger:
    def __init__(self) -> None:
        self.ports: Set[int] = set()  # local ports the tree listens on
        self._live: Dict[int, SockStat] = {}  # cookie -> the last dump's entry of a socket of the tree
        self._gone: Dict[int, Tuple[TcpCounters, int]] = {}  # cookie -> (its last counters, the poll it left at)
        self._ignored: Set[int] = set()  # cookies decided: not the tree's, a listener, or gone long ago
        self._polls = 0
        self.closed = WireTotals()

    @property
    def ignored(self) -> AbstractSet[int]:
        """The cookies decided as not the tree's (another process's, internal, a listener, long gone): a
        dump need not parse them again, only say they are still there (``sock_diag.dump_tcp``'s skip)."""
        return self._ignored

    def update(self, dump: Iterable[SockStat], owned: Owned) -> None:
        """One dump of the namespace's TCP sockets; ``owned``: the socket inodes the tree holds now."""
        dump = list(dump)
        self._polls += 1
        known = self._live.keys() | self._gone.keys() | self._ignored
        new = [s for s in dump if s.cookie not in known]
        inodes: Set[int] = set()
        if any(s.inode and (s.state == TCP_LISTEN or s.sport not in self.ports) for s in new):
            inodes = owned() if callable(owned) else owned
        for s in new:
            if s.state == TCP_LISTEN:
                if s.inode:
                    self._ignored.add(s.cookie)
                    if s.inode in inodes:
                        self.ports.add(s.sport)
        mine: Dict[int, SockStat] = {}
        for s in new:
            if s.state == TCP_LISTEN or s.counters is None:  # no counters yet (a request socket) or ever (TIME_WAIT)
                continue
            if s.sport in self.ports or s.inode in inodes:
                mine[s.cookie] = s
            elif s.inode:
                self._ignored.add(s.cookie)
        ends = {(s.src, s.sport) for s in [*self._live.values(), *mine.values()]}
        for cookie, s in mine.items():
            if (s.dst, s.dport) in ends:  # both ends are the tree's: internal, never on a wire
                self._ignored.add(cookie)
            else:
                self._live[cookie] = s
        present = {s.cookie: s for s in dump}
        for cookie in list(self._live):
            s = present.get(cookie)
            if s is None:
                self._gone[cookie] = (self._live.pop(cookie).counters, self._polls)
            elif s.counters is not None:  # in TIME_WAIT the kernel keeps no counters: keep the last
                self._live[cookie] = replace(s, counters=self._live[cookie].counters.latest(s.counters))
        for cookie, (counters, when) in list(self._gone.items()):
            if self._polls - when > KEEP_GONE_POLLS:
                self.closed = self.closed.add(self._gone.pop(cookie)[0])
                self._ignored.add(cookie)
        self._ignored &= present.keys()  # cookies are never reused: forget those gone from the namespace

    def refresh(self, entries: Iterable[SockStat]) -> None:
        """Newer counters of sockets already followed (``sock_diag.lookup_tcp`` of ``live()``); entries
        of other sockets are ignored, and a socket missing from them is left to the next dump."""
        for s in entries:
            old = self._live.get(s.cookie)
            if old is not None and s.counters is not None:
                self._live[s.cookie] = replace(old, counters=old.counters.latest(s.counters))

    def live(self) -> list:
        """The sockets followed now, as the last dump or refresh saw them."""
        return list(self._live.values())

    def destroyed(self, notices: Iterable[SockStat]) -> None:
        """Sockets the kernel destroyed, with their final counters (they replace the last seen)."""
        for s in notices:
            if s.counters is None or s.state == TCP_LISTEN or s.cookie in self._ignored:
                continue
            if s.cookie in self._live:
                last, when = self._live.pop(s.cookie).counters, self._polls
            elif s.cookie in self._gone:
                last, when = self._gone[s.cookie]
            elif s.sport in self.ports and not self._internal(s):
                last, when = TcpCounters(), self._polls
            else:
                continue  # not the tree's, or never left the machine
            self._gone[s.cookie] = (last.latest(s.counters), when)

    def _internal(self, s: SockStat) -> bool:
        return s.dport in self.ports and s.dst in {t.src for t in self._live.values()} | {s.src}

    def totals(self) -> WireTotals:
        total = self.closed
        for s in self._live.values():
            total = total.add(s.counters)
        for counters, _ in self._gone.values():
            total = total.add(counters)
        return total
