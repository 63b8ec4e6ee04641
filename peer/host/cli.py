"""The peer's command line: ``python -m peer --join MULTIADDR`` alone, or ``voloco peer`` (voloco/cli.py).

Bad input exits with code 2 and one line on stderr that says what to fix.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import List, Optional

from swarm.console import UsageError, standalone_main
from swarm.access.join_flags import add_join_token_arguments, add_run_key_argument, join_token, run_key

HELP = "join a run by its DHT address and train"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--join", nargs="+", required=True, metavar="MULTIADDR", help="DHT address(es) printed by the coordinator or any peer")
    p.add_argument("--run", dest="run_id", help="run id to join when the DHT announces several runs (default: the only run it announces)")
    add_run_key_argument(p)
    add_join_token_arguments(p, coordinator=False)
    p.add_argument("--data", help="a text file or a directory of text files to train on (default: the run spec's corpus)")
    p.add_argument("--device", default="auto",
                   help="torch device: auto, cpu, cuda or cuda:N (default: auto: the first CUDA GPU when torch sees one, "
                   "else the CPU; the start-up log says what was chosen and why)")
    p.add_argument("--identity", type=Path, help="private key file: a stable peer id across restarts (created if missing; "
                   "default: a new peer id at every start)")
    p.add_argument("--checkpoint-dir", type=Path,
                   help="directory for the peer's checkpoint; a restarted peer resumes from it (written in the background "
                   "at the end of a round: every round for a small model, at most a tenth of the wall time for a large one, "
                   "and on stop; default: none, a restarted peer downloads the swarm's state)")
    p.add_argument("--host-maddrs", nargs="+", default=["/ip4/0.0.0.0/tcp/0"], help="multiaddrs to listen on (default: any port)")
    p.add_argument("--announce-maddrs", nargs="+", default=[], help="public multiaddrs to advertise (behind NAT or in Docker)")
    p.add_argument(
        "--client-mode", action="store_true",
        help="connect out only, accept no connections (behind a NAT or firewall without an open port): the peer "
        "still trains and exchanges, but never leads a group or serves the DHT (the start-up check says if needed)",
    )
    p.add_argument("--use-relay", dest="use_relay", action="store_true", default=True,
                   help="libp2p circuit relay: reach peers behind NATs through relays (default: on)")
    p.add_argument("--no-relay", dest="use_relay", action="store_false", help="turn the circuit relay off")
    p.add_argument("--use-auto-relay", action="store_true",
                   help="behind a NAT: look for relays and become reachable through them (default: off)")
    p.add_argument("--status-file", type=Path, help="write the peer's status and round history as JSON at each start-up "
                   "phase and after every round (default: none)")
    p.add_argument("--max-rounds", type=int, help="stop after this round (default: the spec's max_rounds; 0 = never)")
    p.add_argument("--threads", type=int,
                   help="torch CPU threads for the inner steps on the CPU and for the exchange's decode and aggregate "
                   "(default: the cores this process may use, torch's choice capped by its CPU affinity and cgroup "
                   "quota, split evenly among the voloco peers running on this host, looked at again every round)")
    p.add_argument(
        "--compile", dest="compile", action="store_true", default=None,
        help="run the inner steps' forward pass through torch.compile: about 2x the tokens/s on a GPU at the 125m "
        "and 350m shapes (bench/gpu.py --compile), after 20-30 s of compiling at start; needs a C compiler (if "
        "the compile fails, the peer says so and trains without it); a full or partial peer only, not a chain "
        "stage (default: on when training on CUDA, off on the CPU)",
    )
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="train eagerly, without torch.compile, on CUDA too")
    p.add_argument(
        "--wait-peers", type=int, default=1, metavar="N",
        help="a coordinated start: hold the first round until N peers of the run (this one included) have started; "
        "ignored once the run is past round 0 (default: 1, start at once)",
    )
    p.add_argument(
        "--max-memory-gb", type=float,
        help="memory this peer may use for training (default: detected: 80%% of the GPU's or of the free RAM); "
        "below what a full replica needs, the peer joins a pipeline chain instead",
    )
    p.add_argument("--bandwidth-mbps", type=float, help="this peer's link speed in Mbit/s, used to place it in a chain (default: 100)")
    p.add_argument(
        "--stage-host",
        help="the one address to listen on and announce for chain neighbours (default: listen on every interface and "
        "announce the addresses the DHT sees this peer at: --announce-maddrs, else --host-maddrs' interfaces; loopback "
        "only in a run on one machine)",
    )
    p.add_argument("--stage-port", type=int, default=0, help="TCP port of the stage listener (default: any free port)")
    p.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                   help="serve this peer's Prometheus metrics at http://HOST:PORT/metrics (default: 0, off)")


def run_peer(args: argparse.Namespace) -> int:
    from peer.training.data import DataError
    from peer.host.runtime import Peer, PeerOptions
    from protocol.chain.endpoints import dialable_host
    from protocol.spec import RUN_ID
    from swarm.dht.node import parse_multiaddrs

    join = parse_multiaddrs(args.join)
    key, token = run_key(args), join_token(args)
    if args.data is not None:
        _check_data(args.data)
    if args.max_rounds is not None and args.max_rounds < 0:
        raise UsageError("--max-rounds must be >= 0")
    if args.wait_peers < 1:
        raise UsageError("--wait-peers must be >= 1")
    if args.max_memory_gb is not None and not 0 < args.max_memory_gb < math.inf:
        raise UsageError("--max-memory-gb must be a positive, finite number of gigabytes")
    if args.bandwidth_mbps is not None and not 0 < args.bandwidth_mbps < math.inf:
        raise UsageError("--bandwidth-mbps must be a positive, finite number")
    if args.threads is not None and args.threads < 1:
        raise UsageError("--threads must be >= 1 (leave it out for torch's choice)")
    if args.stage_host is not None and ("%" in args.stage_host or not dialable_host(args.stage_host.strip("[]"))):
        raise UsageError(f"--stage-host {args.stage_host!r:.80} is no address other peers can dial: an IP address "
                         "or a DNS name (labels of letters, digits and '-')")
    if args.run_id is not None and not RUN_ID.fullmatch(args.run_id):
        raise UsageError(f"--run {args.run_id!r:.60} is no run id: 1-48 characters of a-z, 0-9, '_' or '-', "
                         "starting with a letter or digit")
    if not 0 <= args.stage_port < 65536:
        raise UsageError("--stage-port must be a TCP port (0-65535)")
    if not 0 <= args.metrics_port < 65536:
        raise UsageError("--metrics-port must be a TCP port (1-65535), or 0 for none")
    if args.identity is not None and not args.identity.parent.is_dir():
        raise UsageError(f"--identity {str(args.identity)!r}: directory {str(args.identity.parent)!r} does not exist")
    _check_device(args.device)
    peer = Peer(
        PeerOptions(
            join=join,
            run_id=args.run_id,
            run_key=key,
            join_token=token,
            data=args.data,
            device=args.device,
            identity=str(args.identity) if args.identity else None,
            checkpoint_dir=args.checkpoint_dir,
            host_maddrs=args.host_maddrs,
            announce_maddrs=args.announce_maddrs,
            client_mode=args.client_mode,
            use_relay=args.use_relay,
            use_auto_relay=args.use_auto_relay,
            status_file=args.status_file,
            max_rounds=args.max_rounds,
            threads=args.threads,
            compile=args.compile,
            max_memory_gb=args.max_memory_gb,
            bandwidth_mbps=args.bandwidth_mbps,
            stage_host=args.stage_host,
            stage_port=args.stage_port,
            wait_peers=args.wait_peers,
            metrics_port=args.metrics_port,
        )
    )

    peer.install_signal_handlers()
    try:
        try:
            peer.start()
        except DataError as e:
            raise UsageError(str(e)) from None
        peer.run()
    finally:
        peer.shutdown()
    return 0


def _check_data(path: str) -> None:
    """Fail before joining the swarm when --data cannot give a corpus."""
    from peer.training.data import DataError, load_corpus

    if not Path(path).exists():
        raise UsageError(f"--data {path!r} does not exist: give a text file or a directory of text files")
    try:
        load_corpus(path, max_bytes=1 << 20)
    except DataError as e:
        if "data.text_field" in str(e):  # the run spec (not read yet) may name another field: checked at start
            return
        raise UsageError(f"--data {path!r}: {e}") from None


def _check_device(device: str) -> None:
    import torch

    if device == "auto":
        return
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device {device!r} is not a torch device: use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: CUDA is not available on this machine; use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UsageError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                         f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {device!r}: only cpu and cuda are supported")


def main(argv: Optional[List[str]] = None) -> int:
    return standalone_main("python -m peer", HELP, add_arguments, run_peer, argv)
