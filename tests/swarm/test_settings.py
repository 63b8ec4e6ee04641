"""Settings: flags > VOLOCO_* environment > settings file > defaults, for every flag of every command."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from swarm.settings import SettingsError, add_settings_argument, parse_args
from voloco.cli import build_parser, main

JOIN = "/ip4/127.0.0.1/tcp/31337/p2p/QmXfpTq2KGZQxJ2N3pygTQDw5gAmnVBcQKSTVZvsyKYn4p"
JOIN2 = "/ip4/10.0.0.2/tcp/31337/p2p/QmXfpTq2KGZQxJ2N3pygTQDw5gAmnVBcQKSTVZvsyKYn4p"


def parse(argv, env=None):
    return parse_args(build_parser(), argv, environ=env or {})


def settings(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "voloco.toml"
    path.write_text(text)
    return path


def test_defaults_without_file_or_environment():
    args = parse(["peer", "--join", JOIN])
    assert args.join == [JOIN] and args.device == "auto" and args.compile is None and args.threads is None and args.checkpoint_dir is None
    assert args.host_maddrs == ["/ip4/0.0.0.0/tcp/0"] and args.wait_peers == 1 and args.log_level == "info"


def test_file_sets_every_kind_of_flag(tmp_path):
    path = settings(tmp_path, f"""
[peer]
join = ["{JOIN}", "{JOIN2}"]
device = "cuda:1"
threads = 4
checkpoint-dir = "ckpt"
max_memory_gb = 2          # an integer where a float is expected is fine
host-maddrs = "/ip4/0.0.0.0/tcp/1 /ip4/0.0.0.0/tcp/2"   # one string: split on spaces or commas
log-level = "debug"
[coordinator]
config = "run.toml"
""")
    args = parse(["peer", "--settings", str(path)])
    assert args.join == [JOIN, JOIN2]
    assert args.device == "cuda:1" and args.threads == 4 and args.checkpoint_dir == Path("ckpt")
    assert args.max_memory_gb == 2.0 and args.host_maddrs == ["/ip4/0.0.0.0/tcp/1", "/ip4/0.0.0.0/tcp/2"]
    assert args.log_level == "debug"
    coord = parse(["coordinator", "--settings", str(path)])
    assert coord.config == Path("run.toml")  # --config stays the run spec; the settings file may name it


def test_precedence_flag_over_environment_over_file(tmp_path):
    path = settings(tmp_path, f'[peer]\njoin = ["{JOIN}"]\nthreads = 2\ndevice = "cuda"\ncheckpoint_dir = "a"\n')
    env = {"VOLOCO_SETTINGS": str(path), "VOLOCO_THREADS": "3", "VOLOCO_CHECKPOINT_DIR": "b"}
    args = parse(["peer", "--threads", "5"], env)
    assert args.threads == 5  # flag > environment
    assert args.checkpoint_dir == Path("b")  # environment > file
    assert args.device == "cuda"  # file > default
    assert args.join == [JOIN]


def test_environment_lists_split_on_spaces_or_commas():
    args = parse(["peer"], {"VOLOCO_JOIN": f" {JOIN}, {JOIN2} ", "VOLOCO_DEVICE": "cuda"})
    assert args.join == [JOIN, JOIN2] and args.device == "cuda"
    assert parse(["peer"], {"VOLOCO_JOIN": f"{JOIN} {JOIN2}"}).join == [JOIN, JOIN2]


def test_required_join_from_environment_or_file_or_nowhere(tmp_path, capsys):
    assert parse(["peer"], {"VOLOCO_JOIN": JOIN}).join == [JOIN]
    path = settings(tmp_path, f'[peer]\njoin = "{JOIN}"\n')
    assert parse(["peer", "--settings", str(path)]).join == [JOIN]
    with pytest.raises(SystemExit) as e:
        parse(["peer"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--join" in err and "VOLOCO_JOIN" in err


@pytest.mark.parametrize("env, needles", [
    ({"VOLOCO_THREADS": "four"}, ["VOLOCO_THREADS", "--threads", "integer"]),
    ({"VOLOCO_MAX_MEMORY_GB": "lots"}, ["VOLOCO_MAX_MEMORY_GB", "number"]),
    ({"VOLOCO_LOG_LEVEL": "loud"}, ["VOLOCO_LOG_LEVEL", "debug, info"]),
    ({"VOLOCO_JOIN": " , "}, ["VOLOCO_JOIN", "at least one"]),
])
def test_bad_environment_value_names_the_variable(env, needles):
    with pytest.raises(SettingsError) as e:
        parse(["peer"] if "VOLOCO_JOIN" in env else ["peer", "--join", JOIN], env)
    assert "\n" not in str(e.value)
    for needle in needles:
        assert needle in str(e.value), str(e.value)


@pytest.mark.parametrize("text, needles", [
    ('[peer]\nthreads = "many"\n', ["[peer] threads", "integer"]),
    ("[peer]\nthreads = 2.5\n", ["[peer] threads", "integer"]),
    ("[peer]\nthreads = true\n", ["[peer] threads", "integer"]),
    ("[peer]\njoin = 5\n", ["[peer] join", "list"]),
    ("[peer]\ndevice = 1\n", ["[peer] device", "string"]),
    ("[peer]\nthreds = 2\n", ["[peer]", "unknown key 'threds'"]),
    ("[peers]\nthreads = 2\n", ["unknown table or key 'peers'"]),
    ("threads = 2\n", ["unknown table or key 'threads'"]),
    ("[peer\n", ["invalid TOML"]),
    ('[coordinator]\nstrategy = "adam"\n', ["[coordinator] strategy", "diloco"]),
])
def test_bad_file_value_names_the_file_and_key(tmp_path, text, needles):
    path = settings(tmp_path, text)
    command = "coordinator" if "coordinator" in text else "peer"
    with pytest.raises(SettingsError) as e:
        parse([command, "--settings", str(path)] + (["--join", JOIN] if command == "peer" else []))
    message = str(e.value)
    assert str(path) in message and "\n" not in message, message
    for needle in needles:
        assert needle in message, message


def test_missing_settings_file_names_where_it_came_from(tmp_path):
    with pytest.raises(SettingsError, match="VOLOCO_SETTINGS"):
        parse(["peer", "--join", JOIN], {"VOLOCO_SETTINGS": str(tmp_path / "nope.toml")})
    with pytest.raises(SettingsError, match="does not exist"):
        parse(["peer", "--join", JOIN, "--settings", str(tmp_path / "nope.toml")])


def test_a_flag_beats_its_exclusive_rival_from_the_environment(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("x" * 20)
    args = parse(["peer", "--join", JOIN, "--join-token-file", str(token_file)], {"VOLOCO_JOIN_TOKEN": "y" * 20})
    assert args.join_token_file == token_file and args.join_token is None
    args = parse(["peer", "--join", JOIN], {"VOLOCO_JOIN_TOKEN": "y" * 20})
    assert args.join_token == "y" * 20 and args.join_token_file is None
    with pytest.raises(SettingsError, match="mutually exclusive"):
        parse(["peer", "--join", JOIN], {"VOLOCO_JOIN_TOKEN": "y" * 20, "VOLOCO_JOIN_TOKEN_FILE": str(token_file)})
    path = settings(tmp_path, f'[peer]\njoin-token-file = "{token_file}"\n')  # the environment beats the file
    args = parse(["peer", "--join", JOIN, "--settings", str(path)], {"VOLOCO_JOIN_TOKEN": "y" * 20})
    assert args.join_token == "y" * 20 and args.join_token_file is None


def test_a_new_flag_is_settable_at_once(tmp_path):
    """Flags other code adds to a parser (a port, a switch, a choice) need nothing here."""
    parser = argparse.ArgumentParser(prog="python -m peer")
    parser.add_argument("--dashboard-port", type=int, default=8080)
    parser.add_argument("--client-mode", action="store_true")
    parser.add_argument("--no-color", dest="color", action="store_false")
    parser.add_argument("--tags", nargs="*", default=[])
    add_settings_argument(parser)
    args = parse_args(parser, [], section="peer", environ={})
    assert (args.dashboard_port, args.client_mode, args.color, args.tags) == (8080, False, True, [])
    args = parse_args(parser, [], section="peer", environ={"VOLOCO_DASHBOARD_PORT": "9000", "VOLOCO_CLIENT_MODE": "yes",
                                                             "VOLOCO_NO_COLOR": "1", "VOLOCO_TAGS": "a,b"})
    assert (args.dashboard_port, args.client_mode, args.color, args.tags) == (9000, True, False, ["a", "b"])
    path = settings(tmp_path, "[peer]\ndashboard_port = 9001\nclient-mode = true\n")
    args = parse_args(parser, ["--settings", str(path)], section="peer", environ={})
    assert (args.dashboard_port, args.client_mode) == (9001, True)
    assert parse_args(parser, ["--settings", str(path)], section="peer", environ={"VOLOCO_CLIENT_MODE": "off"}).client_mode is False
    with pytest.raises(SettingsError, match="VOLOCO_CLIENT_MODE"):
        parse_args(parser, [], section="peer", environ={"VOLOCO_CLIENT_MODE": "maybe"})
    with pytest.raises(SettingsError, match=r"\[peer\] client-mode"):
        parse_args(parser, ["--settings", str(settings(tmp_path, '[peer]\nclient-mode = "x"\n'))], section="peer", environ={})


def test_main_reports_a_bad_variable_in_one_line(monkeypatch, capsys):
    monkeypatch.setenv("VOLOCO_THREADS", "x")
    assert main(["peer", "--join", JOIN]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error:" in err[0] and "VOLOCO_THREADS" in err[0], err


@pytest.mark.parametrize("command", ["coordinator", "peer", "demo"])
def test_help_states_the_precedence(command, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "flags > environment > settings file > defaults" in out and "--settings" in out and "VOLOCO_" in out


def _run(argv, env_extra, tmp_path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("VOLOCO_")}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, env=env, cwd=Path(__file__).resolve().parents[2])


def test_the_commands_take_join_from_the_environment_and_the_file(tmp_path):
    """End to end: the value reaches the command (a malformed address is reported as the flag's)."""
    result = _run(["voloco", "peer"], {"VOLOCO_JOIN": "not-a-multiaddr"}, tmp_path)
    assert result.returncode == 2 and "not a multiaddr" in result.stderr, result.stderr[-2000:]
    path = settings(tmp_path, '[peer]\njoin = ["not-a-multiaddr"]\n')
    result = _run(["peer", "--settings", str(path)], {}, tmp_path)  # python -m peer
    assert result.returncode == 2 and "not a multiaddr" in result.stderr, result.stderr[-2000:]
    result = _run(["coordinator"], {"VOLOCO_DASHBOARD_PORT": "http"}, tmp_path)  # python -m coordinator
    assert result.returncode == 2 and "VOLOCO_DASHBOARD_PORT" in result.stderr, result.stderr[-2000:]
    assert len([line for line in result.stderr.splitlines() if "error:" in line]) == 1


def test_an_on_off_pair_sharing_one_destination(tmp_path):
    """``--use-relay`` (default on) and ``--no-relay``, both writing ``use_relay``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--use-relay", dest="use_relay", action="store_true", default=True)
    parser.add_argument("--no-relay", dest="use_relay", action="store_false")
    add_settings_argument(parser)
    assert parse_args(parser, [], section="peer", environ={}).use_relay is True
    assert parse_args(parser, [], section="peer", environ={"VOLOCO_NO_RELAY": "1"}).use_relay is False
    assert parse_args(parser, [], section="peer", environ={"VOLOCO_USE_RELAY": "false"}).use_relay is False
    assert parse_args(parser, ["--use-relay"], section="peer", environ={"VOLOCO_NO_RELAY": "1"}).use_relay is True
    assert parse_args(parser, ["--no-relay"], section="peer", environ={}).use_relay is False
    path = settings(tmp_path, "[peer]\nno-relay = true\n")  # the environment beats the file, whichever flag
    assert parse_args(parser, ["--settings", str(path)], section="peer", environ={"VOLOCO_USE_RELAY": "1"}).use_relay is True
    assert parse_args(parser, ["--settings", str(path)], section="peer", environ={}).use_relay is False


def test_an_empty_variable_is_unset(tmp_path):
    """``VOLOCO_X=`` (a compose default left empty, ``docker run -e VOLOCO_X=``) leaves the flag to the lower layers."""
    path = settings(tmp_path, '[peer]\nthreads = 3\n')
    args = parse(["peer", "--join", JOIN, "--settings", str(path)], {"VOLOCO_THREADS": "", "VOLOCO_LOG_LEVEL": " "})
    assert args.threads == 3 and args.log_level == "info"
