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
The answer is advice for the asker's own retry loop: a lying node can make a peer wait longer or
give up sooner, never let it into a run. Everything crossing the wire is bounded: one proof of
``MAC_BYTES`` in, ``MAX_ANSWER_BYTES`` out.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from typing import Optional, Sequence

import msgpack
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import dht_pb2
from multiaddr import Multiaddr

from protocol.bounded_unpack import bounded_unpack
from protocol.errors import ProtocolError
from protocol.dht.records import MAC_BYTES, proof_ok
from swarm.access.reachability import PROBE_ARGS  # one set of throw-away daemon options

logger = logging.getLogger("voloco.swarm")

MAX_ANSWER_BYTES = 64
ASK_TIMEOUT_S = 15.0  # the probe daemon's start (1-2 s), its dial and the answer, per join node

PUBLIC = "public"  # the run takes no token: the join node is busy
TOKEN_OK = "token_ok"  # private, and this node's token is the run's: busy
TOKEN_BAD = "token_bad"  # private, and this node's token is not the run's
PRIVATE = "private"  # private, and this node has no token


class AccessError(ProtocolError):
    """An access question or answer this node does not read."""


def access_proof(key: bytes, peer_id: str) -> bytes:
    """Proof of the join token for the probe daemon ``peer_id``."""
    return hmac.new(key, b"voloco-run-access\x00" + peer_id.encode(), hashlib.sha256).digest()


class RunAccess(ServicerBase):
    """Answers whether this node's run is private, and whether the asker proved its token."""

    def __init__(self, token_key: Optional[bytes]):
        self.token_key = token_key

    async def rpc_run_access(self, request: dht_pb2.FindRequest, context: P2PContext) -> dht_pb2.FindResponse:
        """{"private": bool, "token_ok": bool or None (no proof sent, or a public run)}."""
        answer = {"private": self.token_key is not None, "token_ok": None}
        keys = list(request.keys)
        if self.token_key is not None and len(keys) == 1 and len(keys[0]) == MAC_BYTES:
            expected = access_proof(self.token_key, context.remote_id.to_base58())
            answer["token_ok"] = proof_ok(expected, keys[0])
        elif self.token_key is not None and keys:
            answer["token_ok"] = False  # a malformed proof proves nothing
        return dht_pb2.FindResponse(results=[dht_pb2.FindResult(type=dht_pb2.FOUND_REGULAR,
                                                                value=msgpack.packb(answer))])


async def serve_run_access(token_key: Optional[bytes], _dht, node) -> None:
    """``dht.run_coroutine(partial(serve_run_access, key))``: register the handler, with no authorizer."""
    await RunAccess(token_key).add_p2p_handlers(node.p2p)


def read_answer(response: Optional[dht_pb2.FindResponse], proved: bool) -> str:
    """PUBLIC, TOKEN_OK, TOKEN_BAD or PRIVATE from a node's answer; AccessError if it is not one."""
    if response is None or len(response.results) != 1 or len(response.results[0].value) > MAX_ANSWER_BYTES:
        raise AccessError("no valid answer")
    answer = bounded_unpack(response.results[0].value, AccessError, "a run-access answer", max_array_len=2,
                            max_map_len=2)
    if not isinstance(answer, dict) or answer.get("private") not in (True, False) or \
            answer.get("token_ok") not in (True, False, None):
        raise AccessError("no valid answer")
    if not answer["private"]:
        return PUBLIC
    if not proved:
        return PRIVATE
    if answer["token_ok"] is None:
        raise AccessError("a private run's node ignored the proof")
    return TOKEN_OK if answer["token_ok"] else TOKEN_BAD


async def _ask_one(probe: P2P, maddr: Multiaddr, key: Optional[bytes], timeout: float) -> Optional[str]:
    maddr = Multiaddr(str(maddr))  # hivemind's visible addresses are another Multiaddr class
    peer = PeerID.from_base58(maddr.value_for_protocol("p2p"))
    where = Multiaddr(str(maddr.decapsulate(Multiaddr(f"/p2p/{peer}"))))
    proof = [access_proof(key, probe.peer_id.to_base58())] if key is not None else []
    try:
        await asyncio.wait_for(probe._client.connect(peer, [where]), timeout)
        stub = RunAccess.get_stub(probe, peer)
        response = await asyncio.wait_for(stub.rpc_run_access(dht_pb2.FindRequest(keys=proof)), timeout)
        return read_answer(response, key is not None)
    except Exception as e:  # an older node without the handler, one too busy even for this, a liar
        logger.debug(f"run access of {maddr}: {e!r}")
        return None


async def ask_run_access(initial_peers: Sequence[Multiaddr], key: Optional[bytes],
                         timeout: float = ASK_TIMEOUT_S) -> Optional[str]:
    """What the join nodes say of the run: the first answer that says "busy" (PUBLIC, TOKEN_OK)
    wins over a refusal, since one node that would admit this one is enough; None if none answered."""
    probe = await asyncio.wait_for(P2P.create(**PROBE_ARGS), timeout)
    try:
        answers = await asyncio.gather(*(_ask_one(probe, m, key, timeout) for m in initial_peers[:4]))
    finally:
        await probe.shutdown()
    for verdict in (PUBLIC, TOKEN_OK, TOKEN_BAD, PRIVATE):
        if verdict in answers:
            return verdict
    return None


def run_access(initial_peers: Sequence[Multiaddr], key: Optional[bytes], timeout: float = ASK_TIMEOUT_S) -> Optional[str]:
    """``ask_run_access`` from synchronous code (no event loop running); None on any failure."""
    try:
        return asyncio.run(asyncio.wait_for(ask_run_access(initial_peers, key, timeout), 2 * timeout + 10))
    except Exception as e:
        logger.debug(f"run access: {e!r}")
        return None
