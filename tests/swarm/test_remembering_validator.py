"""A node remembers the records its validators passed (swarm/dht/validators.py: RememberingValidator):
the same record coming back from every node of a read is checked once; a refusal is never
remembered; validators added later clear what was remembered; the memory is bounded."""

from __future__ import annotations

from hivemind.dht.validation import CompositeValidator

from protocol.dht.keys import owned_subkey, peers_key
from protocol.dht.records import encode_body, seal
from swarm.dht.validators import RememberingValidator, node_validators, run_schema
from tests.swarm.test_signed_records import SPEC, ids, progress, signed  # noqa: F401  (the ids fixture)


def records(identity, n=1, ttl=20.0):
    key = peers_key(SPEC.run_id)
    return [signed(identity, key, owned_subkey(identity.public_key), seal(identity.peer_id, encode_body(progress().to_dict())),
                   ttl=ttl + i) for i in range(n)]


def memo_of(validator: CompositeValidator) -> RememberingValidator:
    (memo,) = validator._validators
    return memo


def test_a_record_that_passed_is_not_checked_again(ids):
    outer = CompositeValidator(node_validators(ids["coord"], None))
    outer.extend([run_schema(SPEC.run_id)])  # absorbed: one remembering validator checks all
    memo = memo_of(outer)
    (record,) = records(ids["peer"])
    for _ in range(5):  # five nodes answer a read with the same record
        assert outer.validate(record)
    assert (memo.checks, memo.hits) == (1, 4)


def test_a_refusal_is_not_remembered_and_a_forgery_of_a_passed_record_is_refused(ids):
    outer = CompositeValidator(node_validators(ids["coord"], None))
    outer.extend([run_schema(SPEC.run_id)])
    memo = memo_of(outer)
    (record,) = records(ids["peer"])
    assert outer.validate(record)
    far = records(ids["evil"], ttl=10**7)[0]  # expires too far ahead: refused, each time checked again
    assert not outer.validate(far) and not outer.validate(far)
    assert memo.checks == 3
    forged = type(record)(record.key, record.subkey, record.value[:-1] + bytes([record.value[-1] ^ 1]), record.expiration_time)
    assert not outer.validate(forged)  # one bit off the remembered record is a different record
    later = type(record)(record.key, record.subkey, record.value, record.expiration_time + 1)
    assert not outer.validate(later)  # the signature covers the expiration


def test_validators_added_later_forget_what_passed(ids):
    outer = CompositeValidator(node_validators(ids["coord"], None))
    memo = memo_of(outer)
    (record,) = records(ids["peer"])
    outer.validate(record)
    outer.extend([run_schema(SPEC.run_id)])
    assert outer.validate(record)
    assert memo.checks == 2 and memo.hits == 0


def test_the_memory_is_bounded(ids):
    memo = RememberingValidator(memo_of(CompositeValidator(node_validators(ids["coord"], None))).inner._validators,
                                capacity=4)
    many = records(ids["peer"], n=10)
    for r in many:
        assert memo.validate(r)
    assert len(memo._passed) == 4
    assert memo.validate(many[0]) and memo.checks == 11  # forgotten: checked again
    assert memo.validate(many[-1]) and memo.hits == 1


def test_a_record_nobody_owns_is_kept_only_at_an_honest_size_and_lifetime(ids):
    """Any key outside the run's schema passes the schema, and a record with no owner passes every
    owner check: such records were kept at any size until an expiration of the writer's choosing.
    A hivemind matchmaking record (small, seconds ahead) still passes."""
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import get_dht_time
    from swarm.dht.validators import MAX_RECORD_BYTES

    outer = CompositeValidator(node_validators(ids["coord"], None))
    now = get_dht_time()
    key, subkey = b"\x01" * 20, b"\xc0"
    assert outer.validate(DHTRecord(key, subkey, b"\x93\x01\x02\x03", now + 30))
    assert not outer.validate(DHTRecord(key, subkey, b"\x93\x01\x02\x03", 1e12))  # kept for ever
    assert not outer.validate(DHTRecord(key, subkey, b"\xc6" + (1 << 20).to_bytes(4, "big") + bytes(1 << 20), now + 30))
    assert outer.validate(DHTRecord(key, subkey, bytes(MAX_RECORD_BYTES - 100), now + 30))
