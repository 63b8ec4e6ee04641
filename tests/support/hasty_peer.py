"""An honest peer whose merge of a round's other groups never waits, for tests/round/test_union_swarm.py.

    python -m tests.support.hasty_peer peer FLAGS...   (the flags of ``voloco peer``)

It runs ``voloco`` unchanged except for one decision: protocol/round/round_policy.py's ``merge_wait``
answers "timed out" wherever it would answer "go on waiting", so the merge takes only the sets
already named when it starts (and what its groupmates merged). A swarm of such peers concludes
rounds from different unions whenever one group gathers after another: the case the next round's
group union (peer/round/union.py) exists for.

With ``VOLOCO_HASTY_NO_LATE_SETS=1`` in its environment it also skips ``union.take_named_sets`` (the
sets a slower group named after the merge, taken before the next matchmaking): the behaviour
before it, as bench/honest_rounds.py's ``hasty-no-late`` arm measures it against.
"""

from __future__ import annotations

import os

from peer.round import union
from protocol.round import round_policy
from swarm.console import exit_process

_merge_wait = round_policy.merge_wait


def hasty_merge_wait(*args, **kwargs) -> round_policy.MergeWait:
    decision = _merge_wait(*args, **kwargs)
    return round_policy.MergeWait.TIMED_OUT if decision is round_policy.MergeWait.GO_ON else decision


round_policy.merge_wait = hasty_merge_wait
if os.environ.get("VOLOCO_HASTY_NO_LATE_SETS") == "1":
    union.take_named_sets = lambda peer, last: 0

if __name__ == "__main__":
    from voloco.cli import main

    exit_process(main)
