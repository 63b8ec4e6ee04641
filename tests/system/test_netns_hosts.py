"""The multi-host harness: reachability, isolation from the root namespace, the tbf cap in both
directions, link faults, and cleanup after a normal exit, a failed setup and a killed run."""

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.netns_hosts import Hosts, cleanup_stale, netns_unavailable, rate_bits, tbf_args

REPO = Path(__file__).resolve().parents[2]
PORT = 5000  # every instance has its own namespaces, so a fixed port never collides

# one tiny network tool, run with sys.executable inside a host:
#   serve ADDR          accept forever; echo each connection's bytes, then reply how many came
#   send ADDR N TIMEOUT connect, send N bytes, half-close, print {"n": reply, "s": seconds}
NET_TOOL = r"""
import json, socket, sys, time
mode, addr = sys.argv[1], sys.argv[2]
if mode == "serve":
    srv = socket.create_server((addr, %d))
    print("ready", flush=True)
    while True:
        conn, _ = srv.accept()
        n, first = 0, b""
        while chunk := conn.recv(1 << 16):
            first, n = first or chunk[:4], n + len(chunk)
        conn.sendall(first + str(n).encode())
        conn.close()
else:
    n, timeout = int(sys.argv[3]), float(sys.argv[4])
    t0 = time.monotonic()
    conn = socket.create_connection((addr, %d), timeout=timeout)
    conn.settimeout(None)
    conn.sendall(b"ping" + bytes(n - 4))
    conn.shutdown(socket.SHUT_WR)
    reply = b""
    while chunk := conn.recv(1024):
        reply += chunk
    print(json.dumps({"echo": reply[:4].decode(), "n": int(reply[4:]), "s": time.monotonic() - t0}))
""" % (PORT, PORT)

_reason = netns_unavailable()
netns = pytest.mark.skipif(_reason is not None, reason=f"no network namespaces: {_reason}")


def serve(hosts: Hosts, name: str) -> subprocess.Popen:
    p = hosts.popen(name, [sys.executable, "-c", NET_TOOL, "serve", hosts.addr(name)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def send(hosts: Hosts, src: str, dst: str, nbytes: int = 4, timeout: float = 5.0) -> dict | None:
    """What ``src`` measured sending ``nbytes`` to ``dst``'s server, or None if it could not."""
    argv = hosts.prefix(src) + [sys.executable, "-c", NET_TOOL, "send", hosts.addr(dst), str(nbytes), str(timeout)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 30)
    return json.loads(r.stdout) if r.returncode == 0 else None


def root_addrs() -> list:
    out = subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True, check=True).stdout
    return [(i["ifname"], a["local"]) for i in json.loads(out) for a in i.get("addr_info", [])]


def root_reply(addr: str) -> bytes:
    """What a client in the root namespace hears back from ``addr`` (b"" when nothing)."""
    try:
        with socket.create_connection((addr, PORT), timeout=1) as conn:
            conn.settimeout(1)
            conn.sendall(b"ping")
            conn.shutdown(socket.SHUT_WR)
            return conn.recv(1024)
    except OSError:
        return b""


def alive(pid: int) -> bool:
    """A process that still runs (a zombie waiting for its reaper counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def harness_namespaces(index: int) -> list:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [ln.split()[0] for ln in out.splitlines() if ln.startswith((f"vlc{index}-", f"vlc{index}."))]


def test_rates_and_arguments():
    assert rate_bits("20mbit") == 20e6 and rate_bits("500kbit") == 5e5 and rate_bits("1mbps") == 8e6
    assert tbf_args("20mbit") == ["tbf", "rate", "20mbit", "burst", "32768", "latency", "50ms"]
    assert tbf_args("1gbit")[4] == "500000"  # 4 ms of the rate: a fast link is not capped by its bucket
    for bad in ("fast", "20 furlongs", "0mbit"):
        with pytest.raises(ValueError):
            rate_bits(bad)
    with pytest.raises(ValueError):
        Hosts(["a", "a"])
    with pytest.raises(ValueError):
        Hosts(["a", "b-c"])  # "-" separates the prefix from the name
    with pytest.raises(ValueError):
        Hosts(["a"], rates={"z": "1mbit"})


@netns
@pytest.mark.slow
def test_hosts_reach_each_other_and_not_the_root_namespace():
    before = root_addrs()
    with Hosts(["a", "b", "c"]) as hosts:
        serve(hosts, "b")
        for src in ("a", "c"):
            reply = send(hosts, src, "b")
            assert reply is not None and (reply["echo"], reply["n"]) == ("ping", 4)
        assert root_addrs() == before  # nothing added in the root namespace
        subnet = hosts.addr("a").rsplit(".", 1)[0] + "."
        assert not any(addr.startswith(subnet) for _, addr in root_addrs())
        # This sandbox's gateway accepts any TCP connection, so "connect fails" proves nothing:
        # check instead that b's server never answers and b's link carries not one byte.
        counters = hosts.counters("b")
        assert root_reply(hosts.addr("b")) != b"ping4"
        assert hosts.counters("b") == counters
    assert root_addrs() == before


@netns
@pytest.mark.slow
def test_tbf_caps_both_directions_and_counters_count_the_bytes():
    nbytes, mbit = 2_500_000, 20
    ideal = nbytes * 8 / (mbit * 1e6)
    with Hosts({"a": f"{mbit}mbit", "b": None}) as hosts:
        serve(hosts, "b")
        rx0, tx0 = hosts.counters("a")
        shaped_egress = send(hosts, "a", "b", nbytes)  # capped by tbf on a's eth0
        rx1, tx1 = hosts.counters("a")
        assert shaped_egress["n"] == nbytes
        assert 0.8 * ideal <= shaped_egress["s"] < 3 * ideal, shaped_egress
        assert tx1 - tx0 >= nbytes and 0 < rx1 - rx0 < nbytes // 10  # a sent data and got acks
        assert hosts.counters("b")[0] >= nbytes

        hosts.set_rate("a", None)
        hosts.set_rate("b", f"{mbit}mbit")  # now capped on the bridge's port towards b
        shaped_ingress = send(hosts, "a", "b", nbytes)
        assert 0.8 * ideal <= shaped_ingress["s"] < 3 * ideal, shaped_ingress

        hosts.set_rate("b", None)
        unshaped = send(hosts, "a", "b", nbytes)
        assert unshaped["n"] == nbytes and unshaped["s"] < 0.5 * ideal, unshaped


@netns
@pytest.mark.slow
def test_link_down_cuts_a_host_off_and_link_up_restores_it():
    with Hosts(["a", "b"]) as hosts:
        serve(hosts, "b")
        assert send(hosts, "a", "b") is not None
        hosts.link_down("a")  # the sender's own link: no route at all
        assert send(hosts, "a", "b", timeout=1) is None
        hosts.link_up("a")
        assert send(hosts, "a", "b") is not None
        hosts.link_down("b")  # the receiver's link: the bridge has nowhere to deliver
        t0 = time.monotonic()
        assert send(hosts, "a", "b", timeout=1) is None
        assert time.monotonic() - t0 < 10
        hosts.link_up("b")
        assert send(hosts, "a", "b") is not None


@netns
@pytest.mark.slow
def test_exit_removes_namespaces_and_every_process_in_them():
    with Hosts(["a", "b"]) as hosts:
        # a child in the popen's group, one that left it with setsid, and one started without popen
        script = "sleep 300 & echo $!; setsid sleep 301 & echo $!; exec sleep 302"
        tracked = hosts.popen("a", ["sh", "-c", script], stdout=subprocess.PIPE, text=True)
        grandchildren = [int(tracked.stdout.readline()) for _ in range(2)]
        untracked = subprocess.Popen(hosts.prefix("b") + ["sleep", "303"])
        # inside b before the exit: `ip netns exec` holding b open but not yet in it would outlive b
        deadline = time.monotonic() + 10
        while str(untracked.pid) not in subprocess.run(["ip", "netns", "pids", hosts.ns("b")], capture_output=True,
                                                       text=True).stdout.split() and time.monotonic() < deadline:
            time.sleep(0.05)
        index = hosts.index
        assert len(harness_namespaces(index)) == 3 and all(map(alive, grandchildren))
    assert harness_namespaces(index) == []
    assert tracked.poll() is not None and untracked.wait(timeout=10) is not None
    deadline = time.monotonic() + 10
    while any(map(alive, grandchildren)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(alive, grandchildren))


@netns
@pytest.mark.slow
def test_cleanup_stale_removes_a_killed_run_and_spares_live_ones():
    killed_run = (
        "import os, signal, subprocess\n"
        "from tests.support.netns_hosts import Hosts\n"
        "h = Hosts(['a', 'b']).__enter__()\n"
        "h.popen('a', ['sleep', '300'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(h.index, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    with Hosts(["x"]) as live:
        r = subprocess.run([sys.executable, "-c", killed_run], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert r.returncode == -signal.SIGKILL, r.stderr
        dead = int(r.stdout)
        assert dead != live.index and len(harness_namespaces(dead)) == 3
        removed = cleanup_stale()
        assert sorted(harness_namespaces(dead)) == [] and set(removed) >= {f"vlc{dead}-a", f"vlc{dead}-b", f"vlc{dead}.sw"}
        assert len(harness_namespaces(live.index)) == 2
        with Hosts(["y"], subnet_index=dead) as reuse:  # the dead run's subnet is free again
            assert reuse.addr("y").endswith(".1")
        with pytest.raises(RuntimeError, match="in use"):
            Hosts(["y"], subnet_index=live.index).__enter__()


@netns
@pytest.mark.slow
def test_a_failed_setup_leaves_nothing_behind(monkeypatch):
    import tests.support.netns_hosts as nh

    real_sh = nh._sh

    def failing_sh(*cmd, check=True):  # the second host's link cannot join the bridge
        if "master" in cmd and "h1" in cmd:
            raise RuntimeError("injected failure")
        return real_sh(*cmd, check=check)

    monkeypatch.setattr(nh, "_sh", failing_sh)
    hosts = Hosts(["a", "b"])
    with pytest.raises(RuntimeError, match="injected"):
        hosts.__enter__()
    monkeypatch.undo()
    assert harness_namespaces(hosts.index) == []
    with Hosts(["z"], subnet_index=hosts.index):  # and its subnet is free again
        pass
