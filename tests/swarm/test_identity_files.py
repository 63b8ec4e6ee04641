"""swarm/access/identity.py's identity files: a seeded one is the same key every time (benchmarks
pair their runs by peer, and a peer's data stream follows its id), an unseeded one is new."""

import pytest

from swarm.access.identity import load_identity, write_identity


def test_a_seeded_identity_is_the_same_every_time_and_an_unseeded_one_is_new(tmp_path):
    seed = bytes(range(32))
    write_identity(str(tmp_path / "a.key"), seed)
    write_identity(str(tmp_path / "b.key"), seed)
    write_identity(str(tmp_path / "c.key"))
    a, b, c = (load_identity(str(tmp_path / f"{n}.key")) for n in "abc")
    assert a.peer_id == b.peer_id != c.peer_id
    assert a.private_key.sign(b"x") == b.private_key.sign(b"x")  # Ed25519 signatures are deterministic


def test_a_seed_of_the_wrong_length_is_refused(tmp_path):
    with pytest.raises(ValueError, match="32 bytes, not 31"):
        write_identity(str(tmp_path / "a.key"), bytes(31))
    assert not (tmp_path / "a.key").exists()
