"""Can other nodes open connections to this one? A dial-back check over the run's own nodes.

Every node (coordinator and peers) serves ``DialBack.rpc_dial_back`` on its DHT's p2p daemon. A
peer that starts asks one or two nodes (the ones it joined through first): "dial me back". The
helper starts a fresh, throw-away p2p daemon (no listener, no relay, no NAT tricks: it can only
dial out), connects from it to the asking peer's peer id at the TCP ports the peer listed, on the
IP address the helper sees the peer's own connection come from, and answers whether the libp2p
handshake with that peer id succeeded. A new daemon means a new connection: the one the request
came over proves nothing about inbound reachability.

Everything a remote peer sends is bounded: at most ``MAX_ADDRS`` addresses of at most
``MAX_ADDR_BYTES`` each; only the IP address its connection comes from is ever dialed (a helper
cannot be made to scan a third party), only TCP ports, ``MAX_PROBES`` dials at once per helper, one
request per asker every ``MIN_INTERVAL_S``, each dial at most ``DIAL_TIMEOUT_S``. The asking side
gives up after ``CHECK_TIMEOUT_S`` and never stops the peer: the answer is advice, ``"unknown"``
when no helper answered. In a private run the request and answer carry the DHT's access tokens
(swarm/access/admission.py's ``JoinTokenAuthorizer``), so only nodes with the join token are served.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Dict, List, Optional, Sequence, Set, Tuple

import msgpack
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import dht_pb2
from hivemind.utils.auth import AuthRole, AuthRPCWrapper
from multiaddr import Multiaddr

from protocol.wire.bounded_unpack import bounded_unpack
from protocol.errors import ProtocolError

logger = logging.getLogger("voloco.reach")

MAX_ADDRS = 4  # addresses one request may list
MAX_ADDR_BYTES = 200  # the length of each, as bytes
MAX_ANSWER_BYTES = 1024
MAX_PROBES = 2  # dial-backs one node runs at once
QUEUE_WAIT_S = 3.0  # how long a request waits for a free probe before it is answered "busy"
MIN_INTERVAL_S = 10.0  # one request per asker this often
MAX_TRACKED = 4096  # askers remembered for the rate limit
DIAL_TIMEOUT_S = 5.0
CHECK_TIMEOUT_S = 20.0  # the asking side waits this long for each helper (a probe starts in 1-2 s)
CHECK_ATTEMPTS = 3  # a check nobody answered is asked again (a node that just started may be busy) ...
RETRY_PAUSE_S = MIN_INTERVAL_S + 5.0  # ... this long after, so a helper's rate limit has passed
PROBE_ARGS = dict(dht_mode="client", use_relay=False, use_auto_relay=False, auto_nat=False, nat_port_map=False,
                  no_listen=True, startup_timeout=10)

PUBLIC, CLIENT, UNKNOWN = "public", "client", "unknown"  # Peer.reach


class ReachError(ProtocolError):
    """A dial-back request or answer this node does not read."""


def tcp_endpoints(maddrs: Sequence[object]) -> List[Tuple[str, str, int]]:
    """(ip4|ip6, ip, port) of the direct TCP addresses among ``maddrs`` (relayed and DNS ones left out)."""
    out = []
    for m in maddrs:
        try:
            m = Multiaddr(str(m))
            names = [p.name for p in m.protocols()]
            if "p2p-circuit" in names or "tcp" not in names:
                continue
            proto = "ip4" if "ip4" in names else "ip6" if "ip6" in names else None
            if proto is None:
                continue
            out.append((proto, m.value_for_protocol(proto), int(m.value_for_protocol("tcp"))))
        except Exception:
            continue
    return out


# ---- the helper's side: serve dial-back requests ---------------------------------------------------
class DialBack(ServicerBase):
    """The dial-back handler, registered on a node's DHT daemon (it runs in the DHT's process)."""

    def __init__(self, p2p: P2P):
        self.p2p = p2p
        self._probes: Optional[asyncio.Semaphore] = None
        self._last: Dict[PeerID, float] = {}
        self._running: Set[asyncio.Task] = set()  # probes under way (a strong reference: tasks are weakly held)

    async def rpc_dial_back(self, request: dht_pb2.FindRequest, context: P2PContext) -> dht_pb2.FindResponse:
        """Dial the asker back from a fresh daemon; answer {"ok": bool|None, "addr", "seen", "why"}."""
        asker = context.remote_id
        try:
            answer = await self._answer(asker, list(request.keys))
        except ReachError as e:
            answer = {"ok": None, "why": str(e)[:200]}
        except Exception as e:  # never let a request take the handler down
            logger.debug(f"dial-back for {asker}: {e!r}")
            answer = {"ok": None, "why": type(e).__name__}
        blob = msgpack.packb(answer)
        return dht_pb2.FindResponse(results=[dht_pb2.FindResult(type=dht_pb2.FOUND_REGULAR, value=blob)])

    async def _answer(self, asker: PeerID, keys: List[bytes]) -> dict:
        if len(keys) > MAX_ADDRS or any(len(k) > MAX_ADDR_BYTES for k in keys):
            raise ReachError(f"at most {MAX_ADDRS} addresses of {MAX_ADDR_BYTES} bytes")
        now = time.monotonic()
        if now - self._last.get(asker, -1e9) < MIN_INTERVAL_S:
            raise ReachError("asked too soon after the last check")
        self._last[asker] = now
        if len(self._last) > MAX_TRACKED:
            for peer in sorted(self._last, key=self._last.get)[: len(self._last) // 2]:
                del self._last[peer]
        listed = tcp_endpoints(k.decode("utf-8", "replace") for k in keys)
        ports = sorted({port for _, _, port in listed if 0 < port < 65536})
        seen = await self._seen_from(asker)
        if not ports or not seen:
            return {"ok": None, "seen": seen[0][1] if seen else "", "why": "no direct TCP address to dial"}
        targets = [Multiaddr(f"/{proto}/{ip}/tcp/{port}") for proto, ip in seen[:2] for port in ports[:MAX_ADDRS]]
        if self._probes is None:
            self._probes = asyncio.Semaphore(MAX_PROBES)
        try:
            await asyncio.wait_for(self._probes.acquire(), QUEUE_WAIT_S)
        except asyncio.TimeoutError:
            raise ReachError("busy with other checks") from None
        # The probe runs as a task of its own that holds the permit until its daemon is gone: an asker
        # that cancels its call (hivemind cancels this handler) must neither leave a starting p2pd
        # behind (P2P.create does not clean up when cancelled) nor free the permit early.
        probe = asyncio.ensure_future(self._probe(asker, targets))
        self._running.add(probe)
        probe.add_done_callback(self._running.discard)
        ok, addr, error = await asyncio.shield(probe)
        return {"ok": ok, "addr": addr, "seen": seen[0][1], "why": dial_failure(error) if error else ""}

    async def _probe(self, asker: PeerID, targets: List[Multiaddr]) -> Tuple[Optional[bool], str, str]:
        try:
            return await dial(asker, targets, DIAL_TIMEOUT_S)
        except Exception as e:  # e.g. the probe daemon did not start: no verdict on the asker
            return None, "", f"the check failed here ({type(e).__name__})"
        finally:
            self._probes.release()

    async def _seen_from(self, asker: PeerID) -> List[Tuple[str, str]]:
        """(ip4|ip6, ip) of the connections ``asker`` has open to this node, as this node sees them."""
        seen: List[Tuple[str, str]] = []
        for info in await self.p2p.list_peers():
            if info.peer_id == asker:
                for proto, ip, _ in tcp_endpoints(info.addrs):
                    if (proto, ip) not in seen:
                        seen.append((proto, ip))
        return seen


def tcp_accepts(maddrs: Sequence[object], timeout: float = 3.0) -> bool:
    """Whether one of the direct TCP addresses among ``maddrs`` accepts a TCP connection within
    ``timeout``. The kernel completes a listener's handshake however busy the process behind it is, so
    an address whose libp2p dial timed out but that accepts here has a node there, too busy to finish
    libp2p's handshake in time (or some other program on that port); a firewall that drops the
    packets accepts nothing (tests/swarm/test_dht_errors.py)."""
    for _, ip, port in tcp_endpoints(maddrs):
        try:
            with socket.create_connection((ip, port), timeout=timeout):
                return True
        except OSError:
            continue
    return False


@lru_cache(maxsize=None)
def _probe_class(base: type) -> type:
    """``base`` (hivemind's P2P) whose output reader takes a start-up line that comes too late quietly."""

    class ProbeP2P(base):
        async def _read_outputs(self, ready: asyncio.Future) -> None:
            try:
                await super()._read_outputs(ready)
            except asyncio.InvalidStateError as e:  # ``ready`` was cancelled: the start had timed out
                logger.debug(f"a probe daemon that did not start in time spoke late: {e!r}")

    return ProbeP2P


async def start_probe_daemon(**options) -> P2P:
    """A throw-away p2p daemon (``PROBE_ARGS``, with ``options`` over them): a dial-back, a check that
    an identity is taken, a question to join nodes. On a loaded host it may start later than hivemind's
    ``startup_timeout``: hivemind then stops it and raises, but its output reader, which tells the
    start apart, outlives it and raises ``InvalidStateError`` when the daemon's late first line comes,
    an error nobody retrieves (asyncio would print its traceback in the log: a coordinator's, once,
    under 32 peers joining at once). A probe's reader takes that error and logs it at debug. (Taking the
    readers that outlived a failed start instead missed one that had already ended, its line having
    come while hivemind stopped the daemon: a peer's log, under 32 peers joining at once;
    tests/swarm/test_reachability.py.)"""
    return await _probe_class(P2P).create(**{**PROBE_ARGS, **options})


async def dial(peer: PeerID, targets: Sequence[Multiaddr], timeout: float) -> Tuple[bool, str, str]:
    """Connect to ``peer`` at ``targets`` from a new daemon: (ok, the address that worked, libp2p's error)."""
    probe = await start_probe_daemon()
    try:
        await asyncio.wait_for(probe._client.connect(peer, list(targets)), timeout)
        infos = [i for i in await probe.list_peers() if i.peer_id == peer]
        return True, str(infos[0].addrs[0]) if infos and infos[0].addrs else str(targets[0]), ""
    except asyncio.TimeoutError:
        return False, "", f"timeout: no answer in {timeout:.0f} s"
    except Exception as e:
        return False, "", str(e) or type(e).__name__
    finally:
        await probe.shutdown()


async def peer_answers(peer: PeerID, initial_peers: Sequence[Multiaddr], timeout: float = DIAL_TIMEOUT_S,
                       attempts: int = 2) -> bool:
    """Whether ``peer`` is in the swarm: a new daemon that joins through ``initial_peers`` finds and
    reaches it (what hivemind's ``P2P.is_identity_taken`` asks, for a key of any type). Asked twice, a
    second apart: a loaded daemon's first lookup can miss a peer it is connected to (an absent peer
    is "not found" in under a second)."""
    probe = await start_probe_daemon(initial_peers=[str(m) for m in initial_peers])
    try:
        for attempt in range(attempts):
            try:
                await asyncio.wait_for(probe._client.connect(peer, []), timeout)
                return True
            except Exception:  # not found, not reachable, or not in time
                if attempt + 1 < attempts:
                    await asyncio.sleep(1.0)
        return False
    finally:
        await probe.shutdown()


def dial_failure(text: str) -> str:
    """A libp2p dial error in a few words."""
    low = text.lower()
    if "peer id mismatch" in low:
        return "another peer id answered"
    if "connection refused" in low:
        return "connection refused"
    if "no route" in low or "unreachable" in low:
        return "no route to the address"
    if "timeout" in low or "deadline" in low:
        return "timed out"
    return text.strip().splitlines()[0][-160:] if text.strip() else "failed"


async def serve_dial_back(_dht, node) -> None:
    """``dht.run_coroutine(serve_dial_back)``: register the handler on the DHT's daemon (in its process)."""
    servicer = DialBack(node.p2p)
    authorizer = node.protocol.authorizer
    wrapper = AuthRPCWrapper(servicer, AuthRole.SERVICER, authorizer) if authorizer is not None else None
    await servicer.add_p2p_handlers(node.p2p, wrapper)


# ---- the asking side ----------------------------------------------------------------------------------
@dataclass
class Check:
    """What a reachability check found."""

    reach: str  # PUBLIC, CLIENT (nobody could dial it back) or UNKNOWN (no helper answered)
    answers: Dict[str, dict] = field(default_factory=dict)  # helper -> its answer
    addrs: List[str] = field(default_factory=list)  # the addresses this node asked to be dialed at

    @property
    def seen(self) -> str:
        return next((a.get("seen", "") for a in self.answers.values() if a.get("seen")), "")

    @property
    def answered(self) -> bool:
        """Whether a helper replied at all (a reply says where it saw this node from, if only "")."""
        return any("seen" in a for a in self.answers.values())

    @property
    def reason(self) -> str:
        return "; ".join(f"{h[-8:]}: {a.get('why') or ('ok' if a.get('ok') else '?')}" for h, a in self.answers.items())


async def _ask(helpers: Sequence[str], addrs: Optional[Sequence[str]], timeout: float, _dht,
               node) -> Tuple[List[str], Dict[str, dict]]:
    """In the DHT's process: ask each helper to dial this node back; (addresses sent, answers)."""
    if addrs is None:
        addrs = [str(m) for m in await asyncio.wait_for(node.p2p.get_visible_maddrs(latest=True), timeout)]
    sent = [a for a in addrs if tcp_endpoints([a])][:MAX_ADDRS]
    request = dht_pb2.FindRequest(keys=[a.encode()[:MAX_ADDR_BYTES] for a in sent])
    authorizer = node.protocol.authorizer

    async def one(helper: str) -> dict:
        stub = DialBack.get_stub(node.p2p, PeerID.from_base58(helper))
        if authorizer is not None:
            stub = AuthRPCWrapper(stub, AuthRole.CLIENT, authorizer)
        try:
            response = await asyncio.wait_for(stub.rpc_dial_back(request), timeout)
            if response is None or len(response.results) != 1 or len(response.results[0].value) > MAX_ANSWER_BYTES:
                raise ReachError("no valid answer")
            answer = bounded_unpack(response.results[0].value, ReachError, "a dial-back answer",
                                    max_array_len=8, max_map_len=8)
            if not isinstance(answer, dict) or answer.get("ok") not in (True, False, None):
                raise ReachError("no valid answer")
            return {"ok": answer["ok"], "addr": _printable(answer.get("addr")), "why": _printable(answer.get("why")),
                    "seen": _ip_or_empty(answer.get("seen"))}  # shown to the user: a helper may lie
        except asyncio.TimeoutError:
            return {"ok": None, "why": f"no answer in {timeout:.0f} s"}
        except Exception as e:
            return {"ok": None, "why": f"no answer ({type(e).__name__})"}

    results = await asyncio.gather(*(one(h) for h in helpers))
    return sent, dict(zip(helpers, results))


def _printable(value: object) -> str:
    return "".join(c for c in str(value or "")[:200] if c.isprintable())


def _ip_or_empty(value: object) -> str:
    try:
        return str(ipaddress.ip_address(str(value)))
    except ValueError:
        return ""


async def _routing_peers(_dht, node) -> List[str]:
    return [p.to_base58() for p in node.protocol.routing_table.peer_id_to_uid.keys()]


def pick_helpers(dht, first: Sequence[str], n: int = 2) -> List[str]:
    """Up to ``n`` nodes to ask: ``first`` (the nodes joined through), then others the DHT knows."""
    me = dht.peer_id.to_base58()
    out = [p for p in dict.fromkeys(first) if p != me][:n]
    if len(out) < n:
        try:
            out += [p for p in dht.run_coroutine(_routing_peers) if p != me and p not in out][: n - len(out)]
        except Exception as e:
            logger.debug(f"reachability: no routing table: {e!r}")
    return out


def check_reachability(dht, helpers: Sequence[str], addrs: Optional[Sequence[str]] = None,
                       timeout: float = CHECK_TIMEOUT_S) -> Check:
    """Ask ``helpers`` to dial this node back at ``addrs`` (default: its visible addresses).

    PUBLIC if one of them could, CLIENT if they answered and none could, UNKNOWN otherwise."""
    if not helpers:
        return Check(UNKNOWN)
    try:
        future = dht.run_coroutine(partial(_ask, list(helpers), list(addrs) if addrs is not None else None, timeout),
                                   return_future=True)
        sent, answers = future.result(2 * timeout + 5)  # the address lookup, then the helpers, each bounded
    except Exception as e:
        return Check(UNKNOWN, {h: {"ok": None, "why": f"check failed ({type(e).__name__})"} for h in helpers})
    oks = [a["ok"] for a in answers.values()]
    reach = PUBLIC if True in oks else CLIENT if False in oks else UNKNOWN
    return Check(reach, answers, sent)


def advice(check: Check, client_mode: bool, port: Optional[int]) -> Tuple[int, str]:
    """(log level, one message) that says what the check found and what to do."""
    where = ", ".join(check.addrs) or "its addresses"
    if check.reach == PUBLIC:
        worked = next(a.get("addr") for a in check.answers.values() if a.get("ok"))
        if client_mode:
            return logging.INFO, (f"reachability: other nodes can dial this peer at {worked}: --client-mode is not "
                                  f"needed (without it this peer can also lead groups and serve its state)")
        return logging.INFO, f"reachability: public: another node dialed this peer back at {worked}"
    if check.reach == UNKNOWN:
        return logging.INFO, (f"reachability: unknown: no node could check it ({check.reason or 'nobody to ask'}); "
                              f"if other peers cannot connect to this one, see 'Behind a home router' in the README")
    if client_mode:
        return logging.INFO, (f"reachability: as expected with --client-mode, other nodes cannot dial this peer "
                              f"({check.reason}); it still trains: it connects out to its groupmates")
    seen = check.seen or "<your public IP>"
    fixed = port if port else 31338
    return logging.WARNING, (
        f"reachability: other nodes could not dial this peer back at {where} ({check.reason}): it is behind a NAT "
        f"or a firewall. To accept connections, forward (or open) TCP port {fixed} to this machine and start with "
        f"--host-maddrs /ip4/0.0.0.0/tcp/{fixed} --announce-maddrs /ip4/{seen}/tcp/{fixed}"
        + ("" if port else " (a fixed port: tcp/0 picks a new one at every start)")
        + "; or restart with --client-mode (it connects out only, and still trains). Training goes on meanwhile; "
        "peers that cannot reach it may not group with it"
    )


def listen_port(host_maddrs: Sequence[str]) -> Optional[int]:
    """The fixed TCP port of ``--host-maddrs`` (None for tcp/0 or none)."""
    ports = [p for _, _, p in tcp_endpoints(host_maddrs) if p]
    return ports[0] if ports else None


def watch_reachability(owner, dht, join: Sequence[object], client_mode: bool, host_maddrs: Sequence[str],
                       attempts: int = CHECK_ATTEMPTS, pause: float = RETRY_PAUSE_S) -> threading.Thread:
    """Check in a background thread; set ``owner.reach`` and log what was found and what to do.

    ``join``: the multiaddrs this node joined through (their peer ids are asked first). A check that
    ends "unknown" (no helper answered: a node busy installing a state may miss the deadline) is
    asked again up to ``attempts`` times, ``pause`` s apart, and only the last verdict is logged
    (tests/swarm/test_reachability.py::test_an_unanswered_check_is_asked_again). Never raises."""
    owner.reach = CLIENT if client_mode else UNKNOWN

    def run() -> None:
        try:
            first = []
            for m in join:
                try:
                    first.append(Multiaddr(str(m)).value_for_protocol("p2p"))
                except Exception:
                    continue
            for attempt in range(max(1, attempts)):
                check = check_reachability(dht, pick_helpers(dht, first))
                if check.reach != UNKNOWN or check.answered or not check.answers or attempt + 1 >= attempts:
                    break  # a verdict, a reply without one (e.g. no TCP address to dial), or nobody to ask
                logger.debug(f"reachability: no answer yet ({check.reason}); asking again in {pause:.0f} s")
                time.sleep(pause)
            owner.reach = CLIENT if client_mode else check.reach
            level, message = advice(check, client_mode, listen_port(host_maddrs))
            logger.log(level, message)
        except Exception as e:  # advice only: never the peer's end
            logger.debug(f"reachability check failed: {e!r}")

    thread = threading.Thread(target=run, daemon=True, name="reachability")
    thread.start()
    return thread
