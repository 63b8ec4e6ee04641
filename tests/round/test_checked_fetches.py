"""The trust boundary of a fetched set or set list (peer/round/draw.py ``fetch_checked_set``,
``fetch_checked_list``): whatever bytes another peer serves, the fetch ends in a checked set or in
None, never in an exception that would stop this peer's round loop and process."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import msgpack
import pytest

from peer.round import draw
from protocol.round import group_sets, set_manifests
from protocol.wire.signed import _varint, peer_id_of

RUN, ROUND, GROUP = b"run", 3, 8
SPEC = SimpleNamespace(swarm=SimpleNamespace(max_group_size=GROUP))


def unknown_algorithm_key() -> bytes:
    """A libp2p RSA key protobuf around a DER key of an algorithm cryptography does not know."""
    body = bytes.fromhex("3007" "06032a0304" "0500" "032100") + b"\x01" * 32  # OID 1.2.3.4
    spki = bytes([0x30, len(body)]) + body
    return b"\x08\x00\x12" + _varint(len(spki)) + spki


class Serving:
    run_digest, max_payload_bytes = RUN, 1 << 20

    def __init__(self, raw: bytes):
        self.raw, self.kept = raw, []

    def fetch_set(self, peer, digest, timeout):
        return self.raw

    def fetch_manifest(self, peer, digest, timeout):
        return self.raw

    def keep_checked_set(self, peer, digest):
        self.kept.append(digest)


def test_a_set_whose_made_up_member_has_a_key_of_an_unknown_algorithm_is_refused(caplog):
    key = unknown_algorithm_key()
    made_up = peer_id_of(key)  # a set names its own members: the id is the key's hash
    envelope = msgpack.packb([made_up, key, b"s", b"p"], use_bin_type=True)
    raw = msgpack.packb(["voloco/set/2", RUN, ROUND, b"g", [made_up, b"other"], [[made_up, envelope]]], use_bin_type=True)
    gatherer = Serving(raw)
    with caplog.at_level(logging.WARNING, logger="voloco.peer"):
        assert draw.fetch_checked_set(gatherer, SPEC, "hostile", "0" * 32, ROUND, 1.0) is None
    # refused by the set's own check (a bad key), not by the catch-all for what a check should never raise
    assert gatherer.kept == [] and "does not verify" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("fetch,module,name", [
    (draw.fetch_checked_set, group_sets, "open_set"), (draw.fetch_checked_list, set_manifests, "open_manifest"),
])
def test_a_check_that_raises_what_it_should_not_refuses_the_set_and_says_so(monkeypatch, caplog, fetch, module, name):
    """A parser bug is the peer's to report, not a hostile peer's way to stop it."""
    def broken(*args, **kwargs):
        raise RuntimeError("a parser bug")

    monkeypatch.setattr(module, name, broken)
    with caplog.at_level(logging.ERROR, logger="voloco.peer"):
        assert fetch(Serving(b"anything"), SPEC, "hostile", "0" * 32, ROUND, 1.0) is None
    assert "failed unexpectedly" in caplog.text and "a parser bug" in caplog.text
