"""What checking one DHT record costs a node, before and after the quick checks.

    python bench/record_checks.py [--records 3000] [--owners 64] [--repeats 5] [--json OUT]

Every voloco node checks each record a read or a store brings it, once (swarm/dht/validators.py
``RememberingValidator`` passes a record it passed before unchecked): its owner's signature, the
run's schema, the envelope. A peer of a 32-peer swarm receives about 100 new progress records a
round (three versions of each peer's; bench/RESULTS.md "Ninety-fifth session"), so this is a cost
that grows with the swarm. ``--records`` progress records of ``--owners`` Ed25519 owners, each new,
are checked by:

- ``before``: the node's validators as they were: the owner key parsed for every record and the
  schema checked by hivemind's pydantic ``SchemaValidator`` (the baseline);
- ``after``: ``node_validators`` as every node runs them now (owner keys kept parsed,
  ``OwnedSchemaValidator``'s quick check);

and, part by part: the schema alone (hivemind's, and the quick check), the signature alone (key
parsed each time, and kept). Microseconds a record, best of ``--repeats``; ratio against the
baseline of the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hivemind.dht.schema import SchemaValidator  # noqa: E402
from hivemind.dht.validation import DHTRecord  # noqa: E402
from hivemind.utils import MSGPackSerializer, get_dht_time  # noqa: E402

from protocol.dht.keys import RUNS_PREFIX, owned_subkey, peers_key  # noqa: E402
from protocol.dht.records import Progress, encode_body, seal  # noqa: E402
from protocol.spec import RunSpec  # noqa: E402
from swarm.access import identity  # noqa: E402
from swarm.dht import validators  # noqa: E402
from swarm.dht.validators import (  # noqa: E402
    OwnedRecordValidator,
    OwnedSchemaValidator,
    OwnerSignatureValidator,
    RememberingValidator,
    RunSchema,
    RunsSchema,
    key_id,
    node_validators,
)


def progress_records(spec: RunSpec, owners: List[identity.Identity], count: int) -> List[DHTRecord]:
    """``count`` signed progress records, as peers publish them, each one new (its own round)."""
    kid, out = key_id(peers_key(spec.run_id)), []
    for i in range(count):
        me = owners[i % len(owners)]
        body = encode_body(Progress(i, 0, "training", spec.digest(), 1.0, 0.5, 0, 0.0, 0, 0, "ab" * 8, -1).to_wire())
        r = DHTRecord(kid, MSGPackSerializer.dumps(owned_subkey(me.public_key)),
                      MSGPackSerializer.dumps(seal(me.peer_id, body)), get_dht_time() + 60)
        out.append(DHTRecord(r.key, r.subkey, OwnerSignatureValidator(me.private_key).sign_value(r), r.expiration_time))
    return out


def per_record_us(check: Callable[[DHTRecord], bool], records: List[DHTRecord], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        for r in records:
            if not check(r):
                raise SystemExit("an honest record was refused: the comparison would mean nothing")
        best = min(best, time.perf_counter() - began)
    return 1e6 * best / len(records)


@contextlib.contextmanager
def keys_parsed_each_time():
    """The signature check as it was: the owner key parsed for every record (no ``lru_cache``)."""
    validators.public_key_from_bytes = identity.public_key_from_bytes.__wrapped__
    try:
        yield
    finally:
        validators.public_key_from_bytes = identity.public_key_from_bytes


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=3000, help="new progress records checked a repeat (default 3000)")
    ap.add_argument("--owners", type=int, default=64, help="peers whose records they are (default 64)")
    ap.add_argument("--repeats", type=int, default=5, help="timed passes; the best counts (default 5)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    if args.records < 1 or args.owners < 1 or args.repeats < 1:
        ap.error("--records, --owners and --repeats must be at least 1")

    spec = RunSpec()
    with tempfile.TemporaryDirectory() as d:
        owners = [identity.prepare_identity(os.path.join(d, f"{i}.key"))[0] for i in range(args.owners)]
    records = progress_records(spec, owners, args.records)
    me = owners[0]

    def before() -> RememberingValidator:  # node_validators as it was: hivemind's pydantic schemas
        return RememberingValidator([OwnerSignatureValidator(me.private_key), SchemaValidator(RunsSchema, prefix=RUNS_PREFIX),
                                     OwnedRecordValidator(None), SchemaValidator(RunSchema, prefix=spec.run_id)])

    hivemind_schema = SchemaValidator(RunsSchema, prefix=RUNS_PREFIX)
    hivemind_schema.merge_with(SchemaValidator(RunSchema, prefix=spec.run_id))
    quick_schema = OwnedSchemaValidator(RunsSchema, prefix=RUNS_PREFIX)
    quick_schema.merge_with(OwnedSchemaValidator(RunSchema, prefix=spec.run_id))
    signature = OwnerSignatureValidator(me.private_key)
    unsigned = [dataclasses.replace(r, value=signature.strip_value(r)) for r in records]  # what a schema is given

    figures: Dict[str, float] = {}
    # a new node each repeat, so no record is remembered from the last (owner keys are: as a node's are)
    with keys_parsed_each_time():
        figures["before (baseline)"] = min(per_record_us(before().validate, records, 1) for _ in range(args.repeats))
    figures["after"] = min(per_record_us(node_validators(me, None, [spec.run_id])[0].validate, records, 1)
                           for _ in range(args.repeats))
    figures["schema: hivemind's"] = per_record_us(hivemind_schema.validate, unsigned, args.repeats)
    figures["schema: quick"] = per_record_us(quick_schema.validate, unsigned, args.repeats)
    with keys_parsed_each_time():
        figures["signature: key parsed each time"] = per_record_us(signature.validate, records, args.repeats)
    figures["signature: key kept"] = per_record_us(signature.validate, records, args.repeats)

    base = figures["before (baseline)"]
    print(f"{args.records} new progress records of {args.owners} owners, best of {args.repeats}\n")
    print(f"{'check':34s} {'us a record':>12s} {'vs baseline':>12s}")
    print(f"{'-' * 34} {'-' * 12} {'-' * 12}")
    for name, us in figures.items():
        print(f"{name:34s} {us:12.1f} {us / base:11.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"records": args.records, "owners": args.owners, "us_per_record": figures}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
