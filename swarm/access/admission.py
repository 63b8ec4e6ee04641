"""Admission to a private run: a shared join token, proven without ever being sent.

Three places check it, each with what it can see:

- the DHT (``JoinTokenAuthorizer``, a hivemind ``TokenAuthorizerBase`` given to
  ``hivemind.DHT(authorizer=...)``): every DHT request and response carries an access token whose
  signature is an HMAC, keyed by the join token, over the sender's peer id and public key (Ed25519,
  or RSA for an RSA identity), and is signed with that key; a node without the token gets no answer
  from, and is not answered by, the run's nodes, so it can neither read nor write the run's records;
- every record (swarm/dht/validators.py, swarm/records.py): its envelope's ``mac`` proves the token
  for that record, owner and peer; readers ignore a record without it;
- the averager (``AdmissionGate``): hivemind's averaging messages have no auth field, so each
  incoming averager RPC (matchmaking, payload gather, state download) is checked by the libp2p
  peer id of its stream: it is served only if that peer has a progress record in the DHT that
  proves the token. A peer without the token thus enters no group and serves or gets no state.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from typing import Dict, Optional

from hivemind.p2p import PeerID
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils import get_dht_time
from hivemind.utils.auth import TokenAuthorizerBase

from protocol.dht.keys import peers_key
from protocol.dht.records import MAX_RECORD_TTL, admission_proof, proof_ok
from swarm.access.identity import Identity, peer_id_of, public_key_from_bytes, trust_of
from swarm.records import verified_entries
from swarm.refusal_log import RefusalLog

logger = logging.getLogger("voloco.swarm")

LOGGED_PEERS = 64  # peers whose refusals are logged by name within a minute
TOKEN_VALIDITY = 24 * 3600.0  # an access token is re-made an hour before this runs out


class JoinTokenAuthorizer(TokenAuthorizerBase):
    """hivemind's moderated-network protocol with a shared secret in place of an authority."""

    def __init__(self, identity: Identity, token_key: bytes):
        super().__init__(identity.private_key)
        self._identity, self._key = identity, token_key

    async def get_token(self) -> AccessToken:
        expires = f"{get_dht_time() + TOKEN_VALIDITY:.0f}"
        me = self._identity
        return AccessToken(
            username=me.peer_id, public_key=me.public_key, expiration_time=expires,
            signature=admission_proof(self._key, me.peer_id, me.public_key, expires),
        )

    def is_token_valid(self, access_token: AccessToken) -> bool:
        try:
            if access_token.username != peer_id_of(access_token.public_key):
                return False
            expires = float(access_token.expiration_time)
        except ValueError:
            return False
        expected = admission_proof(self._key, access_token.username, access_token.public_key, access_token.expiration_time)
        return proof_ok(expected, access_token.signature) and get_dht_time() < expires <= get_dht_time() + 2 * TOKEN_VALIDITY

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        return float(access_token.expiration_time) < get_dht_time() + 3600

    # hivemind's validate_request and validate_response, with the signer's key Ed25519 or RSA (theirs
    # parse RSA keys only); the token, nonce, clock and service-key checks are theirs, unchanged.
    async def validate_request(self, request) -> bool:
        await self.refresh_token_if_needed()
        auth = request.auth
        if not self.is_token_valid(auth.client_access_token) or not _signed(request, auth.client_access_token):
            return False
        if auth.service_public_key and auth.service_public_key != self._local_public_key.to_bytes():
            return False
        window = self._MAX_CLIENT_SERVICER_TIME_DIFF.total_seconds()
        with self._recent_nonces.freeze():
            now = get_dht_time()
            if abs(auth.time - now) > window or auth.nonce in self._recent_nonces:
                return False  # clocks apart, or a request replayed
        self._recent_nonces.store(auth.nonce, None, now + window * 3)
        return True

    async def validate_response(self, response, request) -> bool:
        await self.refresh_token_if_needed()
        auth = response.auth
        return (self.is_token_valid(auth.service_access_token) and _signed(response, auth.service_access_token)
                and auth.nonce == request.auth.nonce)


def _signed(message, token: AccessToken) -> bool:
    """Whether ``message`` (an authorized request or response) carries the signature of the token's key."""
    try:
        key = public_key_from_bytes(token.public_key)
    except (ValueError, TypeError):
        return False
    signature = message.auth.signature
    message.auth.signature = b""
    return key.verify(message.SerializeToString(), signature)


class AdmissionGate:
    """Which remote peers this node's averager serves: those whose progress record in the DHT
    proves the join token. Lives in the averager's process; looks the DHT up at most every
    ``refresh_period`` and waits up to ``patience`` for a newcomer's first record."""

    def __init__(self, token_key: bytes, run_id: str, refresh_period: float = 0.5, patience: float = 3.0):
        self.token_key, self.run_id = token_key, run_id
        self.refresh_period, self.patience = refresh_period, patience
        self._admitted: Dict[str, float] = {}  # peer id -> expiration of its last proven record
        self._refreshed = 0.0
        self._lock: Optional[asyncio.Lock] = None
        self._refusals = RefusalLog(logger.warning, LOGGED_PEERS)

    def wrap(self, servicer) -> "GatedServicer":
        """What ``ServicerBase.add_p2p_handlers(p2p, wrapper=...)`` registers instead of ``servicer``."""
        return GatedServicer(servicer, self)

    async def admits(self, dht, remote: PeerID) -> bool:
        peer = remote.to_base58()
        deadline = time.monotonic() + self.patience
        while True:
            if self._admitted.get(peer, 0.0) > get_dht_time():
                return True
            if time.monotonic() >= deadline:
                return False
            await self._refresh(dht)
            if self._admitted.get(peer, 0.0) > get_dht_time():
                return True
            await asyncio.sleep(self.refresh_period)

    async def _refresh(self, dht) -> None:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if time.monotonic() - self._refreshed < self.refresh_period:
                return
            self._refreshed = time.monotonic()
            try:
                found = await dht.get(peers_key(self.run_id), latest=True, return_future=True)
            except Exception as e:
                logger.debug(f"admission: could not read progress records: {e!r}")
                return
            for entry in verified_entries(peers_key(self.run_id), found, self.token_key, MAX_RECORD_TTL):
                self._admitted[entry.peer] = max(self._admitted.get(entry.peer, 0.0), entry.expiration)

    def refused(self, remote: PeerID, rpc: str) -> None:
        """Log a refusal once a minute a peer, for at most ``LOGGED_PEERS`` peers a minute, and a count
        of the rest once a minute (each new identity added a line and an entry, without a bound)."""
        peer = remote.to_base58()
        self._refusals.note(peer, f"refused {rpc} from {peer}: it has proven no join token of this private run",
                            lambda n, seconds: f"refused {n} calls of other peers that have proven no join token "
                                               f"of this private run")


class GatedServicer:
    """A servicer's ``rpc_*`` handlers, served only to admitted peers (others get an empty stream
    or an error), as hivemind's ``AuthRPCWrapper`` wraps the DHT's."""

    def __init__(self, servicer, gate: AdmissionGate):
        self._servicer, self._gate = servicer, gate

    def __getattr__(self, name: str):
        method = getattr(self._servicer, name)
        if not name.startswith("rpc_"):
            return method
        servicer, gate = self._servicer, self._gate

        if inspect.isasyncgenfunction(method):
            async def gated_stream(request, context):
                if not await gate.admits(servicer.dht, context.remote_id):
                    gate.refused(context.remote_id, name)
                    return
                async for message in method(request, context):
                    yield message

            return gated_stream

        async def gated(request, context):
            if not await gate.admits(servicer.dht, context.remote_id):
                gate.refused(context.remote_id, name)
                raise PermissionError(f"{name}: not admitted to this private run")
            return await method(request, context)

        return gated


class Admitted:
    """Mixin for a hivemind servicer (put it before ``DecentralizedAverager``): with an
    ``authorizer`` (an ``AdmissionGate``) set before the servicer starts, its RPC handlers are
    registered behind the gate; without one (a public run) nothing changes."""

    authorizer: Optional[AdmissionGate] = None

    async def add_p2p_handlers(self, p2p, wrapper=None, **kwargs) -> None:
        if wrapper is None and self.authorizer is not None:
            wrapper = self.authorizer.wrap(self)
        await super().add_p2p_handlers(p2p, wrapper, **kwargs)


def admission_gate(dht, run_id: str) -> Optional[AdmissionGate]:
    """The averager's gate for a node started with a join token; None in a public run."""
    key = trust_of(dht).token_key
    return AdmissionGate(key, run_id) if key is not None else None
