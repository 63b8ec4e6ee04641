"""``python -m coordinator``: start a run's coordinator alone (``voloco coordinator`` is the same)."""

import sys

from coordinator.cli import main

sys.exit(main())
