"""Busy or refusing? What a joining node asks when the DHT behind ``--join`` answers its
bootstrap too late.

A join node whose DHT does not answer a new node in time is either overloaded (a public run's
coordinator while 32 peers start at once on a small machine) or refusing it: in a private run the
DHT answers no request without a valid access token (swarm/access/admission.py), and the refusal looks
the same from outside. The two call for opposite things: try again for longer, or stop at once and
say which flag to fix. So every voloco node serves ``RunAccess.rpc_run_access`` on its DHT's p2p
daemon *without* the DHT's authorizer, and a node whose bootstrap failed asks its join nodes, from
a throw-away daemon of its own (swarm/access/reachability.py's ``PROBE_ARGS``), whether the run is private
and whether its token is the run's.

The asker proves its token with an HMAC keyed by the token over the probe daemon's peer id; the
node recomputes it for the peer id its stream comes from, so a proof seen on the wire proves
nothing from any other peer id, and the answer tells a node without the token nothing about it.

A busy node also hands an asker it would admit (a public run, or the right token) the addresses of
up to ``MAX_ALTERNATES`` other nodes it is connected to (``alternates``): the asker's next try
joins through them too, so the joins of a crowd that all named the same node spread over the
swarm's live nodes instead of queueing at one.

The answer is advice for the asker's own retry loop: a lying node can make a peer wait longer or
give up sooner, or name nodes that do not answer (a join needs one that does, and every node
checks every record), never let it into a run. Everything crossing the wire is bounded: one proof
of ``MAC_BYTES`` in, ``MAX_ANSWER_BYTES`` out. Guarded by tests/swarm/test_join_probe.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from typing import Awaitable, Callable, List, NamedTuple, Optional, Sequence, Tuple

import msgpack
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import dht_pb2
from multiaddr import Multiaddr

from protocol.wire.bounded_unpack import bounded_unpack
from protocol.errors import ProtocolError
from protocol.dht.records import MAC_BYTES, proof_ok
from swarm.access.reachability import start_probe_daemon  # throw-away daemons, started one way
from swarm.dht.known_nodes import connected_nodes

logger = logging.getLogger("voloco.swarm")

MAX_ALTERNATES = 4  # other nodes' addresses a busy node hands an asker it would admit
MAX_ADDR_BYTES = 160  # one of them, as text
MAX_ANSWER_BYTES = 64 + MAX_ALTERNATES * (MAX_ADDR_BYTES + 8)
ASK_TIMEOUT_S = 15.0  # the probe daemon's start (1-2 s), its dial and the answer, per join node

PUBLIC = "public"  # the run takes no token: the join node is busy
TOKEN_OK = "token_ok"  # private, and this node's token is the run's: busy
TOKEN_BAD = "token_bad"  # private, and this node's token is not the run's
PRIVATE = "private"  # private, and this node has no token


class JoinHelp(NamedTuple):
    """What the join nodes said: ``verdict`` (PUBLIC, TOKEN_OK, TOKEN_BAD, PRIVATE; None: no node
    answered), the other nodes they handed out to join through, and whether any join node took the
    probe's connection at all (False: nothing answers at those addresses, busy or not)."""

    verdict: Optional[str]
    alternates: List[Multiaddr]
    reached: bool


class AccessError(ProtocolError):
    """An access question or answer this node does not read."""


def access_proof(key: bytes, peer_id: str) -> bytes:
    """Proof of the join token for the probe daemon ``peer_id``."""
    return hmac.new(key, b"voloco-run-access\x00" + peer_id.encode(), hashlib.sha256).digest()


class RunAccess(ServicerBase):
    """Answers whether this node's run is private, whether the asker proved its token, and, to an
    asker it would admit, other nodes to join through (``alternates``: an async callable of the
    asker's peer id that gives up to ``MAX_ALTERNATES`` multiaddrs ending in /p2p/)."""

    def __init__(self, token_key: Optional[bytes],
                 alternates: Optional[Callable[[PeerID], Awaitable[List[str]]]] = None):
        self.token_key = token_key
        self.alternates = alternates

    async def rpc_run_access(self, request: dht_pb2.FindRequest, context: P2PContext) -> dht_pb2.FindResponse:
        """{"private": bool, "token_ok": bool or None (no proof sent, or a public run), "join": [multiaddr]}."""
        answer = {"private": self.token_key is not None, "token_ok": None}
        keys = list(request.keys)
        if self.token_key is not None and len(keys) == 1 and len(keys[0]) == MAC_BYTES:
            expected = access_proof(self.token_key, context.remote_id.to_base58())
            answer["token_ok"] = proof_ok(expected, keys[0])
        elif self.token_key is not None and keys:
            answer["token_ok"] = False  # a malformed proof proves nothing
        if self.alternates is not None and (self.token_key is None or answer["token_ok"]):
            try:
                found = await asyncio.wait_for(self.alternates(context.remote_id), 1.0)
                answer["join"] = [a for a in found if len(a.encode()) <= MAX_ADDR_BYTES][:MAX_ALTERNATES]
            except Exception as e:  # advice only: the verdict still goes out
                logger.debug(f"run access: no other nodes to hand out: {e!r}")
        return dht_pb2.FindResponse(results=[dht_pb2.FindResult(type=dht_pb2.FOUND_REGULAR,
                                                                value=msgpack.packb(answer))])


async def serve_run_access(token_key: Optional[bytes], _dht, node) -> None:
    """``dht.run_coroutine(partial(serve_run_access, key))``: register the handler, with no authorizer."""
    p2p = node.p2p
    await RunAccess(token_key, alternates=lambda asker: connected_nodes(p2p, asker, MAX_ALTERNATES)).add_p2p_handlers(p2p)


def read_answer(response: Optional[dht_pb2.FindResponse], proved: bool) -> str:
    """PUBLIC, TOKEN_OK, TOKEN_BAD or PRIVATE from a node's answer; AccessError if it is not one."""
    return read_answers(response, proved)[0]


def read_answers(response: Optional[dht_pb2.FindResponse], proved: bool) -> Tuple[str, List[Multiaddr]]:
    """``read_answer``'s verdict and the nodes the answer hands out to join through (well-formed
    multiaddrs with a /p2p/ id, at most ``MAX_ALTERNATES``; the malformed are left out)."""
    if response is None or len(response.results) != 1 or len(response.results[0].value) > MAX_ANSWER_BYTES:
        raise AccessError("no valid answer")
    answer = bounded_unpack(response.results[0].value, AccessError, "a run-access answer",
                            max_array_len=MAX_ALTERNATES, max_map_len=3)
    if not isinstance(answer, dict) or answer.get("private") not in (True, False) or \
            answer.get("token_ok") not in (True, False, None):
        raise AccessError("no valid answer")
    alternates = []
    for text in answer.get("join", []) if isinstance(answer.get("join", []), list) else []:
        try:
            maddr = Multiaddr(text)
            maddr.value_for_protocol("p2p")
            alternates.append(maddr)
        except Exception:
            continue
    return _verdict(answer, proved), alternates


def _verdict(answer: dict, proved: bool) -> str:
    if not answer["private"]:
        return PUBLIC
    if not proved:
        return PRIVATE
    if answer["token_ok"] is None:
        raise AccessError("a private run's node ignored the proof")
    return TOKEN_OK if answer["token_ok"] else TOKEN_BAD


async def _ask_one(probe: P2P, maddr: Multiaddr, key: Optional[bytes], timeout: float) -> JoinHelp:
    maddr = Multiaddr(str(maddr))  # hivemind's visible addresses are another Multiaddr class
    peer = PeerID.from_base58(maddr.value_for_protocol("p2p"))
    where = Multiaddr(str(maddr.decapsulate(Multiaddr(f"/p2p/{peer}"))))
    proof = [access_proof(key, probe.peer_id.to_base58())] if key is not None else []
    try:
        await asyncio.wait_for(probe._client.connect(peer, [where]), timeout)
    except Exception as e:  # nothing answers there
        logger.debug(f"run access of {maddr}: no connection: {e!r}")
        return JoinHelp(None, [], False)
    try:
        stub = RunAccess.get_stub(probe, peer)
        response = await asyncio.wait_for(stub.rpc_run_access(dht_pb2.FindRequest(keys=proof)), timeout)
        return JoinHelp(*read_answers(response, key is not None), True)
    except Exception as e:  # an older node without the handler, one too busy even for this, a liar
        logger.debug(f"run access of {maddr}: {e!r}")
        return JoinHelp(None, [], True)


async def ask_run_access(initial_peers: Sequence[Multiaddr], key: Optional[bytes],
                         timeout: float = ASK_TIMEOUT_S) -> JoinHelp:
    """What the join nodes say of the run: the first answer that says "busy" (PUBLIC, TOKEN_OK)
    wins over a refusal, since one node that would admit this one is enough; None if none answered.
    With it, the nodes they handed out to join through (not the join nodes themselves)."""
    probe = await asyncio.wait_for(start_probe_daemon(), timeout)
    try:
        answers = await asyncio.gather(*(_ask_one(probe, m, key, timeout) for m in initial_peers[:4]))
    finally:
        await probe.shutdown()
    asked = {str(m) for m in initial_peers}
    alternates = list({str(a): a for a_ in answers for a in a_.alternates if str(a) not in asked}.values())
    reached = any(a.reached for a in answers)
    for verdict in (PUBLIC, TOKEN_OK, TOKEN_BAD, PRIVATE):
        if verdict in [a.verdict for a in answers]:
            return JoinHelp(verdict, alternates[:MAX_ALTERNATES], reached)
    return JoinHelp(None, [], reached)


def join_help(initial_peers: Sequence[Multiaddr], key: Optional[bytes], timeout: float = ASK_TIMEOUT_S) -> JoinHelp:
    """``ask_run_access`` from synchronous code (no event loop running); nothing known on any failure."""
    try:
        return asyncio.run(asyncio.wait_for(ask_run_access(initial_peers, key, timeout), 2 * timeout + 10))
    except Exception as e:
        logger.debug(f"run access: {e!r}")
        return JoinHelp(None, [], False)


def run_access(initial_peers: Sequence[Multiaddr], key: Optional[bytes], timeout: float = ASK_TIMEOUT_S) -> Optional[str]:
    """``join_help``'s verdict alone."""
    return join_help(initial_peers, key, timeout)[0]
