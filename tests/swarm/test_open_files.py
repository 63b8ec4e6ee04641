"""swarm/open_files.py: a node raises its soft open-file limit to what the hard limit allows."""

from __future__ import annotations

import resource

from swarm import open_files


def test_the_soft_limit_goes_up_to_the_hard_one_and_never_down(monkeypatch):
    limits = {"now": (1024, 4096)}
    monkeypatch.setattr(resource, "getrlimit", lambda which: limits["now"])
    monkeypatch.setattr(resource, "setrlimit", lambda which, value: limits.__setitem__("now", value))
    assert open_files.raise_open_file_limit() == 4096 and limits["now"] == (4096, 4096)  # the hard limit binds
    limits["now"] = (1024, resource.RLIM_INFINITY)
    assert open_files.raise_open_file_limit() == open_files.WANTED
    limits["now"] = (200_000, resource.RLIM_INFINITY)
    assert open_files.raise_open_file_limit() == 200_000  # never lowered


def test_a_refusal_leaves_the_limit_as_it_was(monkeypatch):
    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 4096))

    def refuse(which, value):
        raise ValueError("not allowed")

    monkeypatch.setattr(resource, "setrlimit", refuse)
    assert open_files.raise_open_file_limit() == 1024


def test_this_process_can_raise_its_own():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert open_files.raise_open_file_limit() >= soft
