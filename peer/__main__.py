"""``python -m peer --join MULTIADDR``: start a peer alone (``voloco peer`` is the same)."""

import sys

from peer.host.cli import main

sys.exit(main())
