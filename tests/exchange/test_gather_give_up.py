"""peer/exchange/gatherer.py's gather gives up a matchmaking that can find nobody, and never a gather under way."""

from __future__ import annotations

from concurrent.futures import TimeoutError as FuturesTimeout

from hivemind.averaging.control import AveragingStage

from peer.exchange.matchmaking import step_outcome


class Control:
    """A step that finishes after ``finish_after`` polls (never, for None), in ``stage``."""

    def __init__(self, stage, finish_after=None):
        self.stage, self.finish_after, self.polls, self.cancelled = stage, finish_after, 0, False

    def result(self, timeout=None):
        self.polls += 1
        if self.finish_after is not None and self.polls > self.finish_after:
            return "the group's result"
        if timeout is None:
            raise AssertionError("a gather with no give_up would block here")
        raise FuturesTimeout()

    def cancel(self):
        self.cancelled = True


def test_matchmaking_is_cancelled_once_no_group_can_form():
    control, asked = Control(AveragingStage.LOOKING_FOR_GROUP), []
    assert step_outcome(control, lambda: asked.append(1) or len(asked) >= 3) is None
    assert control.cancelled and len(asked) == 3


def test_a_gather_under_way_is_never_cancelled():
    control = Control(AveragingStage.RUNNING_ALLREDUCE, finish_after=4)
    assert step_outcome(control, lambda: True) == "the group's result"
    assert not control.cancelled


def test_a_group_found_before_giving_up_is_kept():
    control = Control(AveragingStage.LOOKING_FOR_GROUP, finish_after=2)
    assert step_outcome(control, lambda: False) == "the group's result" and not control.cancelled
