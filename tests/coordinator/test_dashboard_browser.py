"""The dashboard of a real run, in a real browser: a coordinator and two peers on loopback, the page
opened in headless Chromium once the run has a few rounds behind it.

Skipped when no Chromium (or Chrome) is installed (``apt-get install chromium``). With
``VOLOCO_DASHBOARD_SCREENSHOT=PATH`` the screenshot is also copied there (docs/dashboard.png).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest

from tests.support.swarm_harness import Swarm

pytestmark = pytest.mark.slow

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_browser():
    return next((path for path in map(shutil.which, BROWSERS) if path), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fetch(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def snapshot(base: str):
    try:
        return json.loads(fetch(base + "api/snapshot"))
    except (OSError, ValueError):
        return None


def browser(exe: str, tmp: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Headless Chromium with a throw-away profile; ``--no-sandbox``: tests may run as root."""
    argv = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
            "--hide-scrollbars", f"--user-data-dir={tmp / 'profile'}", "--window-size=1280,900",
            "--virtual-time-budget=8000", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def test_dashboard_in_a_browser(tmp_path):
    exe = find_browser()
    if exe is None:
        pytest.skip(f"no headless browser found (looked for {', '.join(BROWSERS)}): apt-get install chromium")
    port, metrics_port = free_port(), free_port()
    base = f"http://127.0.0.1:{port}/"
    swarm = Swarm(tmp_path, inner_steps=10, dashboard_port=port)
    try:
        swarm.add_peer("a", "--wait-peers", "2")
        swarm.add_peer("b", "--wait-peers", "2", "--metrics-port", str(metrics_port))
        joined = lambda name: bool((swarm.status(name) or {}).get("peer_id"))  # noqa: E731
        swarm.wait(lambda: joined("a") and joined("b"), 240, "both peers to join")
        ids = {swarm.status("a")["peer_id"], swarm.status("b")["peer_id"]}

        def ready():
            snap = snapshot(base)
            if not snap or not snap["run"]:
                return False
            rows = {r["peer_id"]: r for r in snap["peers"]["rows"]}
            points = [p for p in snap["history"]["points"] if p["val_loss"] is not None]
            return (ids <= set(rows) and len(points) >= 2 and snap["run"]["round"] >= 2
                    and all(rows[i]["tokens_per_s"] and rows[i]["device"] == "cpu" for i in ids))

        swarm.wait(ready, 300, "the dashboard to show both peers and two rounds of losses")
        assert f"dashboard: {base}" in swarm.coordinator.text()

        snap = snapshot(base)
        run = snap["run"]
        assert run["peers"] == 2 and run["tokens_total"] > 0 and run["bytes_sent_total"] > 0
        assert set(run["members"]) <= ids and run["best_val_loss"] is not None
        for row in snap["peers"]["rows"]:
            assert row["role"] == "full" and 0.0 < row["util"] <= 1.0 and row["reach"] in ("unknown", "public", "client")
        metrics = fetch(base + "metrics")
        assert 'voloco_peers{run="test"} 2.0' in metrics and "voloco_peer_tokens_per_second{" in metrics
        peer_metrics = fetch(f"http://127.0.0.1:{metrics_port}/metrics")
        assert "voloco_peer_round{" in peer_metrics and 'state="training"' in peer_metrics

        dom = browser(exe, tmp_path, "--dump-dom", base)
        assert dom.returncode == 0, dom.stderr[-2000:]
        html = dom.stdout
        (tmp_path / "dom.html").write_text(html)
        rows = re.findall(r'<tr[^>]*data-peer="([^"]+)"[^>]*>(.*?)</tr>', html, flags=re.S)
        assert ids <= {peer for peer, _ in rows}, html[-3000:]
        for peer, cells in rows:
            assert peer in cells  # the id is shown, not only an attribute
            values = re.findall(r'<td class="num[^"]*">([^<]*)</td>', cells)
            assert sum(bool(re.fullmatch(r"[0-9][0-9.,]*\s?[kMGTKB]*B?", v.strip())) for v in values) >= 5, values
        points = re.search(r'<svg id="chart"[^>]*data-points="(\d+)"', html)
        assert points and int(points.group(1)) >= 2, "the loss chart has no points"
        assert html.count("<circle") >= 2 and "<polyline" in html
        assert re.search(r'data-updates="\d+"', html), "the page never loaded the API"

        shot = tmp_path / "dashboard.png"
        res = browser(exe, tmp_path, f"--screenshot={shot}", base)
        assert res.returncode == 0 and shot.is_file() and shot.stat().st_size > 10_000, res.stderr[-2000:]
        copy_to = os.environ.get("VOLOCO_DASHBOARD_SCREENSHOT")
        if copy_to:
            shutil.copyfile(shot, copy_to)
    finally:
        swarm.close()
