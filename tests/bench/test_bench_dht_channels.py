"""bench/dht_channels.py: unary calls against a DHT channel on one host's loopback, bytes from its counters.

Needs root and ``ip netns``; skips cleanly without them."""

from __future__ import annotations

import json

import pytest

from bench import dht_channels
from tests.support.netns_hosts import netns_unavailable


def test_a_channel_call_costs_fewer_bytes_and_packets_than_a_unary_call(tmp_path, capsys):
    if (why := netns_unavailable()) is not None:
        pytest.skip(f"needs network namespaces: {why}")
    out = tmp_path / "channels.json"
    assert dht_channels.main(["--calls", "20", "--json", str(out)]) == 0
    assert "unary / channel" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    rows = {(r["method"], r["transport"]): r for r in doc["rows"]}
    for method in ("store", "find"):
        unary, channel = rows[(method, "unary")], rows[(method, "channel")]
        assert channel["packets"] < unary["packets"] and channel["bytes"] < unary["bytes"], (unary, channel)
        assert doc[f"{method}_bytes_ratio"] > 1
        # CPU is reported, not compared: on a shared machine 20 calls' seconds are noise
        assert all(isinstance(r["cpu_s"], float) for r in (unary, channel)), (unary, channel)
