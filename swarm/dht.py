"""This process's hivemind DHT node: the addresses it joins and its start-up, with its identity,
its record validators and, in a private run, its authorizer."""

from __future__ import annotations

import os
import shutil
from typing import List, Optional, Sequence

import hivemind
from multiaddr import Multiaddr

from protocol.records import token_key
from swarm.admission import JoinTokenAuthorizer
from swarm.console import UsageError
from swarm.identity import NodeTrust, prepare_identity, register
from swarm.validators import node_validators


def parse_multiaddrs(addrs: Sequence[str], flag: str = "--join") -> List[Multiaddr]:
    """Parse and check peer multiaddrs such as /ip4/1.2.3.4/tcp/31337/p2p/Qm..."""
    out = []
    for addr in addrs:
        try:
            maddr = Multiaddr(addr)
        except Exception as e:
            raise UsageError(f"{flag} {addr!r} is not a multiaddr ({e}); expected e.g. /ip4/203.0.113.5/tcp/31337/p2p/QmPeerID") from None
        protocols = [p.name for p in maddr.protocols()]
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
) -> hivemind.DHT:
    """Start this process's DHT node; UsageError with what to check when the swarm is unreachable.

    The node's RSA identity (``identity_path``, created if missing; a temporary one without it)
    gives its peer id and signs its records; every node validates records the same way
    (swarm/validators.py, with the schemas of ``run_ids`` known from the start). With
    ``join_token``, the node speaks only to nodes that prove the same token (swarm/admission.py).
    ``run_key`` is the fingerprint ``fetch_spec`` will require of the run spec's signer.
    """
    identity, path, created = prepare_identity(identity_path)
    key = token_key(join_token) if join_token is not None else None
    try:
        dht = hivemind.DHT(
            start=True,
            initial_peers=[str(m) for m in initial_peers],
            host_maddrs=list(host_maddrs),
            announce_maddrs=list(announce_maddrs) or None,
            identity_path=path,
            check_if_identity_free=not created,  # a key made just now is nobody else's
            client_mode=client_mode,
            record_validators=node_validators(identity, key, run_ids),
            authorizer=JoinTokenAuthorizer(identity, key) if key is not None else None,
            startup_timeout=30,
        )
    except Exception as e:
        text = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        if initial_peers:
            token = "that --join-token matches the run's (a private run), " if key is not None else (
                "that the run is not private (it then needs its --join-token), ")
            raise UsageError(
                f"could not reach the DHT at {', '.join(map(str, initial_peers))} ({text}): check that the coordinator "
                f"is running, that the address, port and peer id match what it printed, {token}and that no firewall "
                f"blocks the port"
            ) from None
        raise UsageError(f"could not start a DHT node on {', '.join(host_maddrs)} ({text}): is the port free?") from None
    finally:
        if identity_path is None:  # the daemon has read its temporary identity
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    if dht.peer_id.to_base58() != identity.peer_id:
        dht.shutdown()
        raise RuntimeError(f"the DHT node's peer id {dht.peer_id} is not that of its identity {identity.peer_id}")
    register(dht, NodeTrust(identity, token_key=key, run_key=run_key))
    return dht
