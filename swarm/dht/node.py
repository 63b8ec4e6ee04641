"""This process's hivemind DHT node: the addresses it joins and its start-up, with its identity,
its record validators and, in a private run, its authorizer; when it cannot start, one line that
names the cause and the fix (``explain_start_failure``: a port in use, an address that is not this
machine's, nothing or another peer id at the ``--join`` address, no usable p2pd, an identity in use,
a private run without its token)."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import re
import shutil
import time
from functools import partial
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import hivemind
from hivemind.p2p import PeerID
from multiaddr import Multiaddr

from protocol.dht.records import token_key
from swarm.access.admission import JoinTokenAuthorizer
from swarm.console import UsageError
from swarm.dht.channels import install_channels
from swarm.dht.depth_guard import guard_decoder, install_guard
from swarm.dht.find_bound import install_find_bound
from swarm.dht.store_quota import install_store_quota
from swarm.access.identity import Identity, NodeTrust, prepare_identity, register
from swarm.access.join_probe import MAX_ALTERNATES, PRIVATE, PUBLIC, TOKEN_BAD, TOKEN_OK, join_help, serve_run_access
from swarm.access.reachability import dial, dial_failure, peer_answers, serve_dial_back, tcp_accepts
from swarm.dht.rejoin import keep_joined
from swarm import persistent_reads, stream_frames
from swarm.open_files import raise_open_file_limit
from swarm.future_pipes import send_futures_lean
from swarm.dht.validators import node_validators

logger = logging.getLogger("voloco.swarm")

# A join node that answers but whose DHT does not reply in time (hivemind's 3 s per request) is most
# often an overloaded one: with 32 peers starting at once on a small machine, 3 tries 5 s apart can
# leave from one to 17 of them out for good, so the waits between tries double. A private
# run refuses a node without its token the same way, so after the first failure the node asks the
# join nodes which it is (swarm/access/join_probe.py): refused, it stops at once with the flag to fix; busy,
# it tries BUSY_JOIN_ATTEMPTS times (about 6 min: 75 s of tries is too short for 13 of 32 peers);
# with no answer, JOIN_ATTEMPTS times (an older node, or one too busy to answer even that); where a dial timed
# out but the address takes a TCP connection (``_JoinTimeout.listens``), BUSY_JOIN_ATTEMPTS, never endlessly. A peer
# (``keep_trying``) does not give up on a run that may admit it: it tries on, every MAX_JOIN_WAIT_S
# at most, saying so, and joins through the other nodes a busy join node hands out as well
# (swarm/access/join_probe.py), so a crowd started at once spreads over the swarm's live nodes.
# tests/swarm/test_join_probe.py and tests/swarm/test_dht_errors.py check the number of tries in each case.
JOIN_ATTEMPTS = 5
BUSY_JOIN_ATTEMPTS = 10
JOIN_RETRY_S = 5.0  # the first wait; 10, 20, 40 s after it
MAX_JOIN_WAIT_S = 60.0
CHECK_FAILED = "the check itself failed"  # a join node's dial that could not be made (not the node's answer)


def parse_multiaddrs(addrs: Sequence[str], flag: str = "--join") -> List[Multiaddr]:
    """Parse and check peer multiaddrs such as /ip4/1.2.3.4/tcp/31337/p2p/Qm..."""
    out = []
    for addr in addrs:
        try:
            maddr = Multiaddr(addr)
        except Exception as e:
            example = "/ip4/203.0.113.5/tcp/31337/p2p/QmPeerID" if flag == "--join" else "/ip4/0.0.0.0/tcp/31337"
            raise UsageError(f"{flag} {addr!r} is not a multiaddr ({e}); expected e.g. {example}") from None
        protocols = [p.name for p in maddr.protocols()]
        if "p2p-circuit" not in protocols and not {"tcp", "udp"} & set(protocols):
            example = "/ip4/203.0.113.5/tcp/31337/p2p/QmPeerID: copy the full address the coordinator printed" \
                if flag == "--join" else "/ip4/0.0.0.0/tcp/31337"
            raise UsageError(f"{flag} {addr!r} names no port; expected e.g. {example}")
        if flag == "--join" and "p2p" not in protocols:
            raise UsageError(f"{flag} {addr!r} has no /p2p/<peer id> part: copy the full address the coordinator printed")
        out.append(maddr)
    return out


def start_dht(
    initial_peers: Sequence[Multiaddr] = (),
    host_maddrs: Sequence[str] = ("/ip4/0.0.0.0/tcp/0",),
    announce_maddrs: Sequence[str] = (),
    identity_path: Optional[str] = None,
    client_mode: bool = False,
    *,
    join_token: Optional[str] = None,
    run_key: Optional[str] = None,
    run_ids: Sequence[str] = (),
    use_relay: bool = True,
    use_auto_relay: bool = False,
    keep_trying: bool = False,
    known: Sequence[Multiaddr] = (),
) -> hivemind.DHT:
    """Start this process's DHT node; UsageError naming the cause and the fix when it cannot start.

    The node's identity (``identity_path``, created if missing; a temporary one without it)
    gives its peer id and signs its records; every node validates records the same way
    (swarm/dht/validators.py, with the schemas of ``run_ids`` known from the start). With
    ``join_token``, the node speaks only to nodes that prove the same token (swarm/access/admission.py).
    ``run_key`` is the fingerprint ``fetch_spec`` will require of the run spec's signer.
    ``client_mode``: the node only connects out (hivemind's DHT client mode); ``use_relay`` and
    ``use_auto_relay`` are hivemind's circuit-relay options of its p2p daemon. Every node serves the
    reachability dial-back (swarm/access/reachability.py). ``keep_trying``: while the join nodes
    answer late and do not refuse this node, try on without a limit (a peer; see ``JOIN_ATTEMPTS``).
    ``known``: other nodes to join through as well once the join nodes answer late (the nodes this
    peer met before it last stopped: swarm/dht/known_nodes.py).
    """
    parse_multiaddrs(host_maddrs, "--host-maddrs")
    for addr in parse_multiaddrs(announce_maddrs, "--announce-maddrs"):
        if any(p.name in ("tcp", "udp") and addr.value_for_protocol(p.name) == "0" for p in addr.protocols()):
            raise UsageError(f"--announce-maddrs {str(addr)!r}: give the real port others connect to, not 0")
    key = token_key(join_token) if join_token is not None else None
    persistent_reads.install()  # before the DHT and averager processes fork: their p2p reads survive late answers
    raise_open_file_limit()  # and hold the streams other peers open within their bounds
    stream_frames.install()  # and read no stream message past a bound
    mine = _NodeIdentity(identity_path, *prepare_identity(identity_path))
    lock = _lock_identity(identity_path) if identity_path is not None else None
    try:
        _check_identity_free(mine, initial_peers)
        dht = _join(initial_peers, host_maddrs, announce_maddrs, mine, client_mode, key, run_ids, use_relay,
                    use_auto_relay, run_key, keep_trying, known)
    except BaseException:
        if lock is not None:
            lock.close()
        raise
    finally:
        if identity_path is None:  # the daemon has read its temporary identity
            shutil.rmtree(os.path.dirname(mine.path), ignore_errors=True)
    if lock is not None:  # held for the node's life: released when it shuts down
        stop = dht.shutdown

        def shutdown() -> None:
            try:
                stop()
            finally:
                lock.close()

        dht.shutdown = shutdown
    return dht


_HELD_IDENTITIES: Dict[str, Any] = {}  # identity file -> the open handle whose flock this process holds


def _drop_in_child() -> None:
    """A forked child holds no identity lock (an orphaned child of a killed peer would keep its
    restart out): its copies of the handles close, the parent's lock stays."""
    for handle in _HELD_IDENTITIES.values():
        try:
            os.close(handle.fileno())
        except OSError:
            pass
    _HELD_IDENTITIES.clear()


os.register_at_fork(after_in_child=_drop_in_child)


class _IdentityLock:
    """The flock on an identity file, held by this process for as long as its node runs."""

    def __init__(self, path: str, handle):
        self.path, self.handle = path, handle

    def close(self) -> None:
        if _HELD_IDENTITIES.get(self.path) is self.handle:
            del _HELD_IDENTITIES[self.path]
        try:
            self.handle.close()  # releases the lock
        except OSError:  # a forked child's copy, closed at the fork
            pass


class _NodeIdentity(NamedTuple):
    given: Optional[str]  # the --identity file, None for a temporary identity
    identity: Identity
    path: str  # the file the daemon reads
    created: bool  # made by this start: nobody else's


def _lock_identity(identity_path: str) -> _IdentityLock:
    """A lock on ``identity_path`` held for the node's life; UsageError if another node of this
    machine holds it. hivemind's own check asks the swarm whether the peer id answers, which a node
    that joined a moment ago, or a loaded bootstrap node, does not yet: two peers of one machine
    started with one --identity file were both let in."""
    real = os.path.realpath(identity_path)
    handle = open(identity_path, "rb")
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise UsageError(explain_start_failure(RuntimeError("already taken by another peer"), (), (), False,
                                               identity_path)) from None
    _HELD_IDENTITIES[real] = handle
    return _IdentityLock(real, handle)


def _check_identity_free(mine: "_NodeIdentity", initial_peers: Sequence[Multiaddr]) -> None:
    """UsageError if a node elsewhere in the swarm already runs with this --identity (a key made just now
    is nobody else's, and a temporary one is never given twice)."""
    if mine.given is None or mine.created or not initial_peers:
        return
    try:
        taken = asyncio.run(peer_answers(PeerID.from_base58(mine.identity.peer_id), initial_peers))
    except Exception as e:  # the check is advice: a daemon that cannot start here fails the start below anyway
        logger.debug(f"could not check whether {mine.identity.peer_id} is in use: {e!r}")
        return
    if taken:
        raise UsageError(explain_start_failure(RuntimeError("already taken by another peer"), (), (), False, mine.given))


def _join(initial_peers, host_maddrs, announce_maddrs, mine: _NodeIdentity, client_mode, key, run_ids, use_relay,
          use_auto_relay, run_key, keep_trying: bool = False, known: Sequence[Multiaddr] = ()) -> hivemind.DHT:
    """Start the node, trying the join again while the DHT answers late; then its services."""
    t0 = time.monotonic()
    attempts, access, attempt, reached = JOIN_ATTEMPTS, None, 0, False
    handed: List[Multiaddr] = []  # the nodes the join nodes named lately
    alternates: List[Multiaddr] = []  # those and the nodes this peer remembers: joined through too
    while True:
        attempt += 1
        joining = list({str(m): m for m in list(initial_peers) + alternates}.values())
        try:
            dht = _start_node(joining, host_maddrs, announce_maddrs, mine, client_mode, key, run_ids, use_relay,
                              use_auto_relay)
            break
        except _JoinTimeout as e:
            if access is None or keep_trying:  # asked again while it may admit us: fresh nodes to join through
                verdict, found, answered = join_help(initial_peers, key)
                access = verdict if verdict is not None else access
                handed, reached = found or handed, reached or answered or e.answered
                alternates = handed + list(known[:MAX_ALTERNATES])
                if access in (PRIVATE, TOKEN_BAD) or (key is not None and access in (PUBLIC, None) and not keep_trying):
                    raise UsageError(_refused(e.cause, access, initial_peers, host_maddrs, key, mine)) from None
                if access is not None or e.listens:  # PUBLIC without a token, TOKEN_OK, a port that answers: busy
                    attempts = BUSY_JOIN_ATTEMPTS
            # on and on only while a join node is there (it took the probe's connection) and may admit us
            endless = (keep_trying and reached and access not in (PRIVATE, TOKEN_BAD)
                       and not (key is not None and access == PUBLIC))
            if attempt >= attempts and not endless:
                why = (f"could not reach the DHT at {_addr_list(initial_peers)}: it is too busy to answer this node"
                       + ("" if access is not None or e.answered else " (its port takes connections; unless another "
                          "program listens there: check the port the coordinator printed)")
                       if access is not None or e.answered or e.listens else
                       explain_start_failure(e.cause, initial_peers, host_maddrs, key is not None, mine.given))
                raise UsageError(f"{why} (or it was too busy to answer {attempts} tries over "
                                 f"{time.monotonic() - t0:.0f} s: try again later)") from None
            wait = min(JOIN_RETRY_S * 2 ** (attempt - 1), MAX_JOIN_WAIT_S)
            said = {PUBLIC: " (the run is public: the node is busy)",
                    TOKEN_OK: " (it accepts this join token: the node is busy)"}.get(access, "")
            through = f", and through {len(alternates)} other node(s) it named," if alternates else ""
            count = f"attempt {attempt}, {time.monotonic() - t0:.0f} s so far; Ctrl+C to stop" if endless else \
                f"attempt {attempt} of {attempts}"
            logger.warning(f"the DHT at {_addr_list(initial_peers)} did not answer this node in time{said} ({count}; an "
                           f"overloaded node answers late): trying again{through} in {wait:.0f} s")
            time.sleep(wait)
    register(dht, NodeTrust(mine.identity, token_key=key, run_key=run_key))
    try:
        dht.run_coroutine(partial(serve_run_access, key))
    except Exception as e:  # advice for joiners, never a reason not to start
        logger.warning(f"could not serve run-access questions: {e!r}")
    try:
        dht.run_coroutine(install_channels)
    except Exception as e:  # the node's calls stay unary, as hivemind makes them
        logger.warning(f"could not open DHT channels: {e!r}")
    try:
        dht.run_coroutine(serve_dial_back)
    except Exception as e:  # advice for others, never a reason not to start
        logger.warning(f"could not serve reachability checks: {e!r}")
    keep_joined(dht, initial_peers)  # a restarted coordinator, a host back online: find the swarm again
    return dht


# hivemind's DHTNode caching that the run's records do without. After every read, ``cache_nearest``
# stores the whole dictionary it found (every peer's progress record, ~1.2 KB each) at the nearest
# node that lacked it, which checks every record's signature and schema again: at 32 peers half
# of a peer's DHT process was these stores (py-spy, in a start-quorum wait with nothing else to do).
# ``cache_refresh_before_expiry`` re-reads a cached key before it expires in the background: the
# run's readers read the records they need themselves (``latest``, merging every node's copy).
NODE_CACHING = dict(cache_nearest=0, cache_refresh_before_expiry=0)


class _JoinTimeout(Exception):
    """The join nodes answer, but their DHT did not in time, or took a check's connection after the
    daemon's dial timed out (``answered``): worth another try."""

    def __init__(self, cause: BaseException, answered: bool = False, listens: bool = False):
        super().__init__(str(cause))
        self.cause = cause
        self.answered = answered  # a join node took a connection of ours meanwhile: it is there, and busy
        # its address took a TCP connection, libp2p's did not finish: tried as a busy node, but not endlessly
        # (another program may listen on that port)
        self.listens = listens


def _start_node(initial_peers, host_maddrs, announce_maddrs, mine: _NodeIdentity, client_mode, key, run_ids,
                use_relay, use_auto_relay) -> hivemind.DHT:
    """One attempt at starting the node; UsageError, or _JoinTimeout to try again."""
    guard_decoder()  # a DHT process forked from here decodes nothing nested past MAX_DEPTH
    install_store_quota()  # and keeps what other peers store within a bound, shared among them
    install_find_bound()  # and answers a find within a bound of work and bytes
    try:
        dht = hivemind.DHT(
            start=True,
            initial_peers=[str(m) for m in initial_peers],
            host_maddrs=list(host_maddrs),
            announce_maddrs=list(announce_maddrs) or None,
            identity_path=mine.path,
            check_if_identity_free=False,  # start_dht asks itself: hivemind's check reads RSA identity files only
            client_mode=client_mode,
            record_validators=node_validators(mine.identity, key, run_ids),
            authorizer=JoinTokenAuthorizer(mine.identity, key) if key is not None else None,
            startup_timeout=30,
            use_relay=use_relay,
            use_auto_relay=use_auto_relay,
            **NODE_CACHING,
        )
    except Exception as e:
        if initial_peers and "none of the initial_peers responded" in str(e).lower():
            raise _JoinTimeout(e) from None
        # the daemon's dial timed out, yet a join node takes a connection now: a busy node, as above (32 peers
        # started at once on 2 cores: two of them exited here, bench/RESULTS.md 2026-12-03). One dial a join
        # node (a fresh p2pd each), whose results also explain a failure
        dialed = dial_join_nodes(initial_peers) if initial_peers and "failed to connect to bootstrap peers" in str(e).lower() else None
        if dialed is not None and any(ok for ok, _ in dialed):
            raise _JoinTimeout(e, answered=True) from None
        # a dial that timed out where that address takes a TCP connection: something listens there, likely the
        # node, too busy for libp2p's handshake (5 of 32 peers started at once exited so, bench/RESULTS.md 2026-12-03)
        timed_out = [m for m, (_, error) in zip(initial_peers, dialed or ()) if dial_failure(error) == "timed out"]
        # no dial could be made from here (this host too loaded to start the check's daemon in time: 4 of 32
        # peers started at once on 2 cores exited so, bench/RESULTS.md 2026-12-06): no verdict on the join
        # nodes, so tried again, as a busy node's where their ports take a TCP connection
        unchecked = bool(dialed) and all(not ok and error.startswith(CHECK_FAILED) for ok, error in dialed)
        if (timed_out or unchecked) and tcp_accepts(timed_out or list(initial_peers)):
            raise _JoinTimeout(e, listens=True) from None
        if unchecked:
            raise _JoinTimeout(e) from None
        raise UsageError(explain_start_failure(e, initial_peers, host_maddrs, key is not None, mine.given, dialed)) from None
    if dht.peer_id.to_base58() != mine.identity.peer_id:
        dht.shutdown()
        raise RuntimeError(f"the DHT node's peer id {dht.peer_id} is not that of its identity {mine.identity.peer_id}")
    send_futures_lean(dht._outer_pipe)  # each caller's result pipe reaches the DHT process once
    dht.run_coroutine(install_guard)  # (a DHT process that was not forked from this one)
    return dht


def _refused(cause: BaseException, access: Optional[str], initial_peers, host_maddrs, key, mine) -> str:
    """Why a private run's join nodes refused this node, from what they said (``access``)."""
    if access == PRIVATE:
        return (f"could not reach the DHT at {_addr_list(initial_peers)}: the run is private: start with its "
                f"--join-token or --join-token-file (ask whoever runs its coordinator)")
    if access == PUBLIC:  # this node's authorizer refuses a run's nodes that prove no token
        return (f"could not join the DHT at {_addr_list(initial_peers)}: the run is public and takes no join token: "
                f"start without --join-token / --join-token-file")
    return explain_start_failure(cause, initial_peers, host_maddrs, key is not None, mine.given)


# ---- why a node could not start ------------------------------------------------------------------
def explain_start_failure(e: BaseException, initial_peers: Sequence[Multiaddr], host_maddrs: Sequence[str],
                          private: bool, identity_path: Optional[str], dialed: Optional[List[Tuple[bool, str]]] = None) -> str:
    """One line for hivemind's start-up failure ``e``: the cause, and what to do about it. ``dialed``: the
    join nodes' ``dial_join_nodes`` results where already taken (else dialed here, where needed)."""
    text = str(e).strip()
    low = text.lower()
    last = text.splitlines()[-1] if text else type(e).__name__
    hosts = " ".join(host_maddrs)
    if "address already in use" in low:
        port = _port_in(text)
        return (f"--host-maddrs {hosts}: {'port ' + port if port else 'the port'} is in use by another program (another "
                f"voloco node?): stop it, or listen on another port (tcp/0 picks a free one)")
    if "cannot assign requested address" in low:
        return (f"--host-maddrs {hosts}: this machine has no such address to listen on: listen on "
                f"/ip4/0.0.0.0/tcp/PORT (every interface) and put the address others reach you at in --announce-maddrs")
    if "failed to parse multiaddr" in low or "failed to listen" in low:
        return f"--host-maddrs {hosts}: cannot listen there ({_daemon_said(last)}); expected e.g. /ip4/0.0.0.0/tcp/31337"
    if "p2pd binary" in low or "exec format" in low or "failed to start p2pd" in low:
        return (f"hivemind's p2p daemon (p2pd) cannot run ({_daemon_said(last)}): reinstall hivemind "
                f"(pip install --force-reinstall --no-deps hivemind) or make its hivemind_cli/p2pd executable")
    if "already taken by another peer" in low:
        return (f"--identity {identity_path}: another running node already uses this identity (the same peer id is in "
                f"the swarm): stop that process, or give this one its own --identity file")
    if "failed to connect to bootstrap peers" in low and initial_peers:
        return "could not reach the DHT: " + "; ".join(diagnose_join(initial_peers, dialed=dialed))
    if "none of the initial_peers responded" in low and initial_peers:
        if private:
            return (f"could not reach the DHT at {_addr_list(initial_peers)}: it answers, but not to this join token: "
                    f"check that --join-token is the one the run's coordinator was started with (a public run takes none)")
        return (f"could not reach the DHT at {_addr_list(initial_peers)}: it answers, but its DHT does not: the run "
                f"is private (start with its --join-token or --join-token-file), or the address is a --client-mode "
                f"peer's (join through the coordinator or another peer)")
    if initial_peers:
        return (f"could not reach the DHT at {_addr_list(initial_peers)} ({last}): check that the coordinator is "
                f"running and that the address, port and peer id match what it printed")
    return f"could not start a DHT node on {hosts} ({last})"


def _peer_and_host(maddr: Multiaddr) -> Tuple[str, str]:
    """A ``--join`` address's peer id and the address without it (what is dialed)."""
    peer = maddr.value_for_protocol("p2p")
    return peer, str(maddr.decapsulate(Multiaddr(f"/p2p/{peer}")))


def dial_join_nodes(initial_peers: Sequence[Multiaddr], timeout: float = 5.0) -> List[Tuple[bool, str]]:
    """Dial each ``--join`` address from a fresh daemon (bounded by ``timeout``): (whether it took the
    connection, the dial's error), in order."""

    async def one(maddr: Multiaddr) -> Tuple[bool, str]:
        peer, where = _peer_and_host(maddr)
        try:
            ok, _, error = await dial(PeerID.from_base58(peer), [Multiaddr(where)], timeout)
        except Exception as e:
            ok, error = False, f"{CHECK_FAILED}: {e!r}"
        return bool(ok), error

    async def all_of() -> List[Tuple[bool, str]]:
        return list(await asyncio.gather(*(one(m) for m in initial_peers)))

    try:
        return asyncio.run(asyncio.wait_for(all_of(), timeout + 15))
    except Exception as e:
        return [(False, f"{CHECK_FAILED}: {e!r}")] * len(initial_peers)


def diagnose_join(initial_peers: Sequence[Multiaddr], timeout: float = 5.0,
                  dialed: Optional[List[Tuple[bool, str]]] = None) -> List[str]:
    """Why each ``--join`` address failed, found by dialing it from a fresh daemon (bounded by ``timeout``;
    ``dialed``: those dials' results, where already taken)."""

    def one(maddr: Multiaddr, ok: bool, error: str) -> str:
        peer, where = _peer_and_host(maddr)
        if ok:
            return f"{maddr}: it answers now (it may have just started): try again"
        m = re.search(r"remote key matches (\w+)", error)
        if m:
            return (f"{maddr}: the node at {where} has peer id {m.group(1)}, not {peer}: copy the whole address the "
                    f"coordinator printed (its peer id changes at every start without --identity)")
        why = dial_failure(error)
        if why == "connection refused":
            return f"{maddr}: nothing listens at {where}: is the coordinator running, and is the port right?"
        if why in ("timed out", "no route to the address"):
            return (f"{maddr}: {where} does not answer ({why}): check the IP address, and that no firewall or router "
                    f"blocks that TCP port on the coordinator's side")
        return f"{maddr}: {why}"

    dialed = dialed if dialed is not None else dial_join_nodes(initial_peers, timeout)
    if dialed and all(not ok and error.startswith(CHECK_FAILED) for ok, error in dialed):  # no dial could be made here
        return [f"{_addr_list(initial_peers)} ({dialed[0][1]}): check that the coordinator is running, that "
                f"the address, port and peer id match what it printed, and that no firewall blocks the port"]
    return [one(m, ok, error) for m, (ok, error) in zip(initial_peers, dialed)]


def _addr_list(maddrs: Sequence[Multiaddr]) -> str:
    return ", ".join(map(str, maddrs))


def _port_in(text: str) -> str:
    m = re.search(r"listen tcp\d?\s+[^\s]*:(\d+): bind", text)
    return m.group(1) if m else ""


def _daemon_said(line: str) -> str:
    """p2pd's message without its 'Daemon failed to start: <date> <time>' prefix."""
    return re.sub(r"^.*?failed to start:\s*(\d{4}/\d\d/\d\d \d\d:\d\d:\d\d\s*)?", "", line, flags=re.I).strip() or line
