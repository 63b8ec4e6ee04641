"""Values nested about a thousand lists deep: msgpack decodes them (its own limit is near 1,024), and
Python's ``repr`` of one raises ``RecursionError``. An error message that quotes a hostile field
would then raise that instead of the reader's ``ProtocolError``, which escapes every ``except`` for
it: one signed payload of 1 KB stopped every peer that decoded it. Every decoder of peers' bytes
refuses nesting past ``MAX_DEPTH`` with its own error (protocol/wire/bounded_unpack.py)."""

from __future__ import annotations

import msgpack
import pytest

from protocol.chain.records import ChainError, parse_candidate
from protocol.errors import PayloadError, SpecError
from protocol.spec import RunSpec
from protocol.wire.bounded_unpack import MAX_DEPTH, bounded_unpack, nesting, packed_nesting
from protocol.wire.payload import decode_payload
from tests.protocol.test_payload import CODECS, LAYOUT, RUN, ROUND, repack, valid_payload


def deep(levels: int, leaf=0):
    value = leaf
    for _ in range(levels):
        value = [value]
    return value


def test_nesting_counts_lists_and_maps_without_recursion():
    assert nesting(7) == 0 and nesting(b"x") == 0 and nesting([]) == 1 and nesting({"a": [1, {"b": 2}]}) == 3
    assert nesting(deep(MAX_DEPTH)) == MAX_DEPTH
    assert MAX_DEPTH < nesting(deep(5000)) <= MAX_DEPTH + 1  # stops counting past the limit; no RecursionError


def test_packed_nesting_reads_extension_payloads_level_by_level():
    """hivemind packs a tuple as extension 0x40 holding msgpack, and decodes it recursively through C
    (300 of them, 1.4 KB, crash the process): counted here without decoding them that way."""
    assert nesting((1, (2,))) == 2 and nesting({(1,): 2}) == 2
    assert packed_nesting(msgpack.packb({"a": [1, 2]})) == 2 and packed_nesting(b"\xc1") == 0
    data = msgpack.packb([0])
    for _ in range(300):
        data = msgpack.packb([msgpack.ExtType(0x40, data)])
    assert MAX_DEPTH < packed_nesting(data) <= MAX_DEPTH + 2
    assert packed_nesting(msgpack.packb(deep(5000 // 5))) > MAX_DEPTH


def test_bounded_unpack_refuses_what_nests_past_the_limit():
    assert bounded_unpack(msgpack.packb(deep(MAX_DEPTH)), PayloadError, "x", max_array_len=4, max_map_len=4) == deep(MAX_DEPTH)
    with pytest.raises(PayloadError, match=f"nests lists or maps more than {MAX_DEPTH} deep"):
        bounded_unpack(msgpack.packb(deep(MAX_DEPTH + 1)), PayloadError, "x", max_array_len=4, max_map_len=4)
    with pytest.raises(PayloadError):  # msgpack's own stack limit, with the same error type
        bounded_unpack(msgpack.packb(deep(1020)), PayloadError, "x", max_array_len=4, max_map_len=4)


@pytest.mark.parametrize("field", ["v", "run", "round", "codec", "part"])
def test_a_payload_with_a_deeply_nested_header_field_is_a_payload_error(field):
    codec = CODECS[2]
    data = repack(valid_payload(codec), lambda m: m.__setitem__(field, deep(1000)))
    with pytest.raises(PayloadError, match="nests"):
        decode_payload(data, codec, LAYOUT, run_digest=RUN, round=ROUND, max_bytes=1 << 20)


def test_a_deeply_nested_chain_record_or_run_spec_is_refused_with_its_own_error():
    record = {"v": deep(1000), "spec": "s", "capacity": 1, "bandwidth": 1.0, "state": "idle", "endpoint": ""}
    with pytest.raises(ChainError, match="nests"):
        parse_candidate(msgpack.packb(record))
    with pytest.raises(SpecError, match="nests"):
        RunSpec.from_bytes(msgpack.packb({"run_id": deep(1000)}))
