"""This process's hivemind DHT node: the addresses it joins and its start-up."""

from __future__ import annotations

from typing import List, Optional, Sequence

import hivemind
from multiaddr import Multiaddr

from swarm.console import UsageError


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
) -> hivemind.DHT:
    """Start this process's DHT node; UsageError with what to check when the swarm is unreachable."""
    try:
        return hivemind.DHT(
            start=True,
            initial_peers=[str(m) for m in initial_peers],
            host_maddrs=list(host_maddrs),
            announce_maddrs=list(announce_maddrs) or None,
            identity_path=identity_path,
            client_mode=client_mode,
            startup_timeout=30,
        )
    except Exception as e:
        text = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        if initial_peers:
            raise UsageError(
                f"could not reach the DHT at {', '.join(map(str, initial_peers))} ({text}): check that the coordinator "
                f"is running, that the address, port and peer id match what it printed, and that no firewall blocks the port"
            ) from None
        raise UsageError(f"could not start a DHT node on {', '.join(host_maddrs)} ({text}): is the port free?") from None
