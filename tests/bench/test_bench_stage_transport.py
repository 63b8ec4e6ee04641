"""bench/stage_transport.py: a quick loopback run (TCP and a hivemind P2P stream), and its --help."""

import json
import subprocess
import sys
from pathlib import Path

from tests.support.bench_loader import load_bench

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "stage_transport.py"

bst = load_bench("stage_transport")


def test_help_explains_every_flag():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60, check=True).stdout
    public = [a for a in bst.build_parser()._actions if a.help != "==SUPPRESS==" and a.option_strings != ["-h", "--help"]]
    assert {a.option_strings[0] for a in public} == {"--json", "--rate", "--mbytes", "--frame-bytes", "--act-bytes", "--pings", "--no-netns", "--arm-timeout"}
    for a in public:
        assert a.option_strings[0] in out and a.help and len(a.help) > 20


def test_rate_parsing():
    assert bst.rate_bits("20mbit") == 20e6 and bst.rate_bits("500kbit") == 5e5 and bst.rate_bits("1mbps") == 8e6
    assert bst.rate_bits("fast") is None


def test_loopback_run_measures_both_transports(tmp_path):
    out = tmp_path / "st.json"
    cmd = [sys.executable, str(SCRIPT), "--mbytes", "0.5", "--pings", "3", "--no-netns", "--json", str(out), "--arm-timeout", "50"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "P2P/TCP throughput" in r.stdout and "netns arms skipped: disabled (--no-netns)" in r.stdout
    res = json.loads(out.read_text())
    assert list(res["arms"]) == ["loopback"] and res["netns_skipped"] and res["machine"]["hivemind"]
    lo = res["arms"]["loopback"]
    for t in ("tcp", "p2p"):
        for key in ("mb_per_s", "rtt_small_s", "rtt_act_s", "connect_s", "reopen_s", "bulk_s"):
            assert lo[t][key] > 0, (t, key)
        assert lo[t]["payload_bytes"] >= 0.5e6 - 65536 and len(lo[t]["rtt_act_all_ms"]) == 3
    assert {"daemon_start_s", "dial_s", "stream_open_s", "first_echo_s"} <= set(lo["p2p"]["connect_parts"])
    assert all(v > 0 for v in lo["p2p_over_tcp"].values())
