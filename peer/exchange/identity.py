"""The key this peer signs its payloads with: the Ed25519 (or RSA) key behind its libp2p peer id.

swarm/dht/node.py starts every DHT node with an identity file (``--identity``, or a temporary one) and
keeps the loaded key (swarm/access/identity.py); the payload signer is that same key, so a receiver that
hashes the public key to the sender's peer id knows the sender signed (protocol/wire/signed.py).
"""

from __future__ import annotations

from hivemind import DHT

from protocol.wire.signed import Signer
from swarm.access.identity import trust_of


def payload_signer(dht: DHT) -> Signer:
    """The signer of this DHT node's peer id; RuntimeError if its key is not the node's identity."""
    signer = Signer.from_libp2p(*trust_of(dht).identity.libp2p_key)
    if signer.peer_id != dht.peer_id.to_bytes():
        raise RuntimeError(f"the identity key of {dht.peer_id} is not the key of its peer id")
    return signer
