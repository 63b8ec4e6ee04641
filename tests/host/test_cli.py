"""Bad input gets one clear line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import pytest

from tests.support.swarm_harness import run_cli

UNREACHABLE = "/ip4/127.0.0.1/tcp/9/p2p/QmXfpTq2KGZQxJ2N3pygTQDw5gAmnVBcQKSTVZvsyKYn4p"


def assert_usage_error(result, *needles: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, result.stderr[-2000:]
    for needle in needles:
        assert needle in errors[0], errors[0]


def test_malformed_join_address():
    assert_usage_error(run_cli("peer", "--join", "not-a-multiaddr"), "not a multiaddr")


def test_join_address_without_peer_id():
    assert_usage_error(run_cli("peer", "--join", "/ip4/127.0.0.1/tcp/31337"), "/p2p/")


def test_unreachable_dht():
    assert_usage_error(run_cli("peer", "--join", UNREACHABLE), "could not reach the DHT", "coordinator")


def test_data_path_that_does_not_exist(tmp_path):
    assert_usage_error(run_cli("peer", "--join", UNREACHABLE, "--data", str(tmp_path / "missing")), "does not exist")


def test_data_dir_without_text(tmp_path):
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)) * 10)
    assert_usage_error(run_cli("peer", "--join", UNREACHABLE, "--data", str(tmp_path)), "--data")


@pytest.mark.parametrize(
    "toml, needle",
    [
        ('[outer]\nstrategy = "adam"\n', "outer.strategy"),
        ("[model]\nd_model = 130\n", "d_model"),
        ("bogus = 1\n", "unknown field"),
        ("[outer\n", "TOML"),
    ],
)
def test_invalid_run_spec(tmp_path, toml, needle):
    path = tmp_path / "run.toml"
    path.write_text(toml)
    assert_usage_error(run_cli("coordinator", "--config", str(path), "--host-maddrs", "/ip4/127.0.0.1/tcp/0"), needle)


def test_missing_config_file(tmp_path):
    assert_usage_error(run_cli("coordinator", "--config", str(tmp_path / "nope.toml")), "does not exist")


def test_demo_rejects_zero_peers():
    assert_usage_error(run_cli("demo", "--peers", "0"), "--peers")


def test_help_lists_every_command():
    result = run_cli("--help")
    assert result.returncode == 0
    for command in ("coordinator", "peer", "demo"):
        assert command in result.stdout
    for command in ("coordinator", "peer", "demo"):
        sub = run_cli(command, "--help")
        assert sub.returncode == 0 and "--log-level" in sub.stdout


@pytest.mark.parametrize("argv, needle", [
    (("peer",), "--join"),  # a required flag missing
    (("peer", "--join", UNREACHABLE, "--threads", "abc"), "--threads"),  # a value of the wrong type
    (("coordinator", "--strategy", "adam"), "--strategy"),  # not one of the choices
    (("demo", "--bogus"), "--bogus"),  # an unknown flag
])
def test_a_flag_error_is_one_line(argv, needle):
    """argparse's own errors are one line as well, not the usage block first (swarm/console.py ArgumentParser)."""
    result = run_cli(*argv)
    assert_usage_error(result, needle, "--help")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize("argv, needle", [
    (("peer", "--join", "/ip4/127.0.0.1/p2p/12D3KooWLThebN5GGzvNeNTmDYniNADKv7sN4L83viwKmquDd25N"), "names no port"),
    (("peer", "--join", UNREACHABLE, "--threads", "-1"), "--threads"),
    (("peer", "--join", UNREACHABLE, "--bandwidth-mbps", "inf"), "--bandwidth-mbps"),
    (("peer", "--join", UNREACHABLE, "--max-memory-gb", "inf"), "--max-memory-gb"),
    (("peer", "--join", UNREACHABLE, "--run", "Bad Id!"), "no run id"),
    (("peer", "--join", UNREACHABLE, "--stage-host", "my_host"), "--stage-host"),
    (("tokenize", "stdlib", "OUT", "--val-fraction", "2"), "--val-fraction"),
])
def test_values_a_peer_or_tool_cannot_use_are_refused_before_any_work(argv, needle, tmp_path):
    assert_usage_error(run_cli(*(str(tmp_path / "out") if a == "OUT" else a for a in argv), timeout=60), needle)


def test_a_file_where_a_directory_goes_is_refused_before_any_process_starts(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    assert_usage_error(run_cli("demo", "--workdir", str(afile)), "is a file")
    assert_usage_error(run_cli("demo", "--json", str(tmp_path / "missing" / "x.json")), "does not exist")
    assert_usage_error(run_cli("tokenize", "stdlib", str(afile)), "is a file")
    assert_usage_error(run_cli("coordinator", "--config", str(tmp_path)), "is a directory")
    assert_usage_error(run_cli("coordinator", "--address-file", str(tmp_path / "missing" / "addr")), "does not exist")
