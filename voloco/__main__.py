"""``python -m voloco``: the same as the ``voloco`` command."""

from voloco.cli import main
from swarm.console import exit_process

exit_process(main)
