"""A DHT node that forges the run's records, for tests:

    python -m tests.support.hostile_records JOIN_ADDR RUN_ID SECONDS

It joins with a plain hivemind DHT that signs with its own key but checks nothing, so it keeps
(and serves) whatever it writes, and for SECONDS rewrites, with long expirations:

- a run spec of RUN_ID with ``inner.lr = 50`` and ``data.corpus = "~/.ssh"``, signed by its own
  key with an honest expiration (a valid record: only the run key tells it from the real one),
  and an unsigned copy;
- a progress record at round 2**62 for every honest peer it sees: under its own key naming the
  victim's peer id, and unsigned under the victim's bare peer id;
- a chain assignment, signed by its own key, that names itself as stage 0.

It prints ``forged <n>`` after each pass.
"""

from __future__ import annotations

import sys
import tempfile
import time

import hivemind
from swarm.dht.validators import OwnerSignatureValidator
from hivemind.utils import get_dht_time

from protocol.chain.records import ChainAssignment, chains_key
from protocol.chain.stages import make_chain
from protocol.dht.keys import RUNS_KEY, owned_subkey, peers_key
from protocol.dht.records import Progress, encode_body, open_envelope, seal
from protocol.spec import RunSpec
from swarm.access.identity import prepare_identity

FAR = 10**6  # seconds: far beyond any honest TTL


def real_spec(dht: hivemind.DHT, run_id: str) -> RunSpec:
    while True:
        found = dht.get(RUNS_KEY, latest=True)
        for item in (found.value.values() if found is not None else ()):
            try:
                spec = RunSpec.from_bytes(open_envelope(item.value)[1])
            except Exception:
                continue
            if spec.run_id == run_id:
                return spec
        time.sleep(0.5)


def victims(dht: hivemind.DHT, run_id: str, me: str):
    found = dht.get(peers_key(run_id), latest=True)
    out = set()
    for item in (found.value.values() if found is not None else ()):
        try:
            out.add(open_envelope(item.value)[0])
        except Exception:
            pass
    return sorted(out - {me})


def main() -> None:
    join, run_id, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    identity = prepare_identity(tempfile.mkdtemp() + "/evil.key")[0]
    me = identity.peer_id
    dht = hivemind.DHT(initial_peers=[join], host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True,
                       record_validators=[OwnerSignatureValidator(identity.private_key)])
    spec = real_spec(dht, run_id)
    forged_spec = spec.replace(inner={"lr": 50.0}, data={"corpus": "~/.ssh"})
    mine = owned_subkey(identity.public_key)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        until = get_dht_time() + FAR
        n = 0
        # a valid record in all but its signer (an honest TTL: a far one alone gets it refused)
        n += dht.store(RUNS_KEY, seal(me, forged_spec.to_bytes()), get_dht_time() + 60,
                       subkey=owned_subkey(identity.public_key, run_id))
        n += dht.store(RUNS_KEY, forged_spec.to_bytes(), until, subkey=run_id)
        targets = victims(dht, run_id, me)
        for victim in targets:
            body = encode_body(Progress(2**62, 0, "training", spec.digest(), 0.0, 0.0, 0, 0.0, 0, 0, "f" * 16, -1).to_dict())
            n += dht.store(peers_key(run_id), seal(victim, body), until, subkey=mine)
            # a str subkey beside the bytes ones: another expiration, or this node's own storage
            # compares the two subkeys on an expiration tie (hivemind's heap) and the forger crashes
            n += dht.store(peers_key(run_id), body, until + 1.0, subkey=victim)
        if targets:
            chain = make_chain([(me, 0, 1), (targets[0], 1, spec.model.n_layers)])
            assignment = ChainAssignment(spec.digest(), 2**40, chain)
            n += dht.store(chains_key(run_id), seal(me, assignment.to_bytes()), until,
                           subkey=owned_subkey(identity.public_key, chain.chain_id))
        print(f"forged {n} against {len(targets)} peers", flush=True)
        time.sleep(1.0)
    dht.shutdown()


if __name__ == "__main__":
    main()
