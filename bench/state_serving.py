"""A flood of state downloads against one serving peer: what the serve gate bounds, and what it costs.

    python bench/state_serving.py [--downloaders 8] [--state-mb 64] [--json OUT]

One serving peer (a real ``PayloadGatherer``: its averager process streams the state, its host
process copies it for each download, as a peer's engine does) and N downloaders, each a DHT node of
its own on loopback, all asking for the state at the same moment (peer/exchange/state_download.py's
``StateDownloader``); a downloader answered "busy", or whose try failed, asks again 0.5 s later (a
failed try is counted and its error printed; three make it give up). Two arms, each in a fresh
process:

- ``gate``: the defaults (protocol/round/serve_gate.py: ``Timing.serves_at_once`` downloads at once,
  ``serves_per_peer`` a peer within the window). No gather has run, so no downloader is a stranger:
  the strangers' share does not apply here, only the cap on downloads at once;
- ``open``: no bound (what hivemind's ``rpc_download_state`` does): every download served at once.

Per arm: the peak resident size the flood added to the serving host process and to its averager
process (VmHWM, reset before the flood), the seconds until every downloader holds the state, the
busy answers, and every state checked equal to the one served. Needs Linux (/proc/PID/clear_refs).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import exit_on_sigterm, machine, now, proc_status_kib, reset_peak_rss, table  # noqa: E402
from swarm.jsonout import dumps as strict_json  # noqa: E402

ARMS = ("gate", "open")
MAX_FAILED_TRIES = 3  # a downloader whose tries fail this often gives up: its row says "NO" and why


def run_arm(arm: str, downloaders: int, state_mb: int) -> dict:
    """One arm, in this process: a serving peer, ``downloaders`` nodes, one flood."""
    import os

    import torch

    from peer.exchange.gatherer import PayloadGatherer
    from peer.exchange.state_download import StateDownloader, StateServerBusy
    from protocol.dht.keys import averager_prefix
    from protocol.round.timing import Timing
    from protocol.spec import RunSpec
    from swarm.dht.node import start_dht

    spec = RunSpec().replace(run_id="bench-serving")
    timing = Timing() if arm == "gate" else Timing().with_(serves_at_once=1 << 20, serves_per_peer=1 << 20)
    loopback = ["/ip4/127.0.0.1/tcp/0"]
    server_dht = start_dht((), loopback)
    nodes = [start_dht(server_dht.get_visible_maddrs(), loopback) for _ in range(downloaders)]
    server = PayloadGatherer(server_dht, prefix=averager_prefix(spec.run_id), schema=spec.digest().encode(), timing=timing)
    server.run_in_background(await_ready=True)
    state = torch.randn(state_mb << 18)  # state_mb MiB of float32
    server.state_provider = lambda: ({"round": 1}, [state.clone()])  # a copy per download, as the engine's
    server.allow_state_sharing = True
    peer, size = server.peer_id.to_base58(), state.numel() * 4

    class Named:  # what a StateDownloader reads of a gatherer: the name of its handler
        prefix = server.prefix
        _get_handle_name = PayloadGatherer._get_handle_name

    busy, failed, done, ok = [0] * downloaders, [0] * downloaders, [0.0] * downloaders, [False] * downloaders
    errors: list = []
    start = threading.Event()

    def download(i: int) -> None:
        fetch = StateDownloader(nodes[i], Named(), min_rate=1 << 20)
        start.wait()
        while True:  # as peer/round/state_sync.py: busy or failed, asked again a little later
            try:
                _, tensors = fetch(peer, expected_bytes=size, timeout=60.0, tensors=1)
                ok[i] = len(tensors) == 1 and torch.equal(tensors[0], state)
                break
            except StateServerBusy:
                busy[i] += 1
            except Exception as e:  # reported in the row, never a silently dead downloader
                failed[i] += 1
                errors.append(f"downloader {i}: {e!r}"[:300])
                if failed[i] >= MAX_FAILED_TRIES:
                    break
            time.sleep(0.5)
        done[i] = time.monotonic()

    threads = [threading.Thread(target=download, args=(i,)) for i in range(downloaders)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    pids = {"host": os.getpid(), "averager": server.pid}
    base = {k: (proc_status_kib(p, "VmRSS") or 0) for k, p in pids.items()}
    for p in pids.values():
        reset_peak_rss(p)
    t0 = time.monotonic()
    start.set()
    for t in threads:
        t.join(600.0)
    peak = {k: (proc_status_kib(p, "VmHWM") or 0) - base[k] for k, p in pids.items()}
    server.shutdown()
    for n in [*nodes, server_dht]:
        n.shutdown()
    return {"arm": arm, "downloaders": downloaders, "state_mb": state_mb, "all_equal": all(ok),
            "seconds": max(done) - t0, "busy": sum(busy), "failed": sum(failed), "errors": errors[:8],
            "host_peak_mb": peak["host"] / 1024, "averager_peak_mb": peak["averager"] / 1024}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--downloaders", type=int, default=8, help="downloaders asking at the same moment (default: 8)")
    ap.add_argument("--state-mb", type=int, default=64, help="MiB of state the peer serves (default: 64)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"which arms, comma-separated (default: {','.join(ARMS)})")
    ap.add_argument("--json", type=Path, metavar="OUT", help="also write the figures as JSON to OUT")
    ap.add_argument("--arm", help=argparse.SUPPRESS)  # internal: run one arm in this process, print its JSON
    args = ap.parse_args(argv)
    if args.downloaders < 1 or args.state_mb < 1:
        ap.error("--downloaders and --state-mb must be at least 1")
    arms = [a for a in args.arms.split(",") if a]
    if not arms or any(a not in ARMS for a in arms):
        ap.error(f"--arms: names from {', '.join(ARMS)}")
    if args.arm:
        print("RESULT " + json.dumps(run_arm(args.arm, args.downloaders, args.state_mb)), flush=True)
        return 0
    exit_on_sigterm()
    print(f"bench/state_serving.py: {now()}, {machine()}; {args.downloaders} downloaders at once, "
          f"{args.state_mb} MiB of state", flush=True)
    rows = []
    for arm in arms:  # a fresh process each: peak sizes of one arm only
        out = subprocess.run([sys.executable, __file__, "--arm", arm, "--downloaders", str(args.downloaders),
                              "--state-mb", str(args.state_mb)], capture_output=True, text=True, timeout=900)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
        if out.returncode != 0 or not lines:
            print(out.stdout[-2000:], out.stderr[-4000:], file=sys.stderr)
            raise SystemExit(f"arm {arm} failed (exit {out.returncode})")
        rows.append(json.loads(lines[-1][len("RESULT "):]))
        if not rows[-1]["all_equal"]:  # what the arm's process logged, for the reader of the failure
            print(out.stderr[-4000:], file=sys.stderr)
    base = next((r for r in rows if r["arm"] == "open"), None)
    print(table(["arm", "states equal", "host peak MB", "averager peak MB", "all done s", "busy answers",
                 "failed tries", "peak vs open", "time vs open"],
                [[r["arm"], "yes" if r["all_equal"] else "NO", f"{r['host_peak_mb']:.0f}", f"{r['averager_peak_mb']:.0f}",
                  f"{r['seconds']:.1f}", str(r["busy"]), str(r["failed"]),
                  f"{(r['host_peak_mb'] + r['averager_peak_mb']) / max(1e-9, base['host_peak_mb'] + base['averager_peak_mb']):.2f}x" if base else "-",
                  f"{r['seconds'] / base['seconds']:.2f}x" if base else "-"] for r in rows]))
    for r in rows:
        for line in r["errors"]:
            print(f"  {r['arm']}: {line}")
    if args.json:
        args.json.write_text(strict_json({"date": now(), "machine": machine(), "rows": rows}))
    return 0 if all(r["all_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
