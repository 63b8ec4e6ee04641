"""The flags that say which run to trust and how to get into a private one, shared by the peer's
and the coordinator's command lines. Imports nothing heavy: ``voloco --help`` stays fast."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

from protocol.dht.keys import is_fingerprint
from swarm.console import UsageError

MIN_TOKEN_CHARS = 16
TOKEN_HINT = 'e.g. python -c "import secrets; print(secrets.token_urlsafe(24))"'


def add_join_token_arguments(parser: argparse.ArgumentParser, coordinator: bool) -> None:
    if coordinator:
        what = (f"make the run private with this shared secret (at least {MIN_TOKEN_CHARS} characters; give it to every "
                "peer): only nodes started with the same token can use the run's DHT, enter a group or download state, "
                "and records that do not prove it are ignored (default: a public run)")
    else:
        what = ("the join token of a private run, the one its coordinator was started with: without it the run's nodes "
                "neither answer this peer nor read its records (default: none, for a public run)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--join-token", metavar="TOKEN", help=what)
    group.add_argument(
        "--join-token-file", type=Path, metavar="PATH",
        help="read the join token from the first line of this file instead (keeps it out of the process list)",
    )


def add_run_key_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--run-key", metavar="FINGERPRINT",
        help="fingerprint of the run's key, printed by the coordinator in the join command: only a run spec "
        "(and chain assignments) signed by that key are accepted (default: accept any spec, with a warning)",
    )


def join_token(args: argparse.Namespace) -> Optional[str]:
    """The join token given on the command line or in its file; UsageError if it is unusable."""
    token, path = getattr(args, "join_token", None), getattr(args, "join_token_file", None)
    flag = "--join-token"
    if path is not None:
        flag = "--join-token-file"
        try:
            lines = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--join-token-file {str(path)!r} cannot be read ({e})") from None
        token = lines[0].strip() if lines else ""
    if token is None:
        return None
    if len(token) < MIN_TOKEN_CHARS:
        raise UsageError(f"{flag}: the join token must have at least {MIN_TOKEN_CHARS} characters ({TOKEN_HINT})")
    return token


def run_key(args: argparse.Namespace) -> Optional[str]:
    key = getattr(args, "run_key", None)
    if key is None:
        return None
    key = key.strip().lower()
    if not is_fingerprint(key):
        raise UsageError(f"--run-key {args.run_key!r} is not a run key fingerprint: copy the one the coordinator printed")
    return key
