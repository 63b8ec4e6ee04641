"""An honest peer whose merge of a round's other groups never waits, for tests/round/test_union_swarm.py.

    python -m tests.support.hasty_peer peer FLAGS...   (the flags of ``voloco peer``)

It runs ``voloco`` unchanged except for one decision: protocol/round/round_policy.py's ``merge_wait``
answers "timed out" wherever it would answer "go on waiting", so the merge takes only the sets
already named when it starts (and what its groupmates merged). A swarm of such peers concludes
rounds from different unions whenever one group gathers after another: the case the next round's
group union (peer/round/union.py) exists for.
"""

from __future__ import annotations

from protocol.round import round_policy
from swarm.console import exit_process

_merge_wait = round_policy.merge_wait


def hasty_merge_wait(*args, **kwargs) -> round_policy.MergeWait:
    decision = _merge_wait(*args, **kwargs)
    return round_policy.MergeWait.TIMED_OUT if decision is round_policy.MergeWait.GO_ON else decision


round_policy.merge_wait = hasty_merge_wait

if __name__ == "__main__":
    from voloco.cli import main

    exit_process(main)
