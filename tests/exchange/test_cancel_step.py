"""Cancelling a hivemind averaging step (peer/exchange/matchmaking.py: cancel_step): by the time the
averager process is signalled, the step already reads as cancelled there. hivemind's own
``StepControl.cancel`` signals first; an averager that woke in between kept waiting on its
matchmaking for the round's whole wait, and the peer's later steps queued behind it."""

from __future__ import annotations

from hivemind.averaging.control import StepControl
from hivemind.utils.mpfuture import MPFuture

from peer.exchange.matchmaking import cancel_step


def _step(trigger: MPFuture, cancel: MPFuture) -> StepControl:
    control = StepControl(scheduled_time=0.0, deadline=60.0, allow_retries=True, weight=1.0, data_for_gather=b"")
    control.attach(trigger, cancel)
    return control


def _read_at_signal(cancel) -> list:
    """Cancel a fresh step with ``cancel``; what the step read (cancelled?) when the averager was
    signalled (the signal's set_result is where an averager may wake)."""
    control = _step(MPFuture(), MPFuture())
    at_signal = []
    signal = control._cancel.set_result
    control._cancel.set_result = lambda value: (at_signal.append(control.cancelled()), signal(value))
    cancel(control)
    assert control.cancelled() and control._cancel.done()
    return at_signal


def test_the_step_is_marked_cancelled_before_the_averager_is_signalled():
    assert _read_at_signal(cancel_step) == [True]


def test_hivemind_alone_signals_before_it_marks():
    """The race the helper closes (if hivemind reorders its cancel, this test says so)."""
    assert _read_at_signal(lambda control: control.cancel()) == [False]
