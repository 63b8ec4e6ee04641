"""swarm/tokenizer_share.py's serving side: a few answers at once, each within a deadline. Fetching
over real streams is tests/training/test_tokenizers.py."""

from __future__ import annotations

import asyncio
import hashlib
from types import SimpleNamespace

from swarm import tokenizer_share
from swarm.tokenizer_share import SERVING_AT_ONCE, SERVING_PER_PEER, _answer

RAW = b"tokenizer" * 100
DIGEST = hashlib.sha256(RAW).hexdigest()


class _Writer:
    def __init__(self):
        self.sent, self.closed = bytearray(), False

    def write(self, data):
        self.sent += data

    async def drain(self):
        pass

    def close(self):
        self.closed = True


def test_answers_run_a_few_at_once_per_asker_and_in_all():
    """Each asker's stream held a file descriptor for as long as it kept reading slowly, and any
    number could: a few answers run at once, per asker and in all; the others are closed at once."""
    async def go():
        silent = [asyncio.StreamReader() for _ in range(SERVING_AT_ONCE + 4)]  # ask nothing
        peers = [SimpleNamespace(peer_id=f"p{i // SERVING_PER_PEER}") for i in range(len(silent))]
        writers = [_Writer() for _ in silent]
        tasks = [asyncio.create_task(_answer(RAW, DIGEST, p, r, w)) for p, r, w in zip(peers, silent, writers)]
        await asyncio.sleep(0.05)
        refused = sum(t.done() for t in tasks)
        extra = _Writer()  # one more ask from a peer that already holds its share
        await _answer(RAW, DIGEST, peers[0], asyncio.StreamReader(), extra)
        running = sum(tokenizer_share._serving._running.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        honest_reader, honest = asyncio.StreamReader(), _Writer()
        honest_reader.feed_data(DIGEST.encode())
        await _answer(RAW, DIGEST, SimpleNamespace(peer_id="honest"), honest_reader, honest)
        return refused, extra.closed and not extra.sent, running, bytes(honest.sent), dict(tokenizer_share._serving._running)

    refused, extra_refused, running, sent, left = asyncio.run(go())
    assert refused == 4 and extra_refused and running == SERVING_AT_ONCE
    assert sent == len(RAW).to_bytes(8, "big") + RAW and left == {}
