"""The real docker/Dockerfile built, and docker/compose.yaml run: a coordinator and 3 peers train
to round 2 with equal parameter hashes, the dashboard answers, and ``down -v`` leaves nothing.

Needs root (it starts dockerd, installing docker.io with apt-get where it is missing); skips with
the reason otherwise. Docker Hub is unreachable here: the base is a stand-in built from Debian's
packages and torch comes from a simple index on loopback (tests/support/docker_support.py). Takes 8-9
minutes on 2 busy cores (the image build 4-6 of them); timings are printed (``-s`` shows them).
VOLOCO_DOCKER_KEEP_IMAGE=1 keeps the image (tag voloco-test:dev) so that a rerun builds from
Docker's layer cache; by default the test removes what it built and keeps only the stand-in base.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from tests.support import docker_support as ds
from tests.support.swarm_harness import TINY_SPEC

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker" / "compose.yaml"
TORCH_VERSION = "2.13.0"
PEERS = 3
ROUND = 2


@pytest.fixture(scope="module")
def dockerd():
    try:
        daemon = ds.Dockerd(start_timeout=60)
        ds.compose_command()
    except ds.DockerUnavailable as e:
        pytest.skip(f"Docker cannot run here: {e}")
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"Docker cannot run here: {e}")
    yield daemon
    daemon.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def has_dashboard() -> bool:
    """Whether this tree's coordinator serves a dashboard (``--dashboard-port``)."""
    r = subprocess.run([sys.executable, "-m", "voloco", "coordinator", "--help"], capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
    return "--dashboard-port" in r.stdout


class Compose:
    def __init__(self, project: str, env: Dict[str, str], files: List[Path]):
        self.project = project
        clean = {k: v for k, v in os.environ.items() if not k.startswith("VOLOCO_")}  # only the test's settings
        self.env = {**clean, **env, "COMPOSE_PROJECT_NAME": project}
        self.base = [*ds.compose_command(), "-p", project]
        for f in files:
            self.base += ["-f", str(f)]

    def __call__(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        return ds.sh([*self.base, *args], timeout=timeout, check=check, env=self.env, cwd=ROOT)

    def logs(self, tail: int = 60, limit: int = 12000) -> str:
        r = self("logs", "--no-color", "--tail", str(tail), check=False, timeout=60)
        return (r.stdout + r.stderr)[-limit:]


def peer_statuses(project: str) -> Dict[str, dict]:
    """slot name -> the status JSON its peer writes after every round (read from the volume)."""
    root = ds.volume_dir(f"{project}_peers")
    out: Dict[str, dict] = {}
    if root is None or not root.is_dir():
        return out
    for f in sorted(root.glob("peer-*/status.json")):
        try:
            out[f.parent.name] = json.loads(f.read_text())
        except (OSError, ValueError):
            pass
    return out


def agreed_round(statuses: List[dict], min_round: int) -> Optional[int]:
    """The latest round >= min_round after which every peer reports the same parameter hash."""
    if not statuses:
        return None
    per_peer = [{r["round"]: r["params_hash"] for r in s.get("history", [])} for s in statuses]
    common = set.intersection(*(set(h) for h in per_peer))
    for rnd in sorted((r for r in common if r >= min_round), reverse=True):
        if len({h[rnd] for h in per_peer}) == 1:
            return rnd
    return None


def http_get(url: str, timeout: float = 5) -> tuple:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.headers.get("Content-Type", ""), r.read()


def health(container: str) -> str:
    r = ds.sh(["docker", "inspect", "-f", "{{if .State.Health}}{{.State.Health.Status}}{{end}}", container], check=False)
    return r.stdout.strip()


def wait_until(pred, timeout: float, what: str, diagnostics) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{diagnostics()}")


def test_compose_swarm_in_docker(dockerd, tmp_path):
    timings: Dict[str, float] = {}
    run = uuid.uuid4().hex[:8]
    keep_image = os.environ.get("VOLOCO_DOCKER_KEEP_IMAGE") == "1"
    tag, project = ("voloco-test:dev" if keep_image else f"voloco-test:{run}"), f"volocotest{run}"
    server = None
    t_all = time.monotonic()
    try:
        timings["stand-in base (0: cached)"] = ds.build_standin()

        t0 = time.monotonic()
        wheels = ds.torch_wheels(TORCH_VERSION, ds.CACHE_DIR / "wheels")
        assert any(w.name.startswith(f"torch-{TORCH_VERSION}") for w in wheels), [w.name for w in wheels]
        server = ds.IndexServer(ds.simple_index(wheels, tmp_path / "index"))
        timings["torch index"] = time.monotonic() - t0

        t0 = time.monotonic()
        ds.log(f"docker build {tag} (torch from {server.url})")
        ds.sh(["docker", "build", "--network", "host", "-f", "docker/Dockerfile", "-t", tag,
               "--build-arg", f"BASE_IMAGE={ds.STANDIN_TAG}", "--build-arg", f"TORCH_INDEX={server.url}", "."],
              cwd=ROOT, timeout=900, env=ds.build_env())
        timings["image build"] = time.monotonic() - t0
        ds.log(f"built in {timings['image build']:.0f} s")
        help_text = ds.sh(["docker", "run", "--rm", tag, "--help"]).stdout
        assert "coordinator" in help_text and "peer" in help_text

        spec = tmp_path / "run.toml"
        spec.write_text(TINY_SPEC.format(run_id="docker-test", strategy="sparseloco", inner_steps=10))
        spec.chmod(0o644)
        dashboard = has_dashboard()
        files = [COMPOSE_FILE]
        if not dashboard:  # the coordinator of this tree has no --dashboard-port yet
            override = tmp_path / "no-dashboard.yaml"
            override.write_text('services:\n  coordinator:\n    environment:\n      VOLOCO_DASHBOARD_PORT: ""\n')
            files.append(override)
        dash_port = free_port()
        compose = Compose(project, {
            "VOLOCO_IMAGE": tag, "VOLOCO_CONFIG_FILE": str(spec), "VOLOCO_RUN_ID": f"docker-{run}",
            "VOLOCO_STRATEGY": "sparseloco", "VOLOCO_THREADS": "1", "VOLOCO_PUBLISH_HOST": "127.0.0.1",
            "VOLOCO_PORT": str(free_port()), "VOLOCO_DASHBOARD_PORT": str(dash_port),
        }, files)
        compose("config", "-q")

        t0 = time.monotonic()
        compose("up", "-d", "--no-build", "--scale", f"peer={PEERS}")
        ids = ds.project_containers(project, running_only=True)
        assert len(ids) == PEERS + 1, compose.logs()

        def diagnostics() -> str:
            brief = {slot: [(r["round"], r["params_hash"], len(r["group"])) for r in s.get("history", [])]
                     for slot, s in peer_statuses(project).items()}
            # the lines that tell what each peer saw (joins, downloads, waits, groups it missed), not its round lines
            told = [line for line in compose.logs(tail=100000, limit=1 << 26).splitlines() if " done | " not in line]
            return f"statuses: {brief}\n" + "\n".join(told[:200]) + f"\n{compose.logs()}"

        def reached() -> bool:
            statuses = peer_statuses(project)
            return len(statuses) == PEERS and agreed_round(list(statuses.values()), ROUND) is not None

        wait_until(reached, 300, f"{PEERS} peers at round {ROUND} with equal parameter hashes", diagnostics)
        timings[f"compose up to round {ROUND}"] = time.monotonic() - t0
        statuses = peer_statuses(project)
        rnd = agreed_round(list(statuses.values()), ROUND)
        ds.log(f"{PEERS} peers agree after round {rnd} ({timings[f'compose up to round {ROUND}']:.0f} s after up)")
        assert sorted(statuses) == [f"peer-{i}" for i in range(PEERS)]  # one slot each
        assert len({s["peer_id"] for s in statuses.values()}) == PEERS  # distinct identities
        logs = compose.logs(tail=200)
        assert f"round {ROUND} done" in logs or f"round {rnd} done" in logs, logs

        if dashboard:
            base = f"http://127.0.0.1:{dash_port}"
            status, ctype, body = http_get(base + "/")
            assert status == 200 and b"<" in body, (status, ctype, body[:200])
            assets = set(re.findall(r'(?:src|href)="/?(static/[^"?#]+)', body.decode(errors="replace")))
            for asset in sorted(assets):  # package data: the page's files made it into the image
                status, ctype, data = http_get(f"{base}/{asset}")
                assert status == 200 and data, (asset, status)
            status, ctype, body = http_get(base + "/api/run")
            assert status == 200 and isinstance(json.loads(body), dict), body[:300]
            status, ctype, body = http_get(base + "/metrics")
            assert status == 200 and ctype.startswith("text/plain") and body, (ctype, body[:300])
            ds.log(f"dashboard answers: /, {len(assets)} static files, /api/run, /metrics")
        else:
            ds.log("SKIPPED the dashboard check: the coordinator has no --dashboard-port yet")

        t0 = time.monotonic()
        wait_until(lambda: all(health(c) == "healthy" for c in ids), 90, "every container healthy",
                   lambda: {c: health(c) for c in ids})
        timings["health checks healthy"] = time.monotonic() - t0

        t0 = time.monotonic()
        compose("down", "-v", "--timeout", "10")
        timings["compose down"] = time.monotonic() - t0
        assert ds.project_containers(project) == [], "containers of the project left after down -v"
        assert ds.volume_dir(f"{project}_peers") is None, "the peers volume outlived down -v"
    finally:
        t0 = time.monotonic()
        ds.remove_project(project)
        if not keep_image:
            ds.sh(["docker", "image", "rm", "-f", tag], check=False)
        if server:
            server.close()
        timings["clean-up"] = time.monotonic() - t0
        timings["total"] = time.monotonic() - t_all
        print("\ntimings (s): " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()), flush=True)
