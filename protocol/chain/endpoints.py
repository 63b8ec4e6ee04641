"""Where a chain neighbour can reach a stage listener: announced endpoints and the order to dial them.

A stage listener accepts on every interface (or on ``--stage-host``); what it announces in its
candidate record (protocol/chain/records.py) is a short list of ``host:port`` built from the
addresses its DHT node is seen at (``--host-maddrs``, ``--announce-maddrs``, what hivemind
observed): the addresses other hosts can use first, loopback only when there is nothing else
(a run on one machine). A dialer tries them in order and never dials a loopback endpoint of a
neighbour that also announced another address: that neighbour is on another host, and a loopback
address would reach the dialer itself.

Pure functions of strings: no sockets.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Iterable, List, Optional, Sequence, Tuple

MAX_ENDPOINTS = 4  # endpoints one candidate record carries (it is read by every peer of the chain)
SEPARATOR = ","


class EndpointError(ValueError):
    """An endpoint or an address that cannot be announced or dialed."""


_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")  # one DNS label (RFC 1123)


def dialable_host(host: str) -> bool:
    """Whether ``host`` is an IP address or a DNS name a socket can be asked to dial: a name with an
    empty label or a label over 63 characters makes ``asyncio.open_connection`` raise UnicodeError
    (IDNA), which a stage dialing a neighbour's record did not expect; every name it passes encodes
    (tests/chain/test_stage_endpoints.py::test_only_hosts_a_socket_can_dial_are_endpoints)."""
    if _ip(host) is not None:
        return True
    name = host[:-1] if host.endswith(".") else host
    return 0 < len(name) <= 253 and all(_LABEL.fullmatch(label) for label in name.split("."))


def _ip(text: str) -> Optional[ipaddress._BaseAddress]:
    try:
        return ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return None


def _rank(host: str) -> int:
    """0: reachable from other hosts in principle (global or private), 1: link-local, 2: loopback."""
    ip = _ip(host)
    if ip is None:
        return 0  # a DNS name, given on purpose
    if ip.is_loopback:
        return 2
    if ip.is_link_local:
        return 1
    return 0


def hosts_of_maddrs(maddrs: Iterable[str]) -> List[str]:
    """The IP addresses (and DNS names) in multiaddrs such as ``/ip4/10.0.0.2/tcp/4001/p2p/Qm..``:
    unspecified ones (0.0.0.0, ::) and relay circuits left out, duplicates dropped, order kept."""
    out: List[str] = []
    for maddr in maddrs:
        parts = str(maddr).split("/")
        if "p2p-circuit" in parts or len(parts) < 3:
            continue
        proto, value = parts[1], parts[2]
        if proto in ("ip4", "ip6"):
            ip = _ip(value)
            if ip is None or ip.is_unspecified:
                continue
            host = str(ip)
        elif proto in ("dns", "dns4", "dns6"):
            host = value
        else:
            continue
        if host not in out:
            out.append(host)
    return out


def format_endpoint(host: str, port: int) -> str:
    if not 0 < int(port) < 65536:
        raise EndpointError(f"port {port} is out of range")
    ip = _ip(host)
    return f"[{ip}]:{port}" if ip is not None and ip.version == 6 else f"{host}:{port}"


def announced_endpoints(hosts: Sequence[str], port: int, override: Optional[str] = None) -> str:
    """The endpoint field of a candidate record: ``override`` alone if given (``--stage-host``),
    else up to MAX_ENDPOINTS of ``hosts`` (reachable first, loopback only if nothing else is)."""
    if override:
        return format_endpoint(override, port)
    ranked = sorted(hosts, key=_rank)  # stable: the DHT's own order within a rank
    usable = [h for h in ranked if _rank(h) < 2] or [h for h in ranked if _rank(h) == 2] or ["127.0.0.1"]
    return SEPARATOR.join(format_endpoint(h, port) for h in usable[:MAX_ENDPOINTS])


def split_endpoints(field: str) -> List[Tuple[str, int]]:
    """``host:port[,host:port...]`` as (host, port) pairs; EndpointError if malformed."""
    out = []
    items = [e for e in field.split(SEPARATOR) if e] if field else []
    if len(items) > MAX_ENDPOINTS:
        raise EndpointError(f"at most {MAX_ENDPOINTS} endpoints, got {len(items)}")
    for item in items:
        host, sep, port = item.rpartition(":")
        if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536 \
                or not dialable_host(host.strip("[]")):
            raise EndpointError(f"an endpoint must be host:port, got {item!r:.80}")
        out.append((host.strip("[]"), int(port)))
    return out


def dial_order(field: str) -> List[Tuple[str, int]]:
    """The endpoints of a neighbour's record, in the order to try them: a loopback endpoint only
    when the neighbour announced nothing else (then it runs on this host)."""
    pairs = split_endpoints(field)
    remote = [(h, p) for h, p in pairs if _rank(h) < 2]
    return remote or pairs
