"""Fixtures the test folders share (pytest finds them here for every test below tests/)."""

from __future__ import annotations

import pytest

from peer.round import membership as membership_mod
from peer.round import barrier, no_show_views, start_waits, state_sync


class Clock:
    """time.monotonic / time.sleep of the module under test: sleeping advances the clock."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now

    def sleep(self, s):
        self.now += s


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(membership_mod, "time", c)
    monkeypatch.setattr(barrier, "time", c)  # the round barrier's waits
    monkeypatch.setattr(no_show_views, "time", c)  # the budget for strangers in our groups
    monkeypatch.setattr(start_waits, "time", c)  # the start quorum's polls
    monkeypatch.setattr(state_sync, "time", c)
    return c
