"""Signed payloads (protocol/wire/signed.py): a key proves a libp2p peer id exactly as libp2p derives it,
and the identity a hivemind node starts with is the key a peer signs its payloads with."""

from __future__ import annotations

import pickle

import pytest
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from hivemind.p2p import P2P, PeerID

from peer.exchange.identity import payload_signer
from protocol.wire.signed import (
    ENVELOPE_OVERHEAD, PublicKey, SignatureError, Signer, encode_public_key, open_envelope, peer_id_of, seal,
)
from tests.support.agreement_sim import binding_of, signer


def test_peer_id_is_the_one_libp2p_derives_from_a_hivemind_identity_file(tmp_path):
    path = tmp_path / "identity.key"
    P2P.generate_identity(str(path))
    expected = PeerID.from_identity(path.read_bytes())
    from hivemind.proto import crypto_pb2

    key = Signer.from_der(crypto_pb2.PrivateKey.FromString(path.read_bytes()).data)
    assert key.peer_id == expected.to_bytes()
    assert PublicKey(expected.to_bytes(), key.public_key).verify(b"m", key.sign(b"m"))


def test_payload_signer_is_the_dht_nodes_identity(tmp_path):
    from swarm.dht.node import start_dht

    dht = start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=str(tmp_path / "id.key"))
    try:
        assert payload_signer(dht).peer_id == dht.peer_id.to_bytes()
    finally:
        dht.shutdown()


def test_a_key_proves_only_its_own_peer_id():
    a, b = signer(0), signer(1)
    with pytest.raises(SignatureError):
        PublicKey(b.peer_id, a.public_key)
    key = PublicKey(a.peer_id, a.public_key)
    assert key.verify(b"m", a.sign(b"m")) and not key.verify(b"m", b.sign(b"m")) and not key.verify(b"n", a.sign(b"m"))
    assert not key.verify(b"m", b"\0" * 256) and not key.verify(b"m", b"x" * 5000)


def test_ed25519_identities_sign_and_their_peer_id_is_the_key():
    from protocol.wire.signed import key_of_peer_id

    a, b = Signer.generate(), Signer.generate()
    assert len(a.public_key) == 36 and a.peer_id[:2] == b"\x00\x24" and key_of_peer_id(a.peer_id) == a.public_key
    key = PublicKey(a.peer_id, a.public_key)
    assert key.verify(b"m", a.sign(b"m")) and not key.verify(b"m", b.sign(b"m")) and not key.verify(b"n", a.sign(b"m"))
    with pytest.raises(SignatureError):
        PublicKey(b.peer_id, a.public_key)
    rsa_signer = Signer.generate("rsa")
    assert key_of_peer_id(rsa_signer.peer_id) == b"" and rsa_signer.peer_id[:2] == b"\x12\x20"


def test_an_ed25519_identity_file_gives_the_daemons_peer_id(tmp_path):
    """The 64 bytes libp2p keeps (seed, then public key), as p2pd reads them; a file whose halves
    disagree is refused."""
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric import ed25519

    key = ed25519.Ed25519PrivateKey.generate()
    seed = key.private_bytes(ser.Encoding.Raw, ser.PrivateFormat.Raw, ser.NoEncryption())
    public = key.public_key().public_bytes(ser.Encoding.Raw, ser.PublicFormat.Raw)
    signer = Signer.from_libp2p(1, seed + public)
    assert signer.public_key == b"\x08\x01\x12\x20" + public
    with pytest.raises(SignatureError):
        Signer.from_libp2p(1, seed + bytes(32))
    with pytest.raises(SignatureError):
        Signer.from_libp2p(1, seed)
    with pytest.raises(SignatureError):
        Signer.from_libp2p(2, seed + public)


def test_small_order_ed25519_keys_are_refused():
    for raw in ("01" + "00" * 31, "00" * 32, "ec" + "ff" * 30 + "7f", "ec" + "ff" * 31):
        public = b"\x08\x01\x12\x20" + bytes.fromhex(raw)
        with pytest.raises(SignatureError):
            PublicKey(peer_id_of(public), public)


def test_weak_or_unknown_keys_are_refused():
    weak = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    with pytest.raises(SignatureError):
        Signer(weak)
    weak_public = encode_public_key(weak.public_key())
    with pytest.raises(SignatureError):
        PublicKey(peer_id_of(weak_public), weak_public)
    with pytest.raises(SignatureError):
        Signer(ec.generate_private_key(ec.SECP256R1()))
    for raw in (b"", b"\x08\x01\x12\x20" + b"\0" * 32, b"\x08\x00\x12\x05abc", b"\x08\x00\x12\x03abc"):
        with pytest.raises(SignatureError):
            PublicKey(peer_id_of(raw), raw)


def test_a_key_of_an_algorithm_the_library_does_not_know_is_refused_as_any_bad_key():
    """cryptography raises UnsupportedAlgorithm, not ValueError, for a DER key of an unknown algorithm
    or curve: it escaped the set and manifest checks, and a peer that fetched such a set from a
    hostile one stopped (a set names its own members, so the key's id can be made up)."""
    body = bytes.fromhex("3007" "06032a0304" "0500" "032100") + b"\x01" * 32  # algorithm OID 1.2.3.4
    spki = bytes([0x30, len(body)]) + body
    unknown = b"\x08\x00\x12" + bytes([len(spki)]) + spki
    # an EC key on a curve cryptography does not support (secp112r1, OID 1.3.132.0.6)
    algorithm = bytes.fromhex("301006072a8648ce3d020106052b81040006")
    point = bytes.fromhex("031e00") + b"\x04" + b"\x01" * 28  # a BIT STRING of 30 bytes
    ec_body = algorithm + point
    ec_spki = bytes([0x30, len(ec_body)]) + ec_body
    odd_curve = b"\x08\x00\x12" + bytes([len(ec_spki)]) + ec_spki
    for raw in (unknown, odd_curve):
        with pytest.raises(SignatureError):
            PublicKey(peer_id_of(raw), raw)


def test_signer_survives_pickling():
    a = signer(0)
    b = pickle.loads(pickle.dumps(a))
    assert b.peer_id == a.peer_id and PublicKey(a.peer_id, a.public_key).verify(b"m", b.sign(b"m"))


def test_envelope_round_trip_and_size_limit():
    a = signer(0)
    ctx = binding_of([a.peer_id]).context
    envelope, signature = seal(a, ctx, b"p" * 1000)
    assert len(envelope) <= 1000 + ENVELOPE_OVERHEAD
    key, sig, payload = open_envelope(envelope, ctx, a.peer_id, 1000)
    assert payload == b"p" * 1000 and sig == signature and key.peer_id == a.peer_id
    with pytest.raises(SignatureError):
        open_envelope(envelope, ctx, a.peer_id, 999)
    with pytest.raises(SignatureError):
        open_envelope(envelope + b"\0", ctx, a.peer_id, 1000)
