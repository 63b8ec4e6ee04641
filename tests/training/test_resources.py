"""peer/training/resources.py: what memory a peer sizes itself to."""

from __future__ import annotations

import types

import torch

from peer.training import resources
from peer.training.resources import HEADROOM, detect

GB = 10**9


def _gpu(monkeypatch, total: int, free: int):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(total_memory=total))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, total))


def test_a_gpu_of_its_own_gives_its_memory_with_headroom(monkeypatch):
    _gpu(monkeypatch, 80 * GB, 79 * GB)  # this process's own context aside
    r = detect(torch.device("cuda"), None, None)
    assert (r.memory_bytes, r.source) == (int(80 * GB * HEADROOM), "cuda")


def test_a_gpu_another_peer_already_trains_on_gives_what_is_left(monkeypatch):
    """Two peers started on one card each took 80 % of all of it, and the second ran out of memory
    at its first steps; it now sizes itself to what the first left free (and may join a chain)."""
    _gpu(monkeypatch, 24 * GB, 9 * GB)
    r = detect(torch.device("cuda:0"), None, None)
    assert r.memory_bytes == int(9 * GB * HEADROOM)
    assert "9.0 of its 24.0 GB free" in r.source and "9.0 of its 24.0 GB free" in r.describe(resources.RunSpec())


def test_a_declared_limit_wins(monkeypatch):
    _gpu(monkeypatch, 24 * GB, 9 * GB)
    assert detect(torch.device("cuda"), 16.0, None).memory_bytes == 16 * GB
