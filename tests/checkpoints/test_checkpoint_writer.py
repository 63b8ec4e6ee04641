"""peer/checkpoints/writer.py: end-of-round checkpoints written in their own thread, at a bounded cost."""

import threading

from peer.checkpoints.writer import CheckpointWriter


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_first_checkpoint_is_due_then_only_after_ten_times_the_last_write():
    clock = Clock()
    writer = CheckpointWriter(cost_ratio=10.0, clock=clock)
    assert writer.due()

    def slow_write():
        clock.now += 6.0  # a 125m checkpoint: about 6 s

    writer.submit(slow_write)
    writer.wait()
    assert writer.written == 1
    clock.now += 59.0
    assert not writer.due()  # 59 s since a 6 s write: not yet
    clock.now += 1.0
    assert writer.due()


def test_a_fast_write_is_due_again_at_once():
    clock = Clock()
    writer = CheckpointWriter(clock=clock)
    writer.submit(lambda: None)
    writer.wait()
    assert writer.due()


def test_the_write_runs_in_its_own_thread_and_nothing_is_due_meanwhile():
    writer = CheckpointWriter()
    started, release = threading.Event(), threading.Event()
    seen, done = [], []

    def write():
        seen.append(threading.current_thread().name)
        started.set()
        release.wait(10)

    writer.submit(write, lambda: done.append(True))
    assert started.wait(10)
    assert writer.busy and not writer.due() and not done  # the caller was not held
    release.set()
    writer.wait()
    assert seen == ["checkpoint-writer"] and done == [True] and not writer.busy


def test_a_failed_write_is_logged_and_counted_and_never_raises(caplog):
    writer = CheckpointWriter()
    done = []

    def full_disk():
        raise OSError(28, "No space left on device")

    writer.submit(full_disk, lambda: done.append(True))
    writer.wait()
    assert writer.failed == 1 and writer.written == 0 and not done
    assert "could not write a checkpoint" in caplog.text and "No space left" in caplog.text
    writer.submit(lambda: None, lambda: done.append(True))  # the next one goes on as usual
    writer.wait()
    assert writer.written == 1 and done == [True]


def test_submit_waits_for_the_write_in_progress():
    writer = CheckpointWriter()
    order, release = [], threading.Event()

    def first():
        release.wait(10)
        order.append(1)

    writer.submit(first)
    t = threading.Timer(0.2, release.set)
    t.start()
    writer.submit(lambda: order.append(2))
    writer.wait()
    t.join()
    assert order == [1, 2]
