"""Console plumbing shared by every command: bad input as one line and exit code 2, logging, byte counts."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Callable, List, Optional

EXIT_USAGE = 2

Command = Callable[[argparse.Namespace], int]


class UsageError(Exception):
    """Bad input from the person running voloco: printed as one line, exit code 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose errors (a missing or unknown flag, a value of the wrong type) are one
    line and exit code 2 as every other bad input, not the whole usage block first
    (tests/host/test_cli.py::test_a_flag_error_is_one_line)."""

    def error(self, message: str):  # noqa: D102 - argparse's hook
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def setup_logging(level: str = "info") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    # hivemind is chatty at INFO (matchmaking retries, daemon start-up); keep its warnings
    hm_level = logging.DEBUG if level == "debug" else logging.ERROR
    for name in ("hivemind",):
        logging.getLogger(name).setLevel(hm_level)
    if level != "debug":
        averager = logging.getLogger("hivemind.averaging.averager")
        if not any(isinstance(f, _NoGroupFilter) for f in averager.filters):
            averager.addFilter(_NoGroupFilter())
    os.environ.setdefault("GOLOG_LOG_LEVEL", "error")


class _NoGroupFilter(logging.Filter):
    """hivemind logs a round without a group as an ERROR with a traceback; voloco's own warning
    ("found no group; keeping this round's update locally") says it once, in words."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "could not find a group" not in record.getMessage()


def add_log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log verbosity (default: info)"
    )


def run_command(prog: str, command: Command, args: argparse.Namespace) -> int:
    """Run one command: UsageError becomes ``PROG: error: ...`` on stderr and exit code 2; Ctrl+C, 130."""
    setup_logging(args.log_level)
    try:
        return command(args)
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


def exit_process(main: Callable[[], int]) -> None:
    """Run a command as this process's entry point and end the process with its exit code, without
    the interpreter's teardown: by then the command has written its checkpoint, stopped hivemind's
    processes and flushed its files, and a daemon thread still inside a torch call while the
    interpreter's C++ libraries are destroyed can abort the exit ("terminate called without an
    active exception", exit code 134) after a clean stop. Logs and standard streams are flushed and
    any child process left is ended first. An exception still ends the process the ordinary way,
    with its traceback."""
    code = main()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    import multiprocessing

    for child in multiprocessing.active_children():  # none after a clean stop
        child.terminate()
        child.join(timeout=5.0)
    os._exit(code if isinstance(code, int) else 1)


def standalone_main(
    prog: str,
    summary: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    command: Command,
    argv: Optional[List[str]] = None,
) -> int:
    """``python -m peer`` / ``python -m coordinator``: one command's parser, without subcommands;
    its flags also come from the settings file and the environment (swarm/settings.py)."""
    from swarm.settings import add_settings_argument, parse_args, precedence_epilog

    section = prog.split()[-1]  # "python -m peer": the [peer] table
    parser = ArgumentParser(prog=prog, description=summary[0].upper() + summary[1:] + ".",
                                     epilog=precedence_epilog(section))
    add_arguments(parser)
    add_log_level(parser)
    add_settings_argument(parser)
    try:
        args = parse_args(parser, argv, section=section)
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    return run_command(prog, command, args)
