"""Docker for the tests on a machine that cannot reach Docker Hub: start dockerd, build a stand-in
base image from Debian's packages, serve torch from a simple index on loopback.

Docker Hub is unreachable here, so ``python:3.11-slim`` is replaced by a bookworm ``minbase``
made with debootstrap (Debian's python3 is 3.11) and torch, whose registry is not reachable
either, comes from the wheel pip already finds through its configured find-links. The stand-in is
cached by its tag: a second run skips debootstrap. Only the stand-in gets this machine's CA bundle
(the registries here present a certificate that only it trusts); the project's image never does.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import List, Optional, Sequence

STANDIN_TAG = "voloco-standin/python:3.11-bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
CACHE_DIR = Path(os.environ.get("VOLOCO_DOCKER_CACHE", Path.home() / ".cache" / "voloco-docker-test"))
DOCKER_PACKAGES = ["docker.io", "docker-compose", "debootstrap"]


class DockerUnavailable(Exception):
    """Why Docker cannot run here (the test skips with this reason)."""


def sh(argv: Sequence[str], timeout: float = 600, check: bool = True, **kw) -> subprocess.CompletedProcess:
    """Run a command, capturing its output; on failure raise with the tail of what it printed."""
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, **kw)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited with {r.returncode}:\n{(r.stdout + r.stderr)[-4000:]}")
    return r


def log(msg: str) -> None:
    print(f"[docker {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- the daemon ------------------------------------------------------------------------------

def _daemon_answers() -> bool:
    try:
        return sh(["docker", "info"], timeout=20, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class Dockerd:
    """A running dockerd: the one already there, or one this object started (and stops)."""

    def __init__(self, start_timeout: float = 60):
        self.proc: Optional[subprocess.Popen] = None
        self._log = None
        if shutil.which("docker") and _daemon_answers():
            return
        if os.geteuid() != 0:
            raise DockerUnavailable("no Docker daemon answers and starting one needs root")
        if not (shutil.which("dockerd") and shutil.which("docker")):
            _apt_install(DOCKER_PACKAGES)
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        self._log = open(CACHE_DIR / "dockerd.log", "ab")
        self.proc = subprocess.Popen(["dockerd"], stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + start_timeout
        while not _daemon_answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = (CACHE_DIR / "dockerd.log").read_text(errors="replace")[-1500:]
                raise DockerUnavailable(f"dockerd did not start in {start_timeout:.0f} s:\n{tail}")
            time.sleep(1)
        log(f"started dockerd (pid {self.proc.pid})")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log:
            self._log.close()
        self.proc = None


def _apt_install(packages: List[str]) -> None:
    if not shutil.which("apt-get"):
        raise DockerUnavailable("no dockerd binary and no apt-get to install docker.io")
    r = sh(["apt-get", "install", "-y", *packages], timeout=600, check=False,
           env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    if r.returncode != 0:
        raise DockerUnavailable(f"apt-get install {' '.join(packages)} failed:\n{(r.stdout + r.stderr)[-1500:]}")


@functools.lru_cache(maxsize=1)
def compose_command() -> List[str]:
    """``docker compose`` (v2) where the plugin is there, else ``docker-compose`` (v1)."""
    if sh(["docker", "compose", "version"], check=False).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise DockerUnavailable("neither 'docker compose' nor 'docker-compose' is installed")


def build_env() -> dict:
    """The environment for ``docker build``: the classic builder where no buildx plugin is installed
    (Debian's docker.io has none; a newer CLI would otherwise refuse DOCKER_BUILDKIT=1)."""
    env = dict(os.environ)
    if sh(["docker", "buildx", "version"], check=False).returncode != 0:
        env["DOCKER_BUILDKIT"] = "0"
    return env


def image_exists(tag: str) -> bool:
    return sh(["docker", "image", "inspect", tag], check=False).returncode == 0


# --- the stand-in base image -----------------------------------------------------------------

def pip_cert_bundle() -> Optional[Path]:
    """The CA bundle pip's ``cert`` setting names (``pip config list``), if any."""
    r = sh(["python", "-m", "pip", "config", "list"], check=False)
    for line in r.stdout.splitlines():
        m = re.match(r"^[\w:.-]*\bcert\s*=\s*'?([^']+)'?\s*$", line.strip())
        if m and Path(m.group(1)).is_file():
            return Path(m.group(1))
    return None


STANDIN_DOCKERFILE = """\
FROM {rootfs}
RUN ln -sf /usr/bin/python3 /usr/local/bin/python && ln -sf /usr/bin/pip3 /usr/local/bin/pip
ENV PIP_BREAK_SYSTEM_PACKAGES=1{cert_env}
{cert_copy}
"""


def build_standin(tag: str = STANDIN_TAG) -> float:
    """A ``python:3.11-slim`` stand-in tagged ``tag``: skipped when that tag exists. Returns seconds spent."""
    if image_exists(tag):
        log(f"stand-in base {tag} cached")
        return 0.0
    t0 = time.monotonic()
    if not shutil.which("debootstrap"):
        _apt_install(["debootstrap"])
    with tempfile.TemporaryDirectory(prefix="voloco-standin-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        log("debootstrap bookworm minbase (about a minute)")
        sh(["debootstrap", "--variant=minbase", "--include=python3,python3-pip,python3-venv,ca-certificates",
            "bookworm", str(rootfs), DEBIAN_MIRROR], timeout=900)
        shutil.rmtree(rootfs / "var" / "cache" / "apt" / "archives", ignore_errors=True)
        raw = tag + "-rootfs"
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(["docker", "import", "-", raw], stdin=tar.stdout, check=True, capture_output=True, timeout=600)
        tar.stdout.close()
        if tar.wait() != 0:
            raise RuntimeError("tar of the debootstrap root failed")
        ctx = Path(tmp) / "ctx"
        ctx.mkdir()
        bundle = pip_cert_bundle()
        cert_env = cert_copy = ""
        if bundle:
            shutil.copy(bundle, ctx / "host-ca.crt")
            cert_env = " PIP_CERT=/etc/ssl/certs/host-ca.crt SSL_CERT_FILE=/etc/ssl/certs/host-ca.crt"
            cert_copy = "COPY host-ca.crt /etc/ssl/certs/host-ca.crt"
        (ctx / "Dockerfile").write_text(STANDIN_DOCKERFILE.format(rootfs=raw, cert_env=cert_env, cert_copy=cert_copy))
        sh(["docker", "build", "-t", tag, str(ctx)], timeout=600, env=build_env())
        sh(["docker", "image", "rm", raw], check=False)  # the tag only; its layer stays under the stand-in
    took = time.monotonic() - t0
    log(f"built stand-in base {tag} in {took:.0f} s")
    return took


# --- a simple index on loopback --------------------------------------------------------------

def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def torch_wheels(version: str, dest: Path) -> List[Path]:
    """torch ``version`` and its dependencies as wheels in ``dest`` (pip finds torch through its
    configured find-links; files already there are reused)."""
    dest.mkdir(parents=True, exist_ok=True)
    sh(["python", "-m", "pip", "download", "--quiet", "--only-binary", ":all:", "-d", str(dest), f"torch=={version}"],
       timeout=900)
    return sorted(dest.glob("*.whl"))


def simple_index(wheels: Sequence[Path], root: Path) -> Path:
    """A PEP 503 tree ``root/<project>/<file>`` of ``wheels`` (hard links, else copies)."""
    for whl in wheels:
        d = root / _normalize(whl.name.split("-")[0])
        d.mkdir(parents=True, exist_ok=True)
        target = d / whl.name
        if not target.exists():
            try:
                os.link(whl, target)
            except OSError:
                shutil.copy(whl, target)
    return root


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # pip's requests are not news
        pass


class IndexServer:
    """``http.server`` on 127.0.0.1 serving ``root`` (its directory listings are a simple index)."""

    def __init__(self, root: Path):
        handler = functools.partial(_QuietHandler, directory=str(root))
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


# --- compose ---------------------------------------------------------------------------------

def volume_dir(name: str) -> Optional[Path]:
    """Where a named volume lies on this host (root reads it directly), or None."""
    r = sh(["docker", "volume", "inspect", "-f", "{{.Mountpoint}}", name], check=False)
    return Path(r.stdout.strip()) if r.returncode == 0 and r.stdout.strip() else None


def project_containers(project: str, running_only: bool = False) -> List[str]:
    argv = ["docker", "ps", "-q", "--filter", f"label=com.docker.compose.project={project}"]
    if not running_only:
        argv.insert(2, "-a")
    return sh(argv, check=False).stdout.split()


def remove_project(project: str) -> None:
    """Every container and volume of a compose project, whatever state it was left in."""
    ids = project_containers(project)
    if ids:
        sh(["docker", "rm", "-f", "-v", *ids], check=False)
    vols = sh(["docker", "volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={project}"],
              check=False).stdout.split()
    if vols:
        sh(["docker", "volume", "rm", "-f", *vols], check=False)
    nets = sh(["docker", "network", "ls", "-q", "--filter", f"label=com.docker.compose.project={project}"],
              check=False).stdout.split()
    if nets:
        sh(["docker", "network", "rm", *nets], check=False)
