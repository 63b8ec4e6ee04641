"""swarm/dht/validators.py ``OwnedSchemaValidator``: its quick check of an owned envelope decides as
hivemind's pydantic ``SchemaValidator`` does, over valid records and mutated ones."""

from __future__ import annotations

import random
from typing import Dict

import pydantic.v1 as pydantic
import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from protocol.dht.keys import owned_subkey, peers_key
from protocol.dht.records import MAC_BYTES, MAX_BODY_BYTES, MAX_PEER_ID
from swarm.access.identity import prepare_identity
from swarm.dht import validators
from swarm.dht.validators import OwnedSchemaValidator, RunSchema, RunsSchema, key_id, run_schema

RUN = "schemarun"


@pytest.fixture(scope="module")
def owner(tmp_path_factory):
    return prepare_identity(str(tmp_path_factory.mktemp("owner") / "k.key"))[0]


def record(key: str, subkey, value) -> DHTRecord:
    dumps = MSGPackSerializer.dumps
    return DHTRecord(key_id(key), subkey if isinstance(subkey, bytes) and subkey in DHTProtocol.RESERVED_SUBKEYS
                     else dumps(subkey), dumps(value), get_dht_time() + 30)


def envelope(peer="12D3KooWpeer", body=b"\x93\x01\x02\x03", mac=b"") -> dict:
    return {"peer": peer, "body": body, "mac": mac}


def mutations(owner_key: bytes):
    """(subkey, value) pairs, the honest one first, then ones each check has to refuse or pass."""
    good = owned_subkey(owner_key)
    yield good, envelope()
    yield good, envelope(mac=b"m" * MAC_BYTES)
    yield good + b"chain-1", envelope()
    yield b"prefix " + good, envelope()
    yield b"line\n" + good, envelope()  # pydantic's ".*" does not cross a newline
    yield good.decode(), envelope()  # a str subkey: pydantic converts it, then refuses the conversion
    yield b"no owner here", envelope()
    yield good, envelope(peer="")
    yield good, envelope(peer="p" * MAX_PEER_ID)
    yield good, envelope(peer="p" * (MAX_PEER_ID + 1))
    yield good, envelope(peer=b"bytes-peer")
    yield good, envelope(body=b"b" * MAX_BODY_BYTES)
    yield good, envelope(body=b"b" * (MAX_BODY_BYTES + 1))
    yield good, envelope(body="a str body")
    yield good, envelope(mac=b"m" * (MAC_BYTES + 1))
    yield good, envelope(mac=[1, 2])
    yield good, {"peer": "p", "body": b""}
    yield good, {**envelope(), "extra": 1}
    yield good, {b"peer": "p", "body": b"", "mac": b""}
    yield good, ["p", b"", b""]
    yield good, b"raw bytes"
    yield good, None
    yield good, 7
    yield 12, envelope()
    yield None, envelope()


@pytest.mark.parametrize("key", [peers_key(RUN), f"{RUN}_history", "voloco_runs"])
def test_the_quick_check_decides_as_pydantic_does(owner, key):
    quick = OwnedSchemaValidator(RunsSchema, prefix="voloco")
    quick.merge_with(run_schema(RUN))
    slow = SchemaValidator(RunsSchema, prefix="voloco")
    slow.merge_with(SchemaValidator(RunSchema, prefix=RUN))
    cases = list(mutations(owner.public_key))
    rng = random.Random(0)
    for _ in range(200):  # random byte flips in an honest record's value
        value = bytearray(MSGPackSerializer.dumps(envelope()))
        value[rng.randrange(len(value))] = rng.randrange(256)
        cases.append((owned_subkey(owner.public_key), bytes(value)))
    decided = {True: 0, False: 0}
    for subkey, value in cases:
        r = record(key, subkey, value)
        if isinstance(value, bytes) and value.startswith(b"\x83"):  # a flipped dump: the bytes themselves
            r = DHTRecord(r.key, r.subkey, value, r.expiration_time)
        got = quick.validate(r)
        assert got == slow.validate(r), (subkey, value)
        decided[got] += 1
    assert decided[True] >= 5 and decided[False] >= 15  # both ways, so the comparison means something
    reserved = DHTRecord(key_id(key), DHTProtocol.IS_DICTIONARY, MSGPackSerializer.dumps(envelope()), get_dht_time() + 30)
    assert quick.validate(reserved) == slow.validate(reserved)


def test_a_field_another_schema_types_otherwise_is_left_to_pydantic(owner, monkeypatch):
    """A merged schema that names ``peers`` with another type: pydantic decides for that field."""

    class Other(pydantic.BaseModel):
        peers: Dict[bytes, int]

    quick = run_schema(RUN)
    quick.merge_with(SchemaValidator(Other, prefix=RUN))
    calls = []
    monkeypatch.setattr(validators, "_is_owned_envelope", lambda *a: calls.append(a) or True)
    r = record(peers_key(RUN), owned_subkey(owner.public_key), envelope())
    assert quick.validate(r)
    assert calls == []
    assert quick.validate(record(f"{RUN}_history", owned_subkey(owner.public_key), envelope()))
    assert len(calls) == 1


class _Aliased(pydantic.BaseModel):
    peers: validators.OwnedEnvelopes = pydantic.Field(alias="p")


class _FieldChecked(pydantic.BaseModel):
    peers: validators.OwnedEnvelopes

    @pydantic.validator("peers")
    def refuse(cls, v):
        raise ValueError("refused by the field's validator")


class _RootChecked(pydantic.BaseModel):
    peers: validators.OwnedEnvelopes

    @pydantic.root_validator
    def refuse(cls, values):
        raise ValueError("refused by the model's validator")


class _ShortStrings(pydantic.BaseModel):
    peers: validators.OwnedEnvelopes

    class Config:
        max_anystr_length = 16


@pytest.mark.parametrize("schema", [_Aliased, _FieldChecked, _RootChecked, _ShortStrings])
def test_a_field_with_rules_of_its_own_is_left_to_pydantic(owner, schema):
    """An alias, a validator of the field or the model, or a string rule in the model's config: pydantic
    would refuse what the quick check passes, so the field takes no quick path."""
    quick, slow = OwnedSchemaValidator(schema, prefix=RUN), SchemaValidator(schema, prefix=RUN)
    assert "peers" not in quick._quick_fields()
    r = record(peers_key(RUN), owned_subkey(owner.public_key), envelope())
    assert quick.validate(r) == slow.validate(r)
