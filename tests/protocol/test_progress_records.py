"""Progress records (protocol/dht/records.py ``parse_progress``): what a peer claims about itself is
read only where every number is one a peer can honestly write."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from protocol.dht.records import Progress, parse_progress
from protocol.errors import ProtocolError

HONEST = Progress(3, 4, "training", "ab" * 16, 2.5, math.nan, 1000, 123.4, 10, 20, "cd" * 8, -1)


def test_an_honest_record_round_trips_with_no_validation_loss_yet():
    back = parse_progress(HONEST.to_wire())
    assert back.round == 3 and back.tokens_per_s == 123.4 and math.isnan(back.val_loss)


@pytest.mark.parametrize("field,value", [
    ("val_loss", math.inf), ("val_loss", -math.inf), ("loss", math.inf),
    ("tokens_per_s", math.inf), ("tokens_per_s", math.nan), ("tokens_per_s", -1.0), ("util", math.nan),
])
def test_a_number_no_honest_peer_writes_refuses_the_record(field, value):
    """An infinite speed or loss would show on the dashboard and in the coordinator's log as if a
    peer had measured it (found by fuzzing the record parser)."""
    with pytest.raises(ProtocolError, match=field):
        parse_progress(replace(HONEST, **{field: value}).to_wire())
