"""``python -m coordinator``: start a run's coordinator alone (``voloco coordinator`` is the same)."""

from coordinator.cli import main
from swarm.console import exit_process

exit_process(main)
