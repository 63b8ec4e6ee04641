"""An honest peer whose lineage tables part from its swarm's once, θ untouched, for
tests/round/test_table_split.py.

    python -m tests.support.skewed_tables_peer peer FLAGS...   (the flags of ``voloco peer``)

It runs ``voloco`` unchanged, except that once it has concluded round ``VOLOCO_SKEW_ROUND`` (default 1)
its standing table gains a sender nobody else counts (protocol/round/standing.py): its θ stays the
swarm's, its state digest (peer/checkpoints/files.py) does not. That is what two unions of a round
that draw the same K contributions leave behind (bench/RESULTS.md, eighty-first session): a split the
start vote, which compares θ, does not see.
"""

from __future__ import annotations

import logging
import os

from peer.outer.engine import RoundEngine
from swarm.console import exit_process

PHANTOM = "QmSkewedTablesPhantomSenderNobodyElseCounts"
_SKEW_ROUND = int(os.environ.get("VOLOCO_SKEW_ROUND", "1"))
_conclude = RoundEngine.conclude
_done = []


def skewed_conclude(self, *args, **kwargs):
    settled = _conclude(self, *args, **kwargs)
    if not _done and self.round == _SKEW_ROUND + 1:
        with self.lock:
            self.standing = {**self.standing, PHANTOM: 1}
            self._hash = self._digest = None
        _done.append(self.round)
        logging.getLogger("voloco.peer").info(f"skewed: counted {PHANTOM} in the standing table after round {_SKEW_ROUND}")
    return settled


RoundEngine.conclude = skewed_conclude

if __name__ == "__main__":
    from voloco.cli import main

    exit_process(main)
