"""The coordinator's command line: ``python -m coordinator`` alone, or ``voloco coordinator`` (voloco/cli.py)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import List, Optional

from swarm.console import UsageError, standalone_main
from swarm.access.join_flags import add_join_token_arguments

HELP = "start a run: first DHT node, publishes the run spec, prints the join command"


def add_arguments(c: argparse.ArgumentParser) -> None:
    c.add_argument("--config", type=Path, help="run spec as TOML: every field in docs/spec.md, an example in docker/run.toml (default: the built-in "
                   "defaults; omitted fields take theirs)")
    c.add_argument("--run-id", help="override the run id of the spec (a-z, 0-9, '_', '-')")
    c.add_argument("--strategy", choices=["diloco", "sparseloco", "dct"], help="override outer.strategy of the spec")
    c.add_argument("--tokenizer", type=Path, metavar="PATH", help="a tokenizer.json the run uses (data.tokenizer = \"bpe\"); "
                   "without it, a bpe run trains one on its corpus; peers fetch it from the swarm and check its sha256")
    c.add_argument(
        "--host-maddrs", nargs="+", default=["/ip4/0.0.0.0/tcp/31337"],
        help="multiaddrs to listen on (default: /ip4/0.0.0.0/tcp/31337; use tcp/0 for a free port)",
    )
    c.add_argument("--announce-maddrs", nargs="+", default=[], help="public multiaddrs to advertise (behind NAT or in Docker; default: none, the listening addresses)")
    c.add_argument("--use-relay", dest="use_relay", action="store_true", default=True,
                   help="libp2p circuit relay: reach peers through relays, and relay for peers behind NATs that "
                   "start with --use-auto-relay (default: on)")
    c.add_argument("--no-relay", dest="use_relay", action="store_false", help="turn the circuit relay off")
    c.add_argument(
        "--identity", type=Path,
        help="private key file (created if missing): a stable peer id and run key across restarts; the run key "
        "signs the run spec and chain assignments, and its fingerprint is the --run-key peers join with (default: a "
        "new key at every start, so a restarted coordinator has a new run key and peers need the new join command)",
    )
    c.add_argument(
        "--address-file", type=Path,
        help="also write the join multiaddrs to this file, one per line, and the run key's fingerprint to PATH.run-key "
        "(default: none, they are printed only)",
    )
    c.add_argument(
        "--dashboard-port", type=int, default=8080, metavar="PORT",
        help="serve the web dashboard, its JSON API (/api/...) and Prometheus metrics (/metrics) on this port "
        "(default: 8080; 0 turns it off)",
    )
    c.add_argument("--dashboard-host", default="0.0.0.0", help="address the dashboard listens on (default: 0.0.0.0)")
    add_join_token_arguments(c, coordinator=True)


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.dashboard_port < 65536:
        raise UsageError("--dashboard-port must be a TCP port (1-65535), or 0 to turn the dashboard off")
    from coordinator.server import run_coordinator  # hivemind: only once a coordinator really starts

    return run_coordinator(args)


def main(argv: Optional[List[str]] = None) -> int:
    return standalone_main("python -m coordinator", HELP, add_arguments, run, argv)
