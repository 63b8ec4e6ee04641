"""What the bounded DHT storage costs a node, and what a flood leaves it holding.

Stores records into hivemind's ``DHTLocalStorage`` and into ``QuotaStorage``
(swarm/dht/store_quota.py) in one process, as a node's ``rpc_store`` does (the validators and the
network are left out: they are the same for both), in three patterns:

- ``honest``: ``--writers`` peers each refreshing ``--records`` subkeys of one key (a run's progress
  records), every refresh a newer expiration;
- ``flood``: one peer storing ``--flood`` plain records of 4 KB under new keys;
- ``sybils``: ``--flood`` identities storing one 4 KB subkey each under one key.

Per pattern: microseconds a store (the best of ``--repeats``), the ratio against hivemind's storage,
and the bytes each storage holds at the end (the quota's bound is ``--max-mib``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import human, machine, now, table  # noqa: E402

PATTERNS = ("honest", "flood", "sybils")


def _stores(pattern: str, args) -> List[Tuple[str, object, object, bytes, float]]:
    """(writer, key, subkey or None, value, expiration) for every store of ``pattern``."""
    from hivemind.dht.routing import DHTID
    from hivemind.utils import get_dht_time

    later = get_dht_time() + 3600
    if pattern == "honest":
        key = DHTID.generate(source="run_peers")
        return [(f"peer-{w}", key, f"peer-{w}-{r}".encode(), b"p" * 400, later + i)
                for i in range(args.rounds) for w in range(args.writers) for r in range(args.records)]
    if pattern == "flood":
        return [("flood", DHTID.generate(source=f"f{i}"), None, b"f" * 4096, later) for i in range(args.flood)]
    key = DHTID.generate(source="run_peers")
    return [(f"sybil-{i}", key, f"sybil-{i}".encode(), b"s" * 4096, later) for i in range(args.flood)]


def _held(storage) -> int:
    """Bytes of values and subkeys a storage holds now."""
    from hivemind.dht.storage import DictionaryDHTValue

    total = 0
    for _, item in storage.items():
        if isinstance(item.value, DictionaryDHTValue):
            total += sum(len(s) + len(v.value) for s, v in item.value.items())
        else:
            total += len(item.value)
    return total


def one(make: Callable[[], object], stores, repeats: int) -> Tuple[float, int]:
    """(µs a store, best of ``repeats``; bytes held after the last repeat)."""
    import swarm.dht.store_quota as store_quota

    best, storage = float("inf"), None
    for _ in range(repeats):
        storage = make()
        t = time.perf_counter()
        for writer, key, subkey, value, expiration in stores:
            token = store_quota._writer.set(writer)
            storage.store(key, value, expiration, subkey=subkey)
            store_quota._writer.reset(token)
        best = min(best, time.perf_counter() - t)
    return 1e6 * best / len(stores), _held(storage)


def main(argv=None) -> Dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--writers", type=int, default=1000, help="honest writers sharing one key (default 1000)")
    ap.add_argument("--records", type=int, default=2, help="subkeys each honest writer keeps (default 2)")
    ap.add_argument("--rounds", type=int, default=5, help="times each honest record is refreshed (default 5)")
    ap.add_argument("--flood", type=int, default=40_000, help="records of the flood and sybil patterns (default 40000: 160 MB)")
    ap.add_argument("--max-mib", type=float, default=64, help="the quota storage's bound in MiB (default 64, the node's)")
    ap.add_argument("--repeats", type=int, default=3, help="timings of each pattern; the best is kept (default 3)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    small = [f"--{k.replace('_', '-')}" for k in ("writers", "records", "rounds", "flood", "max_mib", "repeats")
             if getattr(args, k) <= 0]
    if small:
        ap.error(f"{', '.join(small)} must be greater than 0")

    from hivemind.dht.storage import DHTLocalStorage

    from swarm.dht.store_quota import QuotaStorage

    bound = int(args.max_mib * 2 ** 20)
    rows, out = [], {"machine": machine(), "when": now(), "args": vars(args), "patterns": {}}
    for pattern in PATTERNS:
        stores = _stores(pattern, args)
        base_us, base_held = one(DHTLocalStorage, stores, args.repeats)
        quota_us, quota_held = one(lambda: QuotaStorage(max_bytes=bound), stores, args.repeats)
        out["patterns"][pattern] = dict(stores=len(stores), hivemind_us=base_us, quota_us=quota_us,
                                        hivemind_held=base_held, quota_held=quota_held)
        rows.append([pattern, f"{len(stores):,}", f"{base_us:.2f}", f"{quota_us:.2f}", f"{quota_us / base_us:.2f}x",
                     human(base_held), human(quota_held)])
    print(table(["pattern", "stores", "hivemind µs/store", "quota µs/store", "ratio", "hivemind holds", "quota holds"], rows))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
