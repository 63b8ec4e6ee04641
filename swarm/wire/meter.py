"""Every byte a process tree sends and receives over TCP, from the kernel's per-socket counters.

A voloco peer's traffic leaves from hivemind's p2p daemon (p2pd, a child of the DHT's process: the
DHT, matchmaking, payloads, state downloads, all over libp2p connections) and from the peer itself
(a chain stage's TCP links). Neither reports the bytes of its connections, but the kernel keeps
them: the ``tcp_info`` of every socket (swarm/wire/sock_diag.py). ``WireMeter`` reads them from a daemon
thread, a few times a second, and whenever asked for fresh totals, and sums over the sockets of the
peer's process tree (swarm/wire/ledger.py says which are; the tree is walked from the root pid
through /proc).

What it cannot see: libp2p closes its connections abortively (SO_LINGER 0), which zeroes their
counters, so the bytes since the last poll die with the connection, and a connection opened and
closed between two polls (another node's dial-back, a NAT probe: 1-4 KB each) is missed. Where the
kernel allows it (CAP_NET_ADMIN: root, or a container given NET_ADMIN) the meter also reads the
notice of every destroyed socket, whose final counters cover the connections that close
gracefully. An abortive close zeroes the counters at the other end too (its p2pd closes its side
abortively when it reads the end): between two dumps the meter re-reads the sockets it follows by
lookup, every 50 ms (``refresh``), so a neighbour that leaves takes at most that long of bytes with
it; around the peer's own shutdown, when p2pd closes them all, ``closely`` reads every 10 ms. On an
oversubscribed machine both spread out with the load (``budget``: 32 peers on 2 cores, a lookup
every ~0.7 s), and such a close can take that much more with it.
Measured against the packets on the wire (3 peers on 20 Mbit/s test hosts, 3 rounds of 14 s,
tests/system/test_wire_bytes_hosts.py): 96.4-99.6 % of the bytes each way (89.7-98.4 % with dumps every
0.25 s alone). p2pd's UPnP discovery (``natPortMap``) sends a few
UDP datagrams (about 1 KB at start-up): UDP has no counters in sock_diag and is not counted.

The counts are TCP payload bytes: sent bytes as the other end acknowledged them (the kernel's
``bytes_sent`` also counts attempts a full local queue dropped, which never reached the wire;
swarm/wire/sock_diag.py), retransmissions apart in ``retransmitted``; TCP/IP headers and pure ACKs are not (``packets_*`` counts every segment, so a reader can add the
headers: 52 bytes a segment for IPv4 with TCP timestamps, 66 with Ethernet's). Where netlink
cannot be used (not Linux, a sandbox that forbids it) the meter says so in one log line and its
totals are None ("unknown"); it never stops the peer.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple

from swarm.wire.sock_diag import DestroyFeed, SockStat, dump_tcp, lookup_tcp
from swarm.wire.ledger import WireLedger, WireTotals

logger = logging.getLogger("voloco.swarm")

# seconds between polls: as short as MIN_PERIOD_S while a poll costs at most CPU_BUDGET of one core
# (a peer's own machine: tens of sockets, well under 1 ms a poll); on a machine with thousands of
# sockets (a dump costs ~3 us a socket) the polls spread out, up to MAX_PERIOD_S apart. The budget is
# divided by how oversubscribed the machine is (``budget``): 32 peers on 2 cores spent 1.75 % of a
# core each on their meters, 28 % of the machine (bench/RESULTS.md, 2026-12-01)
MIN_PERIOD_S, MAX_PERIOD_S, CPU_BUDGET = 0.25, 5.0, 0.01
# between dumps, the sockets already followed are re-read by lookup (a hash lookup each: ~15 us a
# socket against ~1 ms a dump walking the kernel's whole table), as often as this while the same
# budget allows: a connection another node closes loses at most this long of its bytes
REFRESH_MIN_S = 0.05
CLOSE_PERIOD_S, CLOSE_DUMP_EVERY = 0.01, 10  # while the peer shuts down (``closely``): lookups, and a dump every 10th


def budget(load: Callable[[], float] = lambda: os.getloadavg()[0], cores: Optional[int] = None) -> float:
    """The share of one core a meter may spend: ``CPU_BUDGET``, divided by the machine's
    oversubscription (its 1-minute load average over its cores, at least 1). A peer on a machine of
    its own keeps the whole budget; N peers on one oversubscribed machine spend together about what
    one would, instead of N budgets of the cores they share (tests/swarm/test_wire_bytes.py::
    test_the_meters_budget_shrinks_on_an_oversubscribed_machine)."""
    try:  # the load average counts the whole machine, so its cores do too (not this process's cpuset)
        oversubscribed = load() / max(1, cores or os.cpu_count() or 1)
    except (OSError, AttributeError):  # no load average here (not Linux): the whole budget
        return CPU_BUDGET
    return CPU_BUDGET / max(1.0, oversubscribed)


def _children(pid: int) -> List[int]:
    kids: List[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for tid in tids:
        try:  # a thread that ended meanwhile takes only its own children's line with it
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids.extend(int(k) for k in f.read().split())
        except OSError:
            continue
    return kids


def _parents() -> Dict[int, int]:
    parents: Dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parents[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return parents


def process_tree(root: int) -> List[int]:
    """``root`` and every descendant of it, from /proc (CONFIG_PROC_CHILDREN, else each process's ppid)."""
    if not os.path.exists(f"/proc/{root}"):
        return []  # gone: nothing to walk (the fallback below would read every process on the host)
    children = _children
    if not os.path.exists(f"/proc/{root}/task/{root}/children"):
        parents = _parents()
        children = lambda pid: [p for p, pp in parents.items() if pp == pid]  # noqa: E731
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children(pid))
    return tree


def socket_inodes(pids: Iterable[int]) -> Set[int]:
    """The inodes of the sockets the processes ``pids`` hold open (links ``socket:[INODE]`` in /proc/PID/fd)."""
    inodes: Set[int] = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or not ours to read
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(int(link[8:-1]))
    return inodes


class WireMeter:
    """The wire bytes of the process tree under ``root`` (default: this process), read from a daemon
    thread once ``start()`` is called, every ``period`` seconds (None: as often as ``share()`` of a
    core allows, ``budget``). ``totals()`` reads once more (``fresh=False``: by lookup only, while the thread
    runs) and returns the sum, or None when the kernel's counters cannot be read here."""

    def __init__(self, root: Optional[int] = None, period: Optional[float] = None,
                 dump: Callable[..., List[SockStat]] = dump_tcp, tree: Callable[[int], List[int]] = process_tree,
                 feed: Optional[Callable[[], DestroyFeed]] = DestroyFeed,
                 lookup: Optional[Callable[[List[SockStat]], List[SockStat]]] = lookup_tcp,
                 share: Callable[[], float] = budget):
        self.root = os.getpid() if root is None else root
        self.period = period if period is not None else MIN_PERIOD_S
        self._adapt = period is None
        self.refresh_period = REFRESH_MIN_S if self._adapt else self.period
        self._lookup, self._share = lookup, share
        self._dump, self._tree, self._new_feed = dump, tree, feed
        self._feed: Optional[DestroyFeed] = None
        self._ledger = WireLedger()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.unavailable: Optional[str] = None  # why the counters cannot be read; None: they can

    def poll(self) -> bool:
        """Read the namespace's sockets once; False (said once, in the log) when they cannot be read here."""
        with self._lock:
            if self.unavailable is not None:
                return False
            try:
                t0 = time.thread_time()
                self._take_notices()
                # the sockets the ledger has classified (other processes', internal, listeners) come back
                # unparsed: what is left to parse is about our own, however many peers share the host
                self._ledger.update(self._dump(skip=self._ledger.ignored), lambda: socket_inodes(self._tree(self.root)))
                if self._adapt:
                    cost = time.thread_time() - t0
                    self.period = min(MAX_PERIOD_S, max(MIN_PERIOD_S, cost / self._share()))
            except (OSError, ValueError) as e:
                self.unavailable = f"{type(e).__name__}: {e}"
                logger.info(f"wire bytes: unknown (the kernel's socket counters cannot be read here: {self.unavailable})")
                return False
        return True

    def refresh(self) -> None:
        """Re-read the counters of the sockets already followed, by lookup (no dump: new sockets and
        gone ones wait for the next ``poll``). Where lookups fail, the meter goes on with dumps only."""
        with self._lock:
            live = self._ledger.live() if self.unavailable is None and self._lookup is not None else []
            if not live:
                return
            try:
                t0 = time.thread_time()
                self._ledger.refresh(self._lookup(live))
                if self._adapt:
                    cost = time.thread_time() - t0
                    self.refresh_period = min(self.period, max(REFRESH_MIN_S, cost / self._share()))
            except (OSError, ValueError) as e:
                logger.debug(f"wire bytes: sockets cannot be looked up one by one ({e!r}): dumps only")
                self._lookup = None

    def _take_notices(self) -> None:
        if self._feed is None:
            return
        try:
            self._ledger.destroyed(self._feed.read())
        except (OSError, ValueError) as e:  # the polls go on without the notices
            logger.debug(f"wire bytes: stopped reading destroyed sockets' notices: {e!r}")
            self._feed.close()
            self._feed = None

    def totals(self, fresh: bool = True) -> Optional[WireTotals]:
        """The sum over the tree's sockets, None when the counters cannot be read here. ``fresh``: read
        every socket now (a dump). Not fresh, while the meter's thread runs: the sockets it follows are
        re-read by lookup, and sockets opened since its last dump are counted from its next one (at
        most ``period`` later), so the caller pays a lookup a socket, not a walk of the machine's whole
        socket table: what a peer's round record and status ask for twice a round (32 peers on one
        2-core host: 60 ms a dump, a fifth of a peer's exchange CPU, bench/RESULTS.md "Sixty-third
        session"). tests/swarm/test_wire_bytes.py::test_a_totals_that_need_not_be_fresh_takes_no_dump"""
        if fresh or self._thread is None or not self._thread.is_alive():
            if not self.poll():
                return None
        else:
            self.refresh()
            with self._lock:
                self._take_notices()
        with self._lock:
            return None if self.unavailable is not None else self._ledger.totals()

    def start(self) -> "WireMeter":
        if self._thread is not None or not self.poll():
            return self
        if self._new_feed is not None:
            try:
                self._feed = self._new_feed()
            except OSError as e:  # EPERM without CAP_NET_ADMIN: polls only
                logger.debug(f"wire bytes: no notices of destroyed sockets ({e}): connections shorter than "
                             f"{self.period:g} s are missed")
        self._thread = threading.Thread(target=self._run, name="wire-bytes", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        next_poll = time.monotonic() + self.period
        next_refresh = time.monotonic() + self.refresh_period
        while not self._stop.is_set():
            wait = max(0.0, min(next_poll, next_refresh) - time.monotonic())
            feed = self._feed
            if feed is not None:  # a destroy notice wakes the thread: take it before the buffer fills
                try:
                    readable = select.select([feed], [], [], min(wait, 0.5))[0]
                except (OSError, ValueError):  # closed meanwhile (an error while taking notices, or a shutdown)
                    continue
                if readable:
                    with self._lock:
                        self._take_notices()
                    continue
            elif self._stop.wait(wait):
                return
            now = time.monotonic()
            if now >= next_poll:
                next_poll, next_refresh = now + self.period, now + self.refresh_period
                if not self.poll():
                    return
            elif now >= next_refresh:
                next_refresh = now + self.refresh_period
                self.refresh()

    @contextmanager
    def closely(self, period: float = CLOSE_PERIOD_S) -> Iterator[None]:
        """Read the sockets every ``period`` seconds inside the block (by lookup; a full dump every
        ``CLOSE_DUMP_EVERY``-th time), for the peer's shutdown: p2pd closes its connections abortively
        when it stops (SO_LINGER 0), which zeroes their counters, so only what a read took just
        before counts; at the usual period the last round's bytes (a few % of a short run) would be lost."""
        done = threading.Event()

        def fast() -> None:
            reads = 0
            while not done.wait(period):
                reads += 1
                if reads % CLOSE_DUMP_EVERY:
                    self.refresh()
                elif not self.poll():
                    return

        thread = threading.Thread(target=fast, name="wire-bytes-closely", daemon=True)
        self.poll()
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join(5.0)
            self.poll()

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        with self._lock:
            if self._feed is not None:  # (``_take_notices`` may close it on an error)
                self._take_notices()
            if self._feed is not None:
                self._feed.close()
                self._feed = None


def wire_report(totals: Optional[WireTotals], payload: Tuple[int, int], chain: Tuple[int, int] = (0, 0)) -> Optional[dict]:
    """A peer's wire bytes for its status: the totals, and what of them is its exchange and state
    payloads (``payload``: sent, received, as the peer counted them), its chain links' activations
    (``chain``) and the rest, the control plane: DHT, matchmaking, progress records, state served
    to others, libp2p's handshakes and framing. None when the totals are unknown."""
    if totals is None:
        return None
    report = asdict(totals)
    for i, way in enumerate(("sent", "received")):
        total = report[way]
        report[f"{way}_by"] = {"payload": payload[i], "chain": chain[i], "control": max(0, total - payload[i] - chain[i])}
    return report
