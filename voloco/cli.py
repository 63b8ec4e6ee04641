"""``voloco``: the one command of the product.

    voloco coordinator [--config run.toml]   start a run: first DHT node, publish the spec
    voloco peer --join MULTIADDR             join a run and train
    voloco demo [--peers N] [--minutes M]    a coordinator and N peers on this machine
    voloco export CHECKPOINT_DIR OUT_DIR     a checkpoint as a Hugging Face transformers model
    voloco generate --checkpoint DIR         sample text from a checkpoint
    voloco tokenize INPUT OUT_DIR            pre-tokenize a corpus into memory-mapped shards

Each command's flags and code live in its own layer (``coordinator.cli``, ``peer.host.cli``,
``voloco.demo``); this module only composes them. Every flag can also come from a settings file
(``--settings``, a table per command) or a ``VOLOCO_<FLAG>`` environment variable (swarm/settings.py):
flags > environment > settings file > defaults. Bad input exits with code 2 and one line on
stderr that says what to fix.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

import coordinator.cli
import peer.host.cli
from swarm.console import EXIT_USAGE, ArgumentParser, add_log_level, exit_process, run_command
from swarm.settings import SettingsError, add_settings_argument, parse_args, precedence_epilog
from voloco import demo, export, generate, tokenize

COMMANDS = {  # name: (one-line help, add_arguments, run)
    "coordinator": (coordinator.cli.HELP, coordinator.cli.add_arguments, coordinator.cli.run),
    "peer": (peer.host.cli.HELP, peer.host.cli.add_arguments, peer.host.cli.run_peer),
    "demo": (demo.HELP, demo.add_arguments, demo.run_demo),
    "export": (export.HELP, export.add_arguments, export.run_export),
    "generate": (generate.HELP, generate.add_arguments, generate.run_generate),
    "tokenize": (tokenize.HELP, tokenize.add_arguments, tokenize.run_tokenize),
}


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="voloco",
        description="Train a language model together with volunteers over the internet.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run `voloco COMMAND --help` for the flags of each command.\n"
        "Every flag can also be set in a settings file (--settings) or a VOLOCO_* environment variable.\n"
        "Precedence: flags > environment > settings file > defaults.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (summary, add_arguments, _) in COMMANDS.items():
        p = sub.add_parser(name, help=summary, description=summary[0].upper() + summary[1:] + ".",
                           epilog=precedence_epilog(name))
        add_arguments(p)
        add_log_level(p)
        add_settings_argument(p)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parse_args(parser, argv)  # flags > VOLOCO_* environment > settings file > defaults
    except SettingsError as e:
        print(f"voloco: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    return run_command(f"voloco {args.command}", COMMANDS[args.command][2], args)


def entry() -> None:
    """The ``voloco`` console script: ``main`` as this process's entry point (swarm/console.py, ``exit_process``)."""
    exit_process(main)
