"""Every flag of every command, also from a settings file and from the environment.

Precedence, highest first::

    command-line flags  >  environment (VOLOCO_<FLAG>)  >  settings file  >  defaults

The settings file is TOML with one table per command (``[coordinator]``, ``[peer]``, ``[demo]``)
whose keys are the flag names without the dashes (``checkpoint-dir`` or ``checkpoint_dir``)::

    [peer]
    join = ["/ip4/203.0.113.5/tcp/31337/p2p/12D3KooW..."]
    device = "cuda"
    threads = 8
    checkpoint-dir = "ckpt"

It is named by ``--settings PATH`` or ``VOLOCO_SETTINGS``. An environment variable is the flag's
name in capitals with ``_`` for ``-``: ``VOLOCO_JOIN``, ``VOLOCO_DEVICE``, ``VOLOCO_THREADS``,
``VOLOCO_CHECKPOINT_DIR``; a flag that takes several values takes them split on spaces or commas;
an on/off flag takes 1/0, true/false, yes/no or on/off.

Nothing here knows a flag: the layers are applied to whatever the commands' argparse parsers
declare, so a flag added to a parser is settable from the file and the environment at once. An
environment value goes through the flag's own converter (what the flag would do with the same
text); a file value, already typed by TOML, is validated with pydantic against the flag's type.
Any bad value is one line naming the key and where it came from (the file's path and table, or
the variable), exit code 2, like any other bad input.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tomllib
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from swarm.console import UsageError

ENV_PREFIX = "VOLOCO_"
SETTINGS_ENV = ENV_PREFIX + "SETTINGS"
SECTIONS = ("coordinator", "peer", "demo", "export", "generate", "tokenize")  # the tables a settings file may have

PRECEDENCE = (
    "Every flag can also be set in a settings file (--settings PATH or $VOLOCO_SETTINGS: TOML, "
    "a [{section}] table whose keys are the flag names, e.g. {example_key} = {example_value}) or in an "
    "environment variable (VOLOCO_ and the flag's name in capitals, e.g. VOLOCO_{example_env}; several "
    "values split on spaces or commas). Precedence: flags > environment > settings file > defaults."
)

_MISSING = object()  # "not given on the command line"
_BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


class SettingsError(UsageError):
    """A bad value in the settings file or the environment: one line, exit code 2."""


def env_name(option: str) -> str:
    """``--checkpoint-dir`` -> ``VOLOCO_CHECKPOINT_DIR``."""
    return ENV_PREFIX + option.lstrip("-").upper().replace("-", "_")


def key_name(option: str) -> str:
    """``--checkpoint-dir`` -> ``checkpoint-dir`` (a file key may also spell it ``checkpoint_dir``)."""
    return option.lstrip("-")


def precedence_epilog(section: str) -> str:
    examples = {"peer": ("join", '["/ip4/.../p2p/..."]', "DEVICE=cuda"),
                "coordinator": ("config", '"run.toml"', "IDENTITY=coordinator.key"),
                "demo": ("peers", "4", "MINUTES=2")}
    key, value, env = examples.get(section, ("log-level", '"debug"', "LOG_LEVEL=debug"))
    return PRECEDENCE.format(section=section, example_key=key, example_value=value, example_env=env)


def add_settings_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--settings", type=Path, metavar="PATH",
        help=f"settings file (TOML) with a table per command whose keys are flag names (default: ${SETTINGS_ENV}, else none)",
    )


# ---- the parsers' options -----------------------------------------------------------------------
def _layerable(action: argparse.Action) -> bool:
    """An option a file or a variable can set: not --help/--version, not --settings itself."""
    return (bool(action.option_strings) and action.dest not in (argparse.SUPPRESS, "settings", "help")
            and action.default is not argparse.SUPPRESS and action.nargs != argparse.PARSER
            and not isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)))


def _long_options(action: argparse.Action) -> List[str]:
    longs = [o for o in action.option_strings if o.startswith("--")]
    return longs or list(action.option_strings)


def _subparsers(parser: argparse.ArgumentParser) -> Optional[argparse._SubParsersAction]:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _multi(action: argparse.Action) -> bool:
    return action.nargs in ("+", "*") or (isinstance(action.nargs, int) and action.nargs > 1) or isinstance(
        action, (argparse._AppendAction, argparse._ExtendAction))


def _is_switch(action: argparse.Action) -> bool:
    return action.nargs == 0 and isinstance(action.const, bool)


# ---- the command line, alone --------------------------------------------------------------------
def _parse_command_line(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """argv parsed with every layerable default replaced by ``_MISSING`` and nothing required:
    what is not ``_MISSING`` afterwards was given as a flag."""
    saved: List[Tuple[Any, str, Any]] = []

    def patch(p: argparse.ArgumentParser) -> None:
        for action in p._actions:
            if _layerable(action) and not isinstance(action, argparse._CountAction):
                saved.append((action, "default", action.default))
                saved.append((action, "required", action.required))
                if isinstance(action, (argparse._AppendAction, argparse._ExtendAction)):
                    continue  # they add to their default: keep it
                action.default, action.required = _MISSING, False
        for group in p._mutually_exclusive_groups:
            saved.append((group, "required", group.required))
            group.required = False
        sub = _subparsers(p)
        if sub is not None:
            for child in dict.fromkeys(sub.choices.values()):
                patch(child)

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args[: args.index("--") if "--" in args else len(args)]):
        return parser.parse_args(args)  # help shows the real defaults (and exits)
    patch(parser)
    try:
        return parser.parse_args(args)
    finally:
        for obj, attr, value in reversed(saved):
            setattr(obj, attr, value)


# ---- the layers ---------------------------------------------------------------------------------
def load_settings_file(path: Path, source: str) -> Dict[str, Dict[str, Any]]:
    """The settings file's tables; SettingsError for an unreadable file, bad TOML or a stray key."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SettingsError(f"settings file {str(path)!r} ({source}) does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SettingsError(f"settings file {str(path)!r} ({source}) cannot be read: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise SettingsError(f"settings file {str(path)}: invalid TOML: {e}") from None
    for name, table in data.items():
        if name not in SECTIONS:
            raise SettingsError(f"{path}: unknown table or key {name!r} (the tables are "
                                + ", ".join(f"[{s}]" for s in SECTIONS) + ")")
        if not isinstance(table, dict):
            raise SettingsError(f"{path}: {name!r} must be a table ([{name}]), not a {type(table).__name__}")
    return data


def _convert_text(action: argparse.Action, text: str, source: str) -> Any:
    """An environment variable's text, converted the way the flag converts its argument."""
    flag = _long_options(action)[0]
    if _is_switch(action):
        word = text.strip().lower()
        if word not in _BOOLS:
            raise SettingsError(f"{source}={text!r}: {flag} is on or off: use 1/0, true/false, yes/no or on/off")
        return action.const if _BOOLS[word] else (not action.const)
    if action.nargs == 0:  # store_const with a non-bool constant: set when the variable is truthy
        word = text.strip().lower()
        if word not in _BOOLS:
            raise SettingsError(f"{source}={text!r}: {flag} takes no value: use 1 (set) or 0 (not set)")
        return action.const if _BOOLS[word] else action.default
    if _multi(action):
        items = [t for t in re.split(r"[\s,]+", text.strip()) if t]
        if not items and action.nargs == "+":
            raise SettingsError(f"{source} is empty: {flag} needs at least one value")
        return [_one(action, item, source, flag) for item in items]
    return _one(action, text, source, flag)


def _one(action: argparse.Action, text: str, source: str, flag: str) -> Any:
    value: Any = text
    if action.type is not None:
        try:
            value = action.type(text)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
            kind = getattr(action.type, "__name__", "value")
            what = {"int": "an integer", "float": "a number"}.get(kind, f"a valid {kind}")
            detail = f" ({e})" if isinstance(e, argparse.ArgumentTypeError) else ""
            raise SettingsError(f"{source}={text!r}: {flag} needs {what}{detail}") from None
    if action.choices is not None and value not in action.choices:
        raise SettingsError(f"{source}={text!r}: {flag} must be one of " + ", ".join(map(str, action.choices)))
    return value


_KINDS = (int, float, bool, str)  # the flag types a file value is validated as (pydantic, strict)


def _validate_file_value(action: argparse.Action, value: Any, source: str) -> Any:
    """A TOML value, checked against the flag's type: ints for int flags, lists (or one string split
    on spaces or commas) for flags that take several values, strings for paths and text."""
    flag = _long_options(action)[0]
    if _is_switch(action) or action.nargs == 0:
        value = _check(bool, value, source, flag)
        if _is_switch(action):
            return action.const if value else (not action.const)
        return action.const if value else action.default
    if _multi(action):
        if isinstance(value, str):
            return _convert_text(action, value, source)
        if not isinstance(value, list):
            raise SettingsError(f"{source}: {flag} takes a list of values (or one string), not {value!r}")
        if not value and action.nargs == "+":
            raise SettingsError(f"{source}: {flag} needs at least one value")
        return [_file_item(action, item, f"{source}[{i}]", flag) for i, item in enumerate(value)]
    return _file_item(action, value, source, flag)


def _file_item(action: argparse.Action, value: Any, source: str, flag: str) -> Any:
    kind = action.type if action.type in _KINDS else str
    if kind is str and action.type not in (None, str):  # Path or any converter of text: give it the text
        text = _check(str, value, source, flag)
        return _one(action, text, source, flag)
    value = _check(kind, value, source, flag)
    if action.choices is not None and value not in action.choices:
        raise SettingsError(f"{source} = {value!r}: {flag} must be one of " + ", ".join(map(str, action.choices)))
    return value


def _check(kind: type, value: Any, source: str, flag: str) -> Any:
    from pydantic import ConfigDict, TypeAdapter, ValidationError  # only with a settings file: `--help` stays fast

    try:
        return TypeAdapter(kind, config=ConfigDict(strict=True)).validate_python(value)
    except ValidationError as e:
        msg = e.errors()[0]["msg"]
        raise SettingsError(f"{source} = {value!r}: {flag}: {msg[0].lower() + msg[1:]}") from None


# ---- parse --------------------------------------------------------------------------------------
def parse_args(
    parser: argparse.ArgumentParser,
    argv: Optional[Sequence[str]] = None,
    section: Optional[str] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> argparse.Namespace:
    """``parser.parse_args(argv)`` with the settings file and the environment under the flags.

    ``parser`` is one command's parser (``section`` names its table) or a parser with subcommands
    (the chosen subcommand names it). Raises SettingsError for a bad file or variable; a missing
    required flag is argparse's usual error (exit code 2), naming the variable and key too.
    """
    environ = os.environ if environ is None else environ
    given = _parse_command_line(parser, argv)
    command_parser = parser
    sub = _subparsers(parser)
    if sub is not None:
        section = getattr(given, sub.dest, None)
        if section is None:  # no subcommand: nothing to layer
            return _fill_defaults([parser], given)
        command_parser = sub.choices[section]
    assert section is not None, "a parser without subcommands needs its section"

    path, path_source = _settings_path(given, environ)
    table: Dict[str, Any] = {}
    if path is not None:
        table = dict(load_settings_file(path, path_source).get(section, {}))
    actions = [a for a in command_parser._actions if _layerable(a)]
    by_key = {k: a for a in actions for o in _long_options(a) for k in (key_name(o), key_name(o).replace("-", "_"))}
    for key in table:
        if key not in by_key:
            raise SettingsError(f"{path} [{section}]: unknown key {key!r} (`voloco {section} --help` lists the flags)")

    layer: Dict[str, Tuple[int, str, Any]] = {}  # dest -> (rank: 2 flag, 1 env, 0 file; where; value)

    def put(dest: str, rank: int, where: str, value: Any) -> None:  # two flags may share a dest (--use-x/--no-x)
        if rank >= layer.get(dest, (-1,))[0]:
            layer[dest] = (rank, where, value)

    for action in actions:  # every value of the file and the environment is checked, even one a flag overrides
        for key in (k for o in _long_options(action) for k in dict.fromkeys((key_name(o), key_name(o).replace("-", "_")))):
            if key in table:
                where = f"{path} [{section}] {key}"
                put(action.dest, 0, where, _validate_file_value(action, table[key], where))
                break
        for var in map(env_name, _long_options(action)):
            if environ.get(var, "").strip():  # an empty variable (VOLOCO_X= in compose or docker run) is unset
                put(action.dest, 1, var, _convert_text(action, environ[var], var))
                break
        value = getattr(given, action.dest, _MISSING)
        if value is not _MISSING and not _same_as_untouched(action, value):
            put(action.dest, 2, "flag", value)

    _resolve_exclusive_groups(command_parser, layer)
    parsers = [parser] if command_parser is parser else [parser, command_parser]
    namespace = _fill_defaults(parsers, given, {d: v for d, (_, _, v) in layer.items()})
    _check_required(command_parser, section, layer)
    return namespace


def _same_as_untouched(action: argparse.Action, value: Any) -> bool:
    """Append/extend actions keep their default while unpatched: untouched means equal to it."""
    return isinstance(action, (argparse._AppendAction, argparse._ExtendAction, argparse._CountAction)) and value == action.default


def _settings_path(given: argparse.Namespace, environ: Mapping[str, str]) -> Tuple[Optional[Path], str]:
    flag = getattr(given, "settings", _MISSING)
    if flag not in (_MISSING, None):
        return Path(flag), "--settings"
    if environ.get(SETTINGS_ENV):
        return Path(environ[SETTINGS_ENV]), SETTINGS_ENV
    return None, ""


def _resolve_exclusive_groups(parser: argparse.ArgumentParser, layer: Dict[str, Tuple[int, str, Any]]) -> None:
    """Within a group of mutually exclusive flags the highest layer wins: a flag given on the command
    line drops its rivals from the environment or the file. Two rivals in one layer are an error."""
    for group in parser._mutually_exclusive_groups:
        members = [(layer[a.dest], a) for a in group._group_actions if a.dest in layer]
        if len(members) < 2:
            continue
        top = max(rank for (rank, _, _), _ in members)
        winners = [(where, a) for (rank, where, _), a in members if rank == top]
        if len(winners) > 1:
            names = " and ".join(where if where != "flag" else _long_options(a)[0] for where, a in winners)
            raise SettingsError(f"{names} are mutually exclusive: set only one")
        for (rank, _, _), action in members:
            if rank < top:
                del layer[action.dest]


def _fill_defaults(parsers: List[argparse.ArgumentParser], given: argparse.Namespace,
                   values: Optional[Dict[str, Any]] = None) -> argparse.Namespace:
    """Replace every ``_MISSING`` left by ``_parse_command_line`` with the layered value or the default."""
    values = values or {}
    for p in parsers:
        for action in p._actions:
            if getattr(given, action.dest, None) is not _MISSING:
                if action.dest in values:
                    setattr(given, action.dest, values[action.dest])
                continue
            if action.dest in values:
                setattr(given, action.dest, values[action.dest])
            else:
                default = action.default
                if isinstance(default, str) and action.type is not None:  # what argparse does with a text default
                    default = action.type(default)
                setattr(given, action.dest, default)
    return given


def _check_required(parser: argparse.ArgumentParser, section: str, layer: Dict[str, Tuple[int, str, Any]]) -> None:
    missing = []
    for action in parser._actions:
        if action.required and _layerable(action) and action.dest not in layer:
            option = _long_options(action)[0]
            missing.append(f"{option} (or ${env_name(option)}, or {key_name(option)} in [{section}] of the settings file)")
    for group in parser._mutually_exclusive_groups:
        if group.required and not any(a.dest in layer for a in group._group_actions):
            missing.append("one of " + " ".join(_long_options(a)[0] for a in group._group_actions))
    if missing:
        parser.error("the following arguments are required: " + ", ".join(missing))
