"""Signed DHT records, the run key and admission: what a hostile DHT node can write is ignored.

Most tests run the readers and validators on records crafted the way a hostile node would
store or return them (no processes); two start real hivemind DHT nodes in this process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace
from typing import Dict, Tuple

import hivemind
import pytest
from swarm.dht.validators import OwnerSignatureValidator
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import PeerID
from hivemind.proto import dht_pb2
from hivemind.utils import MSGPackSerializer, ValueWithExpiration, get_dht_time

from protocol.chain.records import ChainAssignment
from protocol.chain.stages import make_chain
from protocol.dht.keys import RUNS_KEY, key_fingerprint, owned_subkey, peers_key, split_subkey
from protocol.dht.records import Progress, encode_body, record_mac, seal, token_key
from protocol.spec import RunSpec
from swarm import records
from swarm.access.admission import AdmissionGate, Admitted, GatedServicer, JoinTokenAuthorizer
from swarm.console import UsageError
from swarm.access.identity import NodeTrust, peer_id_of, prepare_identity, register
from swarm.access.join_flags import join_token, run_key
from swarm.dht.validators import key_id, node_validators, run_schema

SPEC = RunSpec().replace(run_id="test")
TOKEN = "a-private-run-token-0123"


@pytest.fixture(scope="module")
def ids(tmp_path_factory):
    """Three identities (Ed25519 keys, as libp2p identity files): coordinator, honest peer, attacker."""
    d = tmp_path_factory.mktemp("ids")
    return {name: prepare_identity(str(d / f"{name}.key"))[0] for name in ("coord", "peer", "evil")}


class FakeDHT:
    """One shared store that returns what was put in it, unvalidated: what a hostile node's replies
    can contain, so only the readers' own checks stand between it and the caller."""

    def __init__(self, store: Dict[str, Dict[bytes, Tuple[object, float]]]):
        self.records = store

    def store(self, key, value, expiration_time, subkey, return_future=False, **search):  # search: beam_size
        self.records.setdefault(key, {})[subkey] = (MSGPackSerializer.loads(MSGPackSerializer.dumps(value)), expiration_time)
        return True

    def get(self, key, latest=True, return_future=False, **search):
        items = self.records.get(key)
        found = None if not items else ValueWithExpiration(
            {k: ValueWithExpiration(v, e) for k, (v, e) in items.items()}, max(e for _, e in items.values()))
        if not return_future:
            return found
        future = asyncio.get_event_loop().create_future()
        future.set_result(found)
        return future

    def add_validators(self, validators):
        pass


def node(shared, identity, token=None, key=None) -> FakeDHT:
    dht = FakeDHT(shared)
    register(dht, NodeTrust(identity, token_key=token_key(token) if token else None, run_key=key))
    return dht


def progress(rnd: int = 1) -> Progress:
    return Progress(rnd, 0, "training", SPEC.digest(), 1.0, 0.5, 0, 0.0, 0, 0, "hash", -1)


def forge(shared, key, subkey, value, ttl=20.0) -> None:
    shared.setdefault(key, {})[subkey] = (value, get_dht_time() + ttl)


@pytest.fixture
def swarm(ids):
    """A coordinator that published SPEC and one honest peer that accepted it with the run key."""
    shared: Dict = {}
    coord = node(shared, ids["coord"])
    assert records.publish_run(coord, SPEC)
    peer = node(shared, ids["peer"], key=ids["coord"].fingerprint)
    assert records.fetch_spec(peer, timeout=0) == SPEC
    records.publish_progress(peer, SPEC.run_id, ids["peer"].peer_id, progress(), ttl=20)
    return SimpleNamespace(shared=shared, coord=coord, peer=peer)


# ---- keys and identities --------------------------------------------------------------------------
def test_owned_subkeys_and_fingerprints(ids):
    me = ids["peer"]
    assert split_subkey(owned_subkey(me.public_key)) == (me.public_key, "")
    assert split_subkey(owned_subkey(me.public_key, "ch-0123")) == (me.public_key, "ch-0123")
    for bad in (me.peer_id, me.peer_id.encode(), b"[owner:nope]", owned_subkey(me.public_key) + "é".encode()):
        assert split_subkey(bad) is None
    with pytest.raises(ValueError):
        owned_subkey(me.public_key, "a/b")
    assert len(me.fingerprint) == 32 and me.fingerprint == key_fingerprint(me.public_key)
    assert peer_id_of(me.public_key) == me.peer_id != ids["evil"].peer_id


# ---- readers ---------------------------------------------------------------------------------------
def test_honest_records_round_trip(swarm, ids):
    views = records.read_progress(swarm.coord, SPEC.run_id)
    assert [(v.peer_id, v.progress) for v in views] == [(ids["peer"].peer_id, progress())]
    chain = make_chain([(ids["peer"].peer_id, 0, 2), (ids["coord"].peer_id, 2, SPEC.model.n_layers)])
    records.publish_assignment(swarm.coord, SPEC, ChainAssignment(SPEC.digest(), 1, chain))
    assert set(records.read_assignments(swarm.peer, SPEC)) == {ids["peer"].peer_id, ids["coord"].peer_id}


def test_a_node_cannot_publish_for_another_peer(swarm, ids):
    with pytest.raises(ValueError):
        records.publish_progress(swarm.peer, SPEC.run_id, ids["coord"].peer_id, progress(), ttl=20)


def test_progress_forged_for_another_peer_is_ignored(swarm, ids):
    victim, evil = ids["peer"], ids["evil"]
    key = peers_key(SPEC.run_id)
    body = encode_body(progress(2**62).to_dict())
    forge(swarm.shared, key, owned_subkey(evil.public_key), seal(victim.peer_id, body))  # its own key, the victim's id
    forge(swarm.shared, key, victim.peer_id.encode(), seal(victim.peer_id, body))  # no owner key at all (unsigned)
    forge(swarm.shared, key, owned_subkey(victim.public_key, "x"), seal(victim.peer_id, body))  # a second subkey
    views = records.read_progress(swarm.coord, SPEC.run_id)
    assert [(v.peer_id, v.progress.round) for v in views] == [(victim.peer_id, 1)]


def test_far_future_expiration_is_ignored(swarm, ids):
    evil = ids["evil"]
    records.publish_progress(node(swarm.shared, evil), SPEC.run_id, evil.peer_id, progress(), ttl=3600 * 24 * 365)
    assert {v.peer_id for v in records.read_progress(swarm.peer, SPEC.run_id)} == {ids["peer"].peer_id}
    records.publish_progress(node(swarm.shared, evil), SPEC.run_id, evil.peer_id, progress(), ttl=10)
    assert {v.peer_id for v in records.read_progress(swarm.peer, SPEC.run_id)} == {ids["peer"].peer_id, evil.peer_id}


@pytest.mark.parametrize("value", [
    None, b"raw", {"peer": "x"}, {"peer": "{id}", "body": "text", "mac": b""},
    {"peer": "{id}", "body": b"\xc1", "mac": b""}, {"peer": "{id}", "body": b"", "mac": b"short"},
    {"peer": "{id}", "body": encode_body({"round": 1}), "mac": b""}, {"peer": "{id}", "body": b"", "mac": b"", "x": 1},
])
def test_malformed_values_are_ignored(swarm, ids, value):
    evil = ids["evil"]
    if isinstance(value, dict) and value.get("peer") == "{id}":
        value = {**value, "peer": evil.peer_id}
    forge(swarm.shared, peers_key(SPEC.run_id), owned_subkey(evil.public_key), value)
    assert {v.peer_id for v in records.read_progress(swarm.peer, SPEC.run_id)} == {ids["peer"].peer_id}


def test_a_spec_not_signed_by_the_run_key_is_ignored(swarm, ids, caplog):
    forged = SPEC.replace(inner={"lr": 50.0}, data={"corpus": "~/.ssh"})
    records.publish_run(node(swarm.shared, ids["evil"]), forged)
    newcomer = node(swarm.shared, ids["peer"], key=ids["coord"].fingerprint)
    with caplog.at_level(logging.WARNING, logger="voloco.swarm"):
        assert records.fetch_spec(newcomer, timeout=0) == SPEC
    assert any("ignoring a run spec" in r.message and "lr 50" in r.message and ids["evil"].fingerprint in r.message
               for r in caplog.records), caplog.text
    # with only the forged spec there, it is never accepted
    alone: Dict = {}
    records.publish_run(node(alone, ids["evil"]), forged)
    with pytest.raises(UsageError, match="signed by run key"):
        records.fetch_spec(node(alone, ids["peer"], key=ids["coord"].fingerprint), timeout=0)
    # without a run key, two publishers of one run are refused, one is accepted with a warning
    with pytest.raises(UsageError, match="--run-key"):
        records.fetch_spec(node(swarm.shared, ids["peer"]), timeout=0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="voloco.swarm"):
        assert records.fetch_spec(node(alone, ids["peer"]), timeout=0) == forged
    assert "unauthenticated" in caplog.text


def test_a_spec_filed_under_another_run_id_is_ignored(ids):
    shared: Dict = {}
    forge(shared, RUNS_KEY, owned_subkey(ids["coord"].public_key, "other"), seal(ids["coord"].peer_id, SPEC.to_bytes()))
    with pytest.raises(UsageError, match="filed as"):
        records.fetch_spec(node(shared, ids["peer"], key=ids["coord"].fingerprint), timeout=0)


def test_chain_assignment_not_signed_by_the_run_key_is_ignored(swarm, ids):
    evil = ids["evil"]
    chain = make_chain([(evil.peer_id, 0, 1), (ids["peer"].peer_id, 1, SPEC.model.n_layers)])
    records.publish_assignment(node(swarm.shared, evil), SPEC, ChainAssignment(SPEC.digest(), 2**40, chain))
    assert records.read_assignments(swarm.peer, SPEC) == {}
    records.publish_assignment(swarm.coord, SPEC, ChainAssignment(SPEC.digest(), 1, chain))
    assert set(records.read_assignments(swarm.peer, SPEC)) == {evil.peer_id, ids["peer"].peer_id}


def test_private_run_records_must_prove_the_token(ids):
    shared: Dict = {}
    coord = node(shared, ids["coord"], token=TOKEN)
    records.publish_run(coord, SPEC)
    peer = node(shared, ids["peer"], token=TOKEN, key=ids["coord"].fingerprint)
    assert records.fetch_spec(peer, timeout=0) == SPEC
    records.publish_progress(peer, SPEC.run_id, ids["peer"].peer_id, progress(), ttl=20)
    evil = ids["evil"]
    records.publish_progress(node(shared, evil), SPEC.run_id, evil.peer_id, progress(), ttl=20)  # no token
    assert {v.peer_id for v in records.read_progress(coord, SPEC.run_id)} == {ids["peer"].peer_id}
    records.publish_progress(node(shared, evil, token=TOKEN + "x"), SPEC.run_id, evil.peer_id, progress(), ttl=20)
    assert {v.peer_id for v in records.read_progress(coord, SPEC.run_id)} == {ids["peer"].peer_id}
    records.publish_progress(node(shared, evil, token=TOKEN), SPEC.run_id, evil.peer_id, progress(), ttl=20)
    assert {v.peer_id for v in records.read_progress(coord, SPEC.run_id)} == {ids["peer"].peer_id, evil.peer_id}
    # a proof copied from another record does not carry over
    stolen = shared[peers_key(SPEC.run_id)][owned_subkey(ids["peer"].public_key)][0]["mac"]
    forge(shared, peers_key(SPEC.run_id), owned_subkey(evil.public_key),
          seal(evil.peer_id, encode_body(progress(7).to_dict()), stolen))
    assert all(v.progress.round != 7 for v in records.read_progress(coord, SPEC.run_id))


# ---- validators (what an honest node stores and returns) -------------------------------------------
def signed(identity, key: str, subkey: bytes, value, ttl: float = 20.0) -> DHTRecord:
    record = DHTRecord(key_id(key), MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), get_dht_time() + ttl)
    return DHTRecord(record.key, record.subkey, OwnerSignatureValidator(identity.private_key).sign_value(record),
                     record.expiration_time)


def test_ed25519_and_rsa_owners_side_by_side(ids, tmp_path):
    """An RSA identity file (hivemind's, an older voloco peer's) still signs records every node takes;
    a signature moved to another record, or an owner key that is no key, is refused without raising."""
    from hivemind.p2p import P2P

    from swarm.access.identity import load_identity

    P2P.generate_identity(str(tmp_path / "rsa.key"))
    old, new = load_identity(str(tmp_path / "rsa.key")), ids["peer"]
    assert old.public_key.startswith(b"ssh-rsa ") and new.public_key.startswith(b"ssh-ed25519 ")
    assert old.peer_id.startswith("Qm") and new.peer_id.startswith("12D3KooW")
    validator = OwnerSignatureValidator(ids["coord"].private_key)
    key = peers_key(SPEC.run_id)
    records = {}
    for who in (old, new):
        record = records[who.peer_id] = signed(who, key, owned_subkey(who.public_key), seal(who.peer_id, b"x"))
        assert validator.validate(record)
        assert len(record.subkey) + len(record.value) < (500 if who is new else 1000)
    a, b = records[old.peer_id], records[new.peer_id]
    sig_b = b.value[b.value.index(b"[signature:"):]
    moved = DHTRecord(b.key, b.subkey, MSGPackSerializer.dumps(seal(new.peer_id, b"y")) + sig_b, b.expiration_time)
    assert not validator.validate(moved)
    for junk in (b"ssh-ed25519 AAAA", b"ssh-ed25519 " + b"A" * 68, b"not a key"):
        assert not validator.validate(DHTRecord(a.key, MSGPackSerializer.dumps(b"[owner:" + junk + b"]"), b.value,
                                                b.expiration_time))


def test_validators_refuse_forged_records(ids):
    me, victim, evil = ids["coord"], ids["peer"], ids["evil"]
    validator = CompositeValidator(node_validators(me, None))
    validator.extend([run_schema(SPEC.run_id)])
    key = peers_key(SPEC.run_id)
    body = encode_body(progress().to_dict())
    assert validator.validate(signed(victim, key, owned_subkey(victim.public_key), seal(victim.peer_id, body)))
    refused = {
        "another's subkey": signed(evil, key, owned_subkey(victim.public_key), seal(victim.peer_id, body)),
        "another's peer id": signed(evil, key, owned_subkey(evil.public_key), seal(victim.peer_id, body)),
        "unsigned subkey": signed(evil, key, victim.peer_id.encode(), seal(victim.peer_id, body)),
        "no envelope": signed(evil, key, owned_subkey(evil.public_key), progress().to_dict()),
        "far future": signed(evil, key, owned_subkey(evil.public_key), seal(evil.peer_id, body), ttl=10**7),
        "unsigned spec": signed(evil, RUNS_KEY, b"test", SPEC.to_bytes()),
    }
    for what, record in refused.items():
        assert not validator.validate(record), what
    private = CompositeValidator(node_validators(me, token_key(TOKEN)))
    subkey = owned_subkey(evil.public_key)
    assert not private.validate(signed(evil, key, subkey, seal(evil.peer_id, body)))
    mac = record_mac(token_key(TOKEN), key_id(key), subkey, evil.peer_id, body)
    assert private.validate(signed(evil, key, subkey, seal(evil.peer_id, body, mac)))


# ---- admission ------------------------------------------------------------------------------------
def test_join_token_authorizer(ids):
    async def main():
        a, b = JoinTokenAuthorizer(ids["peer"], token_key(TOKEN)), JoinTokenAuthorizer(ids["coord"], token_key(TOKEN))
        outsider = JoinTokenAuthorizer(ids["evil"], token_key(TOKEN + "-wrong"))
        request = dht_pb2.PingRequest()
        await a.sign_request(request, None)
        assert await b.validate_request(request)
        assert not await b.validate_request(request)  # a replay
        request = dht_pb2.PingRequest()
        await outsider.sign_request(request, None)
        assert not await b.validate_request(request)
        # a's access token is public: another key cannot use it
        token = await a.get_token()
        assert b.is_token_valid(token)
        token.username = ids["evil"].peer_id
        assert not b.is_token_valid(token)

    asyncio.run(main())


def test_admission_gate_serves_only_peers_that_proved_the_token(ids):
    shared: Dict = {}
    peer = node(shared, ids["peer"], token=TOKEN)
    records.publish_progress(peer, SPEC.run_id, ids["peer"].peer_id, progress(), ttl=20)
    evil = ids["evil"]
    records.publish_progress(node(shared, evil), SPEC.run_id, evil.peer_id, progress(), ttl=20)
    gate = AdmissionGate(token_key(TOKEN), SPEC.run_id, refresh_period=0.01, patience=0.05)

    class Servicer:
        dht = peer

        async def rpc_unary(self, request, context):
            return request + 1

        async def rpc_stream(self, request, context):
            yield request

    gated = gate.wrap(Servicer())

    async def main():
        ok = SimpleNamespace(remote_id=PeerID.from_base58(ids["peer"].peer_id))
        no = SimpleNamespace(remote_id=PeerID.from_base58(evil.peer_id))
        assert await gated.rpc_unary(1, ok) == 2
        assert [m async for m in gated.rpc_stream(5, ok)] == [5]
        assert [m async for m in gated.rpc_stream(5, no)] == []
        with pytest.raises(PermissionError):
            await gated.rpc_unary(1, no)

    asyncio.run(main())

    class Base:
        async def add_p2p_handlers(self, p2p, wrapper=None, **kwargs):
            self.wrapper = wrapper

    class Averager(Admitted, Base):
        dht = peer

    public, private = Averager(), Averager()
    private.authorizer = gate
    asyncio.run(public.add_p2p_handlers(None))
    asyncio.run(private.add_p2p_handlers(None))
    assert public.wrapper is None and isinstance(private.wrapper, GatedServicer)


def test_join_flags(tmp_path):
    args = SimpleNamespace(join_token=None, join_token_file=None, run_key=None)
    assert join_token(args) is None and run_key(args) is None
    with pytest.raises(UsageError, match="at least"):
        join_token(SimpleNamespace(join_token="short", join_token_file=None))
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    assert join_token(SimpleNamespace(join_token=None, join_token_file=path)) == TOKEN
    with pytest.raises(UsageError, match="cannot be read"):
        join_token(SimpleNamespace(join_token=None, join_token_file=tmp_path / "missing"))
    with pytest.raises(UsageError, match="fingerprint"):
        run_key(SimpleNamespace(run_key="QmNotAFingerprint"))
    assert run_key(SimpleNamespace(run_key="AB" * 16)) == "ab" * 16


# ---- real DHT nodes in this process ----------------------------------------------------------------
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def test_dht_nodes_refuse_forged_records_and_outsiders(ids, tmp_path):
    from swarm.dht.node import start_dht

    coord = start_dht((), LOOPBACK, run_ids=[SPEC.run_id], join_token=TOKEN)
    nodes = [coord]
    try:
        records.publish_run(coord, SPEC)
        with pytest.raises(UsageError, match="join-token"):
            nodes.append(start_dht(coord.get_visible_maddrs(), LOOPBACK, join_token=TOKEN + "-wrong"))
        peer = start_dht(coord.get_visible_maddrs(), LOOPBACK, identity_path=str(tmp_path / "peer.key"), join_token=TOKEN)
        nodes.append(peer)
        from swarm.access.identity import trust_of

        fingerprint = trust_of(coord).identity.fingerprint
        assert records.fetch_spec(peer, timeout=10, run_key=fingerprint) == SPEC
        me = peer.peer_id.to_base58()
        assert records.publish_progress(peer, SPEC.run_id, me, progress(), ttl=20).result()
        # a node with the token but no validators signs a record that claims the peer's id
        evil_key = ids["evil"]
        evil = hivemind.DHT(initial_peers=coord.get_visible_maddrs(), host_maddrs=LOOPBACK, start=True,
                            record_validators=[OwnerSignatureValidator(evil_key.private_key)],
                            authorizer=JoinTokenAuthorizer(evil_key, token_key(TOKEN)))
        nodes.append(evil)
        subkey = owned_subkey(evil_key.public_key)
        body = encode_body(progress(2**62).to_dict())
        mac = record_mac(token_key(TOKEN), key_id(peers_key(SPEC.run_id)), subkey, me, body)
        evil.store(peers_key(SPEC.run_id), seal(me, body, mac), get_dht_time() + 20, subkey=subkey)
        evil.store(peers_key(SPEC.run_id), seal(me, body, mac), get_dht_time() + 20, subkey=me.encode())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            views = records.read_progress(coord, SPEC.run_id)
            if views:
                break
        assert [(v.peer_id, v.progress.round) for v in views] == [(me, 1)]
        # honest nodes did not even store the forged records
        stored = coord.get(peers_key(SPEC.run_id), latest=False)
        assert all(split_subkey(k) == (trust_of(peer).identity.public_key, "") for k in stored.value), stored
    finally:
        for n in nodes:
            n.shutdown()


def test_refusals_of_many_new_identities_keep_a_bounded_log_and_table(caplog):
    """Each stranger of a private run added a warning line and an entry that was never dropped: new
    identities cost nothing, so the table and the log grew without a bound."""
    from protocol.wire.signed import Signer
    from swarm.access.admission import LOGGED_PEERS
    gate = AdmissionGate(token_key(TOKEN), SPEC.run_id)
    strangers = [PeerID(Signer.generate().peer_id) for _ in range(LOGGED_PEERS * 4)]
    with caplog.at_level("WARNING", logger="voloco.swarm"):
        for s in strangers + strangers:
            gate.refused(s, "rpc_fetch_set")
    assert len(gate._refusals.peers) == LOGGED_PEERS
    assert len(caplog.records) == LOGGED_PEERS  # the others counted, said once a minute
    assert gate._refusals.more == 2 * 3 * LOGGED_PEERS  # each of the others, each time


def test_owner_keys_are_parsed_once(ids):
    """A node checks each peer's records every round: an owner key is parsed once and kept; a key that
    does not parse is refused each time and kept nowhere."""
    from swarm.access.identity import public_key_from_bytes

    public_key_from_bytes.cache_clear()
    first = public_key_from_bytes(ids["peer"].public_key)
    assert public_key_from_bytes(ids["peer"].public_key) is first
    assert public_key_from_bytes.cache_info().hits == 1
    for _ in range(2):
        with pytest.raises(ValueError):
            public_key_from_bytes(b"ssh-ed25519 AAAAnot-a-key")
    assert public_key_from_bytes.cache_info().currsize == 1


def test_a_long_owner_key_is_parsed_but_not_kept_and_an_odd_rsa_size_is_refused(ids):
    """A key padded to a record's size parses (OpenSSH allows a comment) but is not kept, or 4,096 of them
    would pin 0.3 GB; an RSA key of a size p2pd refuses is refused before any signature is checked with it."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    from swarm.access.identity import KEPT_KEY_BYTES, peer_id_of, public_key_from_bytes

    public_key_from_bytes.cache_clear()
    padded = ids["peer"].public_key + b" " + b"c" * KEPT_KEY_BYTES
    assert public_key_from_bytes(padded).to_bytes() == public_key_from_bytes(ids["peer"].public_key).to_bytes()
    assert peer_id_of(padded) == ids["peer"].peer_id
    assert public_key_from_bytes.cache_info().currsize == 1  # the unpadded key only
    small = rsa.generate_private_key(public_exponent=65537, key_size=1024).public_key()
    openssh = small.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    with pytest.raises(ValueError, match="2048 to 4096 bits"):
        public_key_from_bytes(openssh)
