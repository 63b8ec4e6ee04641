"""Several hosts on one machine: a network namespace each, joined by a shaped bridge.

    with Hosts(["coord", "a", "b"], rate="20mbit") as hosts:
        server = hosts.popen("coord", [sys.executable, "-m", "http.server", "8000"])
        subprocess.run(hosts.prefix("a") + ["curl", f"http://{hosts.addr('coord')}:8000"])

Layout of one instance with subnet index ``I`` (needs root, ``ip`` and ``tc``; never netem):

    vlcI-<name>  one namespace per host: ``lo`` and ``eth0`` up, eth0 holds 10.X.Y.n/24
    vlcI.sw      the "switch" namespace: bridge ``br0`` with one port ``h<n>`` per host

Each host's veth pair is ``eth0`` (in the host) <-> ``h<n>`` (on the bridge), and ``tbf`` shapes
the egress of both ends, so a host sends and receives at most its rate. Nothing is created in the
root namespace: no interface, address or route, so traffic never leaves the namespaces made here.

Instances never collide: the subnet index is claimed with ``flock`` on a file under
``/run/voloco-netns`` held for the instance's life. The kernel drops that lock when its process
dies, which is how ``cleanup_stale()`` tells a killed run's namespaces from a live one's.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import time
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

from swarm.helper_processes import signal_tree

LOCK_DIR = "/run/voloco-netns"
N_SUBNETS = 4096  # index i -> 10.(160 + i // 256).(i % 256).0/24
IFNAME = "eth0"  # the host end of every link, inside its own namespace
_NS_RE = re.compile(r"^vlc(\d+)[-.]")  # a harness namespace; group 1 is its subnet index
_PROBE_RE = re.compile(r"^vlcprobe(\d+)$")

# tbf: the queue holds LATENCY of traffic at the rate (a bottleneck queues before it drops, so TCP
# fills the link: 2.5 MB take 1.04x the ideal time at 20mbit); the bucket holds 4 ms of the rate
# (tokens come per timer tick: a smaller bucket caps a fast link below its rate) and at least
# 32 KiB, many full frames, so a slow link still passes a burst of small packets at once.
# tc's rate units: SI multiples; "bps" means bytes per second
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}


def rate_bits(rate: str) -> float:
    """Bits per second of a tc rate string such as ``"20mbit"``, ``"1gbit"`` or ``"500kbps"``."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]+)", rate.lower())
    if not m or m.group(2) not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"not a tc rate: {rate!r} (use e.g. 20mbit, 1gbit, 500kbit)")
    return float(m.group(1)) * _UNITS[m.group(2)]


def tbf_args(rate: str) -> List[str]:
    """The ``tc qdisc ... tbf`` parameters that shape a link at ``rate``."""
    burst = max(32 * 1024, int(rate_bits(rate) / 8 * 0.004))
    return ["tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


@functools.lru_cache(maxsize=1)
def netns_unavailable() -> Optional[str]:
    """Why this machine cannot run the harness (a reason for ``pytest.skip``), or None if it can.

    Besides root and the tools, it builds a namespace with a bridge, a veth pair and a tbf qdisc:
    a container may let one fail while allowing the others.
    """
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc", "sysctl"):
        if not shutil.which(tool):
            return f"{tool} is not installed"
    try:
        os.makedirs(LOCK_DIR, exist_ok=True)
    except OSError as e:
        return f"cannot create {LOCK_DIR}: {e}"
    ns = f"vlcprobe{os.getpid()}"
    steps = [("ip", "netns", "add", ns),
             ("ip", "-n", ns, "link", "add", "br0", "type", "bridge"),
             ("ip", "-n", ns, "link", "add", "v0", "type", "veth", "peer", "name", "v1"),
             ("ip", "-n", ns, "link", "set", "v0", "master", "br0"),
             ("tc", "-n", ns, "qdisc", "add", "dev", "v0", "root", *tbf_args("10mbit"))]  # fmt: skip
    try:
        for step in steps:
            r = _sh(*step, check=False)
            if r.returncode:
                return f"`{' '.join(step)}` failed: {r.stderr.strip() or r.returncode}"
    finally:
        _sh("ip", "netns", "del", ns, check=False)
    return None


def needs_netns_fixture():
    """An autouse pytest fixture that skips each test of the module that binds it
    (``_needs_netns = needs_netns_fixture()``) where ``netns_unavailable`` gives a reason."""
    import pytest  # the harness itself runs without pytest (bench/)

    @pytest.fixture(autouse=True)
    def _needs_netns():
        why = netns_unavailable()
        if why:
            pytest.skip(f"needs network namespaces: {why}")

    return _needs_netns


def _netns_names() -> List[str]:
    out = _sh("ip", "netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_netns(ns: str) -> None:
    """SIGKILL every process inside ``ns``, then delete it (which also deletes its veth ends)."""
    for pid in _sh("ip", "netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _sh("ip", "netns", "del", ns, check=False)


def _try_lock(index: int) -> Optional[int]:
    """An open fd holding the exclusive lock on subnet ``index``, or None if someone holds it."""
    os.makedirs(LOCK_DIR, exist_ok=True)
    fd = os.open(os.path.join(LOCK_DIR, f"{index}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def cleanup_stale() -> List[str]:
    """Delete the namespaces a killed run left behind; returns their names.

    A namespace counts as stale when no live process holds its subnet's lock (or, for the
    availability probe's, when its process is gone), so concurrent live instances are untouched.
    """
    removed = []
    by_index: Dict[int, List[str]] = {}
    for ns in _netns_names():
        if (m := _NS_RE.match(ns)) is not None:
            by_index.setdefault(int(m.group(1)), []).append(ns)
        elif (m := _PROBE_RE.match(ns)) is not None and not os.path.exists(f"/proc/{m.group(1)}"):
            _kill_netns(ns)
            removed.append(ns)
    for index, names in by_index.items():
        fd = _try_lock(index)
        if fd is None:
            continue  # a live instance owns it
        try:
            for ns in names:
                _kill_netns(ns)
                removed.append(ns)
        finally:
            os.close(fd)
    return removed


RateSpec = Optional[str]  # a tc rate such as "20mbit", or None: unshaped


class Hosts:
    """A context manager: one network namespace per host name, all on one shaped bridge.

    ``names`` is a list of host names, or a mapping from name to its rate (None: unshaped);
    ``rates`` overrides ``rate`` per host as well. Hosts get addresses .1, .2, ... in the order
    given. ``subnet_index`` (0 to 4095) picks the subnet; by default the first free one.
    """

    def __init__(self, names: Union[Sequence[str], Mapping[str, RateSpec]], rate: RateSpec = "100mbit",
                 subnet_index: Optional[int] = None, rates: Optional[Mapping[str, RateSpec]] = None):  # fmt: skip
        overrides = dict(names) if isinstance(names, Mapping) else {}
        overrides.update(rates or {})
        self.names = list(names)
        if not self.names or len(set(self.names)) != len(self.names) or len(self.names) > 250:
            raise ValueError(f"need 1 to 250 distinct host names, got {self.names}")
        for name in self.names:
            if not re.fullmatch(r"[A-Za-z0-9_]+", name):
                raise ValueError(f"host name {name!r}: use letters, digits and _")
        if set(overrides) - set(self.names):
            raise ValueError(f"rates for unknown hosts: {sorted(set(overrides) - set(self.names))}")
        self.rates: Dict[str, RateSpec] = {n: overrides.get(n, rate) for n in self.names}
        for r in self.rates.values():
            if r is not None:
                rate_bits(r)  # fail before touching the system
        if subnet_index is not None and not 0 <= subnet_index < N_SUBNETS:
            raise ValueError(f"subnet_index must be in [0, {N_SUBNETS})")
        self._want_index = subnet_index
        self.index: Optional[int] = None
        self._lock_fd: Optional[int] = None
        self._created: List[str] = []
        self._procs: List[subprocess.Popen] = []

    def ns(self, name: str) -> str:
        """The namespace of host ``name``."""
        self._check(name)
        return f"vlc{self.index}-{name}"

    @property
    def switch_ns(self) -> str:
        return f"vlc{self.index}.sw"

    def addr(self, name: str) -> str:
        """The IPv4 address of host ``name`` (on its ``eth0``)."""
        self._check(name)
        i = self.index
        return f"10.{160 + i // 256}.{i % 256}.{self.names.index(name) + 1}"

    def prefix(self, name: str) -> List[str]:
        """The argv prefix that runs a command inside host ``name``."""
        return ["ip", "netns", "exec", self.ns(name)]

    def _port(self, name: str) -> str:  # the bridge's end of the host's link
        return f"h{self.names.index(name)}"

    def _check(self, name: str) -> None:
        if self.index is None:
            raise RuntimeError("Hosts is not entered")
        if name not in self.names:
            raise KeyError(f"no host {name!r} (hosts: {self.names})")

    def __enter__(self) -> "Hosts":
        if self._want_index is not None:
            self._lock_fd = _try_lock(self._want_index)
            if self._lock_fd is None:
                raise RuntimeError(f"subnet index {self._want_index} is in use by another instance")
            self.index = self._want_index
        else:
            start = os.getpid() % N_SUBNETS
            for index in [(start + k) % N_SUBNETS for k in range(N_SUBNETS)]:
                if (fd := _try_lock(index)) is not None:
                    self.index, self._lock_fd = index, fd
                    break
            else:
                raise RuntimeError("every subnet index is in use")
        try:
            stale = [ns for ns in _netns_names() if (m := _NS_RE.match(ns)) and int(m.group(1)) == self.index]
            for ns in stale:  # a killed run's leftovers: its lock died with it, and now it is ours
                _kill_netns(ns)
            self._setup()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _new_ns(self, ns: str) -> None:
        _sh("ip", "netns", "add", ns)
        self._created.append(ns)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        # no IPv6: its neighbour discovery and MLD chatter would add to the byte counters
        _sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
            "net.ipv6.conf.default.disable_ipv6=1", check=False)  # fmt: skip

    def _setup(self) -> None:
        sw = self.switch_ns
        self._new_ns(sw)
        _sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge", "stp_state", "0", "forward_delay", "0")
        _sh("ip", "-n", sw, "link", "set", "br0", "up")
        for name in self.names:
            ns, port = self.ns(name), self._port(name)
            self._new_ns(ns)
            # created in the switch with its peer born inside the host: never in the root namespace
            _sh("ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", ns)
            _sh("ip", "-n", sw, "link", "set", port, "master", "br0")
            _sh("ip", "-n", sw, "link", "set", port, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.addr(name)}/24", "dev", IFNAME)
            _sh("ip", "-n", ns, "link", "set", IFNAME, "up")
            self.set_rate(name, self.rates[name])

    def __exit__(self, *exc) -> None:
        for p in self._procs:
            signal_tree(p, signal.SIGKILL)  # its own group only, once reaped
        for ns in reversed(self._created):  # also kills what escaped its process group
            _kill_netns(ns)
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass  # stuck in the kernel: nothing more to do here
        self._procs, self._created = [], []
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # last: the subnet is free only once its namespaces are gone
            self._lock_fd = None

    def popen(self, name: str, argv: Sequence[str], **kw) -> subprocess.Popen:
        """Start ``argv`` inside host ``name`` in a new session; ``__exit__`` kills its group."""
        kw.setdefault("start_new_session", True)
        p = subprocess.Popen(self.prefix(name) + list(argv), **kw)
        self._procs.append(p)
        return p

    def counters(self, name: str) -> Tuple[int, int]:
        """``(rx_bytes, tx_bytes)`` of host ``name``'s ``eth0`` (Ethernet frames, headers included)."""
        stats = self.link_stats(name)
        return stats["rx_bytes"], stats["tx_bytes"]

    def link_stats(self, name: str) -> Dict[str, int]:
        """Host ``name``'s ``eth0`` counters: ``rx_bytes``, ``tx_bytes`` (Ethernet frames, headers
        included), ``rx_packets``, ``tx_packets`` (a GSO packet counts once, with one set of headers)."""
        out = _sh("ip", "-n", self.ns(name), "-s", "-j", "link", "show", "dev", IFNAME).stdout
        stats = json.loads(out)[0]["stats64"]
        return {f"{way}_{unit}": stats[way][unit] for way in ("rx", "tx") for unit in ("bytes", "packets")}

    def link_stats_all(self) -> Dict[str, Dict[str, int]]:
        """Every host's ``link_stats``, read at once from the switch's end of each link (one command for
        all: cheap enough for a watcher's every poll). The two ends of a veth mirror each other: what
        the switch's port received, the host sent."""
        out = _sh("ip", "-n", self.switch_ns, "-s", "-j", "link", "show").stdout
        ports = {link["ifname"]: link["stats64"] for link in json.loads(out) if "stats64" in link}
        mirror = {"rx": "tx", "tx": "rx"}
        return {name: {f"{mirror[way]}_{unit}": ports[self._port(name)][way][unit]
                       for way in ("rx", "tx") for unit in ("bytes", "packets")} for name in self.names}

    def set_rate(self, name: str, rate: RateSpec) -> None:
        """Shape host ``name``'s link at ``rate`` in both directions (None: unshaped)."""
        for ns, dev in ((self.ns(name), IFNAME), (self.switch_ns, self._port(name))):
            if rate is None:  # deleting the default qdisc fails harmlessly
                _sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
            else:
                _sh("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *tbf_args(rate))
        self.rates[name] = rate

    def block_inbound(self, name: str) -> None:
        """Host ``name`` behind a NAT without port forwarding: its ``eth0`` drops every new connection
        that comes in (iptables, conntrack), while its own connections out and their answers pass."""
        if not shutil.which("iptables"):
            raise RuntimeError("iptables is not installed")
        _sh("ip", "netns", "exec", self.ns(name), "iptables", "-A", "INPUT", "-i", IFNAME,
            "-m", "conntrack", "--ctstate", "NEW", "-j", "DROP")  # fmt: skip

    def link_down(self, name: str) -> None:
        """Take host ``name``'s ``eth0`` down: it can reach no one and no one reaches it."""
        _sh("ip", "-n", self.ns(name), "link", "set", IFNAME, "down")

    def link_up(self, name: str) -> None:
        """Bring host ``name``'s ``eth0`` back up (its address and subnet route come back with it)."""
        _sh("ip", "-n", self.ns(name), "link", "set", IFNAME, "up")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # a veth has carrier at once; make sure of it anyway
            out = _sh("ip", "-n", self.ns(name), "-j", "link", "show", "dev", IFNAME).stdout
            if json.loads(out)[0].get("operstate") == "UP":
                return
            time.sleep(0.02)
        raise RuntimeError(f"{name}'s {IFNAME} did not come up")
