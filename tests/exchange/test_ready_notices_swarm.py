"""A barrier's direct question over real libp2p streams (peer/exchange/ready_notices.py): two peers'
gatherers in their own processes on loopback; the question is held until the asked peer is done."""

from __future__ import annotations

import time

import pytest

from peer.exchange.gatherer import PayloadGatherer
from protocol.dht.keys import averager_prefix
from protocol.dht.records import parse_progress
from protocol.round.timing import Timing
from tests.exchange.test_ready_notices import body
from tests.round.test_liveness import SPEC
from tests.support.dht_nodes import loopback_nodes


@pytest.fixture
def nodes():
    yield from loopback_nodes(SPEC, 1)


def test_a_question_over_the_network_is_answered_once_the_peer_is_done(nodes):
    gatherers = [PayloadGatherer(dht, prefix=averager_prefix(SPEC.run_id), schema=SPEC.digest().encode(),
                                 timing=Timing().with_(ready_hold_s=5.0)) for dht in nodes]
    try:
        for g in gatherers:
            g.run_in_background(await_ready=True)
        asker, asked = gatherers
        asked.note_progress(body(4, "training"))
        t0 = time.monotonic()
        held = asker.ask_ready(asked.peer_id.to_base58(), 4, wait=5.0)
        time.sleep(1.0)
        assert not held.done()
        asked.note_progress(body(4, "ready"))
        answer = parse_progress(held.result(timeout=3.0))
        assert (answer.round, answer.state) == (4, "ready") and 1.0 <= time.monotonic() - t0 < 4.0
        # a peer already past the round answers at once; one that serves no questions (unknown) gives None
        assert parse_progress(asker.ask_ready(asked.peer_id.to_base58(), 3, wait=5.0).result(timeout=2.0)).round == 4
        assert asker.ask_ready("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", 4, wait=1.0).result(timeout=5.0) is None
    finally:
        for g in gatherers:
            g.shutdown()
