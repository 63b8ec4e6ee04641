"""``python -m peer --join MULTIADDR``: start a peer alone (``voloco peer`` is the same)."""

from peer.host.cli import main
from swarm.console import exit_process

exit_process(main)
