"""The coordinator: first DHT node of a run, publisher of its spec, and a watcher of its progress.

It is a convenience, not a single point of failure: peers that already run keep training while it
is down (they find each other through any DHT node), and a restarted coordinator rebuilds its view
from the progress records in the DHT.

Its identity key is the run's key: it signs the run spec and the chain assignments, and the join
command it prints carries the key's fingerprint (``--run-key``), so peers accept only this spec.
Keep the key with ``--identity`` and a restarted coordinator keeps the run key.
"""

from __future__ import annotations

import argparse
import logging
import math
import threading
import time
from pathlib import Path
from typing import List, Optional

from coordinator.chain_former import ChainFormer
from coordinator.dashboard import Dashboard
from protocol.errors import SpecError
from protocol.dht.records import SPEC_TTL
from protocol.spec import RunSpec
from swarm.console import UsageError, human_bytes
from swarm.dht.node import start_dht
from swarm.helper_processes import on_stop_signals, starting_helpers
from swarm.access.identity import trust_of
from swarm.access.join_flags import join_token
from swarm.records import publish_run, read_progress
from swarm.tokenizer_share import serve_tokenizer

logger = logging.getLogger("voloco.coordinator")


def load_spec(config: Optional[Path], run_id: Optional[str] = None, strategy: Optional[str] = None) -> RunSpec:
    """The run spec from a TOML file (or the defaults), with command-line overrides; UsageError if invalid."""
    try:
        if config is None:
            spec = RunSpec()
        else:
            if not config.is_file():
                what = "is a directory, not a TOML file" if config.is_dir() else "does not exist"
                raise UsageError(f"--config {str(config)!r} {what} (an example: docker/run.toml; every field: docs/spec.md)")
            spec = RunSpec.from_toml(config.read_text())
        changes = {}
        if run_id:
            changes["run_id"] = run_id
        if strategy:
            changes["outer"] = {"strategy": strategy}
        return spec.replace(**changes) if changes else spec
    except SpecError as e:
        source = f"in {config}" if config else "(from the command line)"
        raise UsageError(f"invalid run spec {source}: {e}") from None


def join_addresses(dht) -> List[str]:
    """The multiaddrs a peer can join with, loopback last (it only works on this machine)."""
    addrs = [str(a) for a in dht.get_visible_maddrs()]
    return sorted(addrs, key=lambda a: ("/127.0.0.1/" in a or "/::1/" in a, a))


def run_coordinator(args: argparse.Namespace) -> int:
    spec = load_spec(args.config, args.run_id, args.strategy)
    tokenizer_json = None
    if spec.data.tokenizer != "bytes" or getattr(args, "tokenizer", None):
        from peer.training.tokenizer import coordinator_tokenizer  # torch and tokenizers: only for a BPE run

        spec, tokenizer_json = coordinator_tokenizer(spec, getattr(args, "tokenizer", None))
    token = join_token(args)
    for flag, path in (("--identity", args.identity), ("--address-file", args.address_file)):
        if path is not None and not path.parent.is_dir():
            raise UsageError(f"{flag} {str(path)!r}: directory {str(path.parent)!r} does not exist")
    with starting_helpers():  # Ctrl+C reaches this process only; it stops the DHT's (swarm/helper_processes.py)
        dht = start_dht((), args.host_maddrs, args.announce_maddrs, str(args.identity) if args.identity else None,
                        join_token=token, run_ids=[spec.run_id], use_relay=getattr(args, "use_relay", True))
    stop = threading.Event()
    on_stop_signals(lambda *_: stop.set())
    dashboard = Dashboard(dht, spec)
    try:
        if tokenizer_json is not None:  # before the spec: a peer that reads the spec can fetch it at once
            serve_tokenizer(dht, spec.run_id, tokenizer_json)
        if not publish_run(dht, spec):
            logger.warning("the DHT did not accept the run spec yet; retrying")
        addrs = join_addresses(dht)
        run_key = trust_of(dht).identity.fingerprint
        if args.address_file:
            run_key_file(args.address_file).write_text(run_key + "\n")  # first: readers wait for the address file
            args.address_file.write_text("\n".join(addrs) + "\n")
        print(f"run {spec.run_id} (spec {spec.digest()}): strategy {spec.outer.strategy}, "
              f"{spec.model.num_params() / 1e6:.2f}M parameters, H={spec.outer.inner_steps}", flush=True)
        if token is None:
            private = ""
        elif args.join_token_file is not None:
            private = f" --join-token-file {args.join_token_file}"
        else:
            private = " --join-token <the run's join token>"
        print(f"join this {'private ' if token else ''}run with:", flush=True)
        print(f"  voloco peer --join {addrs[0]} --run-key {run_key}{private}", flush=True)
        for extra in addrs[1:]:
            print(f"  (or --join {extra})", flush=True)
        if getattr(args, "dashboard_port", 0):
            url = dashboard.serve(getattr(args, "dashboard_host", "0.0.0.0"), args.dashboard_port)
            if url:
                print(f"dashboard: {url}  (JSON: {url}api/snapshot, Prometheus: {url}metrics)", flush=True)
        watch(dht, spec, stop, dashboard=dashboard if dashboard.server is not None else None)  # off: no reads for it
    finally:
        dashboard.stop()
        dht.shutdown()
    return 0


def run_key_file(address_file: Path) -> Path:
    """Where ``--address-file PATH`` also puts the run key's fingerprint: ``PATH.run-key``."""
    return address_file.with_name(address_file.name + ".run-key")


def watch(dht, spec: RunSpec, stop: threading.Event, period: float = 2.0, log_every: float = 10.0,
          dashboard: Optional[Dashboard] = None) -> None:
    """Refresh the spec record, form chains from waiting candidates, refresh the dashboard's view, log the swarm."""
    former = ChainFormer(dht, spec)
    last_refresh = last_log = time.monotonic()
    while not stop.wait(period):
        now = time.monotonic()
        if now - last_refresh >= SPEC_TTL / 3:
            publish_run(dht, spec)
            last_refresh = now
        try:
            former.step()
        except Exception as e:  # a DHT hiccup must not stop the coordinator
            logger.warning(f"chain forming failed this pass: {e!r}")
        if dashboard is not None:
            try:
                dashboard.refresh()
            except Exception as e:
                logger.warning(f"the dashboard's view failed this pass: {e!r}")
        if now - last_log >= log_every:
            last_log = now
            log_swarm(dht, spec)


def log_swarm(dht, spec: RunSpec) -> None:
    try:
        digest = spec.digest()  # once, not per record (a pydantic dump each)
        views = [v for v in read_progress(dht, spec.run_id) if v.progress.spec == digest]
    except Exception as e:
        logger.warning(f"could not read progress: {e!r}")
        return
    live = [v.progress for v in views if v.progress.state != "stopped"]
    if not live:
        logger.info("no peers yet")
        return
    vals = [p.val_loss for p in live if not math.isnan(p.val_loss)]
    slices = ""
    if spec.partial.slices > 1:
        owners = {s: sum(p.part == s for p in live) for s in range(spec.partial.slices)}
        orphans = [s for s, n in owners.items() if n == 0]
        slices = f" | owners per slice {owners}" + (f" (orphaned: {orphans})" if orphans else "")
    logger.info(
        f"{len(live)} peers | round {max(p.round for p in live)} | "
        f"val loss {min(vals) if vals else float('nan'):.3f} | "
        f"{sum(p.tokens_per_s for p in live) / 1e3:.1f}k tok/s | "
        f"sent {human_bytes(sum(p.bytes_sent for p in live))}{slices}"
    )
