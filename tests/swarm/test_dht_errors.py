"""Start-up failures of a DHT node, provoked for real where feasible: each is one UsageError that
names the cause and the fix (swarm/dht/node.py), and the command line prints it without a traceback."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from multiaddr import Multiaddr

import hivemind.p2p.p2p_daemon as p2p_daemon
from swarm.console import UsageError
from swarm.dht.node import start_dht

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
OTHER_ID = "QmXjP5fwkdJ9UytA8Zs8SYzqfg3Wzo5yz88RoE6Nxc3U5W"
REPO = Path(__file__).resolve().parents[2]
P2PD_LOG = re.compile(r"^[A-Z][a-z]{2} +\d+ \d\d:\d\d:\d\d\.\d+ \[[A-Z]+\] \[[\w/.-]+\.go:\d+\]")  # go-log's line prefix


def fails(*args, **kwargs) -> str:
    with pytest.raises(UsageError) as info:
        start_dht(*args, **kwargs).shutdown()
    return str(info.value)


@pytest.fixture(scope="module")
def node():
    dht = start_dht((), LOOPBACK)
    yield dht, dht.get_visible_maddrs()[0]
    dht.shutdown()


def test_a_port_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        message = fails((), [f"/ip4/127.0.0.1/tcp/{port}"])
    assert f"port {port} is in use" in message and "another port" in message


def test_bad_host_and_announce_addresses():
    assert "this machine has no such address" in fails((), ["/ip4/192.0.2.77/tcp/0"])  # TEST-NET: never ours
    assert "is not a multiaddr" in fails((), ["/ip4/1.2.3/tcp/0"])
    assert "names no port" in fails((), ["/ip4/127.0.0.1"])
    assert "not 0" in fails((), LOOPBACK, ["/ip4/203.0.113.5/tcp/0"])


def test_an_unreachable_join_address(node):
    _, addr = node
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    peer = addr.value_for_protocol("p2p")
    message = fails([Multiaddr(f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer}")], LOOPBACK)
    assert f"nothing listens at /ip4/127.0.0.1/tcp/{port}" in message and "coordinator running" in message


def test_a_wrong_peer_id_in_the_join_address(node):
    _, addr = node
    right = addr.value_for_protocol("p2p")
    wrong = Multiaddr(str(addr).replace(right, OTHER_ID))
    message = fails([wrong], LOOPBACK)
    assert f"has peer id {right}, not {OTHER_ID}" in message and "copy the whole address" in message


def test_a_private_run_without_or_with_another_token():
    run = start_dht((), LOOPBACK, join_token="r" * 24)
    try:
        addr = run.get_visible_maddrs()[0]
        assert "the run is private: start with its --join-token" in fails([addr], LOOPBACK)
        assert "check that --join-token is the one" in fails([addr], LOOPBACK, join_token="x" * 24)
    finally:
        run.shutdown()


def test_a_token_for_a_public_run(node):
    _, addr = node
    assert "the run is public and takes no join token" in fails([addr], LOOPBACK, join_token="x" * 24)


def test_an_identity_file_in_use_by_another_node(tmp_path):
    run = start_dht((), LOOPBACK)
    addr, identity = run.get_visible_maddrs()[0], str(tmp_path / "id.key")
    first = start_dht([addr], LOOPBACK, identity_path=identity)
    try:
        message = fails([addr], LOOPBACK, identity_path=identity)
        assert "another running node already uses this identity" in message and "--identity" in message
    finally:
        first.shutdown()
        run.shutdown()


@pytest.mark.parametrize("kind", ["ed25519", "rsa"])
def test_a_copy_of_an_identity_file_in_use_elsewhere_in_the_swarm(tmp_path, kind):
    """A copy of the file (another machine's, so no lock is shared): the swarm is asked whether the
    peer id answers, for Ed25519 identities (which hivemind's own check cannot read) and RSA ones."""
    import shutil

    from hivemind.p2p import P2P

    run = start_dht((), LOOPBACK)
    addr, identity, copy = run.get_visible_maddrs()[0], str(tmp_path / "id.key"), str(tmp_path / "copy.key")
    if kind == "rsa":
        P2P.generate_identity(identity)
    first = start_dht([addr], LOOPBACK, identity_path=identity)
    shutil.copy(identity, copy)
    try:
        message = fails([addr], LOOPBACK, identity_path=copy)
        assert "another running node already uses this identity" in message and copy in message
    finally:
        first.shutdown()
        run.shutdown()


def test_an_identity_file_held_by_a_node_of_this_machine_even_without_a_swarm_to_ask(tmp_path):
    """hivemind's check asks the swarm (none here, and a loaded one may not know the first node
    yet); the file's lock says it at once, and frees it when that node shuts down."""
    identity = str(tmp_path / "id.key")
    first = start_dht((), LOOPBACK, identity_path=identity)
    try:
        message = fails((), LOOPBACK, identity_path=identity)
        assert "another running node already uses this identity" in message and "--identity" in message
    finally:
        first.shutdown()
    again = start_dht((), LOOPBACK, identity_path=identity)  # the file is free again
    again.shutdown()


def test_p2pd_missing_or_not_executable(monkeypatch, tmp_path):
    monkeypatch.setattr(p2p_daemon, "P2PD_FILENAME", "p2pd-not-installed")  # the DHT process is forked: it sees this
    assert "p2p daemon (p2pd) cannot run" in (message := fails((), LOOPBACK)) and "reinstall hivemind" in message
    stub = tmp_path / "p2pd"
    stub.write_text("not a program\n")
    stub.chmod(0o644)

    @contextlib.contextmanager
    def here(_package, _name):
        yield stub

    monkeypatch.setattr(p2p_daemon, "path", here)
    message = fails((), LOOPBACK)
    assert "p2p daemon (p2pd) cannot run" in message and "executable" in message


def test_the_command_line_prints_one_line_and_no_traceback():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "voloco", "coordinator", "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}"],
                           capture_output=True, text=True, timeout=120, cwd=REPO, stdin=subprocess.DEVNULL,
                           env={**os.environ, "VOLOCO_SETTINGS": ""})
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and f"port {port} is in use" in r.stderr
    # hivemind's p2pd writes its own log to the same stderr as it shuts down ("Nov 30 03:46:15.999 [ERROR]
    # [swarm/swarm_listen.go:132] ... listener closed"), sometimes after our line: not voloco's output
    ours = [ln for ln in r.stderr.splitlines() if ln.strip() and not P2PD_LOG.match(ln)]
    assert [ln for ln in ours if "error:" in ln] == ours[-1:]


def test_a_join_node_too_busy_to_answer_is_tried_again(monkeypatch, caplog):
    import swarm.dht.node as dht_mod

    attempts = []

    class Busy:  # hivemind's DHT when the join node answers but its DHT replies too late
        def __init__(self, **kwargs):
            attempts.append(kwargs["initial_peers"])
            raise RuntimeError("DHTNode bootstrap failed: none of the initial_peers responded to a ping.")

    monkeypatch.setattr(dht_mod.hivemind, "DHT", Busy)
    monkeypatch.setattr(dht_mod, "JOIN_RETRY_S", 0.0)
    addr = Multiaddr(f"/ip4/127.0.0.1/tcp/1/p2p/{OTHER_ID}")
    with caplog.at_level("WARNING", logger="voloco.swarm"):
        message = fails([addr], LOOPBACK)
    assert len(attempts) == dht_mod.JOIN_ATTEMPTS == 5
    assert "it answers, but its DHT does not" in message and "too busy to answer 5 tries" in message
    assert "attempt 1 of 5" in caplog.text and "attempt 4 of 5" in caplog.text
    attempts.clear()  # with a join token the likely cause is the token: said at once, not retried
    assert "check that --join-token is the one" in fails([addr], LOOPBACK, join_token="x" * 24)
    assert len(attempts) == 1


def test_a_join_node_whose_dial_timed_out_but_that_answers_now_is_tried_again(monkeypatch):
    import swarm.dht.node as dht_mod

    attempts = []

    class DialTimedOut:  # the daemon's dial of a busy join node timed out (32 peers started at once on 2 cores)
        def __init__(self, **kwargs):
            attempts.append(kwargs["initial_peers"])
            raise RuntimeError("Daemon failed to start: failed to connect to bootstrap peers")

    monkeypatch.setattr(dht_mod.hivemind, "DHT", DialTimedOut)
    monkeypatch.setattr(dht_mod, "JOIN_RETRY_S", 0.0)
    monkeypatch.setattr(dht_mod, "join_help", lambda peers, key: (None, [], False))
    addr = Multiaddr(f"/ip4/127.0.0.1/tcp/1/p2p/{OTHER_ID}")
    dials = []

    def dial(result):
        def dial_join_nodes(peers, timeout=5.0):
            dials.append(peers)
            return [result] * len(peers)
        return dial_join_nodes

    monkeypatch.setattr(dht_mod, "dial_join_nodes", dial((True, "")))
    assert "it is too busy to answer this node" in fails([addr], LOOPBACK)
    assert len(attempts) == len(dials) == dht_mod.JOIN_ATTEMPTS  # busy: tried again, as a join node whose DHT answers late
    attempts.clear(), dials.clear()
    monkeypatch.setattr(dht_mod, "dial_join_nodes", dial((False, "connection refused")))
    assert "nothing listens at" in fails([addr], LOOPBACK)
    assert len(attempts) == len(dials) == 1  # nobody there: said at once, from the one dial
    attempts.clear()
    # no dial could be made here (this host too loaded to start the check's daemon): no verdict on the join node,
    # so tried again; the explanation comes once the tries are spent
    monkeypatch.setattr(dht_mod, "dial_join_nodes", dial((False, f"{dht_mod.CHECK_FAILED}: TimeoutError()")))
    attempts.clear()
    assert "check that the coordinator is running" in fails([addr], LOOPBACK)
    assert len(attempts) == dht_mod.JOIN_ATTEMPTS
    # a dial that timed out, where the address takes a TCP connection: a node too busy for libp2p's handshake
    # (5 of 32 peers started at once on 2 cores exited so); where nothing takes one, said at once
    monkeypatch.setattr(dht_mod, "dial_join_nodes", dial((False, "timeout: no answer in 5 s")))
    with socket.create_server(("127.0.0.1", 0)) as listener:  # the kernel completes the handshake; nobody accepts
        busy = Multiaddr(f"/ip4/127.0.0.1/tcp/{listener.getsockname()[1]}/p2p/{OTHER_ID}")
        attempts.clear()
        said = fails([busy], LOOPBACK)
        assert "it is too busy to answer this node" in said and "another program listens there" in said
        assert len(attempts) == dht_mod.BUSY_JOIN_ATTEMPTS  # as a busy node's, and not endlessly (no libp2p answer)
        # where the check's own daemon did not start, a port that takes a TCP connection is a busy node's too
        monkeypatch.setattr(dht_mod, "dial_join_nodes", dial((False, f"{dht_mod.CHECK_FAILED}: P2PDaemonError()")))
        attempts.clear()
        assert "it is too busy to answer this node" in fails([busy], LOOPBACK)
        assert len(attempts) == dht_mod.BUSY_JOIN_ATTEMPTS
        monkeypatch.setattr(dht_mod, "dial_join_nodes", dial((False, "timeout: no answer in 5 s")))
        # only the addresses whose dial timed out are asked: a closed port that timed out beside a listening port
        # whose dial was refused for another reason is no busy node
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            gone = Multiaddr(f"/ip4/127.0.0.1/tcp/{closed.getsockname()[1]}/p2p/{OTHER_ID}")
        monkeypatch.setattr(dht_mod, "dial_join_nodes", lambda peers, timeout=5.0: [
            (False, "timeout: no answer in 5 s") if p == gone else (False, "peer id mismatch: remote key matches X")
            for p in peers])
        attempts.clear()
        fails([gone, busy], LOOPBACK)
        assert len(attempts) == 1
        monkeypatch.setattr(dht_mod, "dial_join_nodes", dial((False, "timeout: no answer in 5 s")))
    attempts.clear()
    assert "does not answer (timed out)" in fails([busy], LOOPBACK)  # the port is closed now
    assert len(attempts) == 1
