"""``python -m voloco``: the same as the ``voloco`` command."""

import sys

from voloco.cli import main

sys.exit(main())
