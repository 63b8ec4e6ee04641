"""A peer's state served over real libp2p streams (peer/exchange/state_serving.py) through its serve
gate (protocol/round/serve_gate.py): a download is served whole, a peer that downloads again within
the window is refused as a peer that does not share, and another peer still gets the state."""

from __future__ import annotations

import pytest
import torch

from peer.exchange.gatherer import PayloadGatherer
from peer.round.state_download import StateDownloader, StateDownloadError
from protocol.dht.keys import averager_prefix
from protocol.round.timing import Timing
from tests.round.test_liveness import SPEC
from tests.support.dht_nodes import loopback_nodes


@pytest.fixture
def nodes():
    yield from loopback_nodes(SPEC, 2)


def test_a_peer_downloads_our_state_once_per_window_and_others_still_can(nodes):
    timing = Timing().with_(serves_per_peer=1, serve_window_s=600.0)
    gatherers = [PayloadGatherer(dht, prefix=averager_prefix(SPEC.run_id), schema=SPEC.digest().encode(), timing=timing)
                 for dht in nodes]
    try:
        for g in gatherers:
            g.run_in_background(await_ready=True)
        server, first, second = gatherers
        theta = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        server.state_provider = lambda: ({"round": 3}, [theta.clone()])
        server.allow_state_sharing = True
        peer = server.peer_id.to_base58()
        fetch = StateDownloader(nodes[1], first, min_rate=1 << 20)
        meta, tensors = fetch(peer, expected_bytes=48, timeout=10.0)
        assert meta == {"round": 3} and torch.equal(tensors[0], theta)
        with pytest.raises(StateDownloadError, match="served no state"):
            fetch(peer, expected_bytes=48, timeout=10.0)
        meta, tensors = StateDownloader(nodes[2], second, min_rate=1 << 20)(peer, expected_bytes=48, timeout=10.0)
        assert torch.equal(tensors[0], theta)
    finally:
        for g in gatherers:
            g.shutdown()
