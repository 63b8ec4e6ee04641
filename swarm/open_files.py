"""A node's open-file limit, raised to what the system allows before its helper processes start.

Every stream another peer opens to this node holds a file descriptor in the p2p daemon and in the
process that serves it (the DHT's, the averager's) until it closes, and the helpers inherit the
main process's limit. The common soft limit of 1,024 is about what the DHT's channel cap alone
allows others to hold (swarm/dht/channels.py ``MAX_SERVED``): past it the node could not open its
own connections (EMFILE) and stopped gathering. The soft limit may go up to the hard one without
privileges, so it does (tests/swarm/test_open_files.py).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("voloco.swarm")

WANTED = 1 << 16  # far above what this node's bounds let others hold


def raise_open_file_limit(wanted: int = WANTED) -> int:
    """Raise this process's soft limit on open files towards ``wanted`` (at most the hard limit); the
    soft limit in force afterwards (0 where the platform has none)."""
    try:
        import resource
    except ImportError:  # not a POSIX platform
        return 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            logger.debug(f"could not raise the open-file limit from {soft} to {target}: {e!r}")
    return soft
