#!/usr/bin/env python
"""voloco-container: the image's glue for compose, installed as /usr/local/bin/voloco-container.

  voloco-container coordinator [FLAG...]   a coordinator whose settings come from the environment
  voloco-container peer [FLAG...]          a peer with its own slot (identity, checkpoint, status)
  voloco-container health                  the image's HEALTHCHECK, for either role

The variables are voloco's own (``VOLOCO_`` and a flag's name, see swarm/settings.py); this script
turns the ones it knows into flags, so they work whatever voloco reads, and drops empty ones before
starting voloco (compose's ``${VAR:-}`` gives an empty value for "not set"):
  both:        VOLOCO_ANNOUNCE_MADDRS, VOLOCO_JOIN_TOKEN (a private run's token: passed in a file,
               out of the process list) or VOLOCO_JOIN_TOKEN_FILE, VOLOCO_LOG_LEVEL, and VOLOCO_PORT:
               the TCP port to listen on (coordinator 31337, peer any; or VOLOCO_HOST_MADDRS)
  coordinator: VOLOCO_CONFIG (default /config/run.toml where it exists), VOLOCO_RUN_ID,
               VOLOCO_STRATEGY, VOLOCO_DASHBOARD_PORT, VOLOCO_IDENTITY (/data/coordinator.key)
  peer:        VOLOCO_JOIN and VOLOCO_RUN_KEY (default: the local coordinator's, read from
               $VOLOCO_SHARED/coordinator.addr), VOLOCO_RUN, VOLOCO_DEVICE (auto), VOLOCO_THREADS,
               VOLOCO_PEERS_DIR (/peers: where the slots are), VOLOCO_HEALTH_MAX_AGE (900 s)
  VOLOCO_SHARED (/shared): where the coordinator writes its join address and run key.

A peer claims the first slot ``$VOLOCO_PEERS_DIR/peer-N`` whose lock no live process holds and
holds that lock for its life (the descriptor survives the exec): peers scaled up on one volume
never share an identity, and a restarted or re-created container takes a free slot back, with its
identity and checkpoint, instead of starting afresh.
"""

from __future__ import annotations

import fcntl
import os
import re
import sys
import time
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional, Tuple

# (variable, flag, several values) turned into flags when set
BOTH = [("VOLOCO_HOST_MADDRS", "--host-maddrs", True), ("VOLOCO_ANNOUNCE_MADDRS", "--announce-maddrs", True),
        ("VOLOCO_JOIN_TOKEN_FILE", "--join-token-file", False), ("VOLOCO_LOG_LEVEL", "--log-level", False)]
COORDINATOR = [("VOLOCO_CONFIG", "--config", False), ("VOLOCO_RUN_ID", "--run-id", False),
               ("VOLOCO_STRATEGY", "--strategy", False), ("VOLOCO_DASHBOARD_PORT", "--dashboard-port", False),
               ("VOLOCO_IDENTITY", "--identity", False)]
PEER = [("VOLOCO_JOIN", "--join", True), ("VOLOCO_RUN_KEY", "--run-key", False), ("VOLOCO_RUN", "--run", False),
        ("VOLOCO_DEVICE", "--device", False), ("VOLOCO_THREADS", "--threads", False)]


def env(name: str, default: str = "") -> str:
    return os.environ.get(name, "").strip() or default


def die(msg: str) -> None:
    print(f"voloco-container: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def flags_from_env(table: List[Tuple[str, str, bool]]) -> List[str]:
    out: List[str] = []
    for var, flag, several in table:
        if env(var):
            out += [flag, *(re.split(r"[\s,]+", env(var)) if several else [env(var)])]
    return out


def exec_voloco(args: List[str]) -> None:
    token = os.environ.pop("VOLOCO_JOIN_TOKEN", "").strip()
    if token:  # a file keeps the secret out of /proc/*/environ and the process list
        path = Path(os.environ.get("HOME") or "/tmp") / ".voloco-join-token"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, (token + "\n").encode())
        os.close(fd)
        os.environ["VOLOCO_JOIN_TOKEN_FILE"] = str(path)
        args = [*args, "--join-token-file", str(path)]
    for name in [k for k, v in os.environ.items() if k.startswith("VOLOCO_") and not v.strip()]:
        del os.environ[name]  # empty means "not set"; voloco would read it as a value
    print("voloco " + " ".join(args), flush=True)
    os.execvp("voloco", ["voloco", *args])


def coordinator(extra: List[str]) -> None:
    shared = Path(env("VOLOCO_SHARED", "/shared"))
    if not env("VOLOCO_HOST_MADDRS"):
        os.environ["VOLOCO_HOST_MADDRS"] = f"/ip4/0.0.0.0/tcp/{env('VOLOCO_PORT', '31337')}"
    if not env("VOLOCO_CONFIG") and Path("/config/run.toml").is_file():
        os.environ["VOLOCO_CONFIG"] = "/config/run.toml"
    os.environ["VOLOCO_IDENTITY"] = env("VOLOCO_IDENTITY", "/data/coordinator.key")
    # a stale address from the last start must not send peers to an old container address
    for stale in (shared / "coordinator.addr", shared / "coordinator.addr.run-key"):
        stale.unlink(missing_ok=True)
    exec_voloco(["coordinator", "--address-file", str(shared / "coordinator.addr"),
                 *flags_from_env(BOTH + COORDINATOR), *extra])


def claim_slot(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for n in range(10_000):
        slot = root / f"peer-{n}"
        slot.mkdir(exist_ok=True)
        fd = os.open(slot / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        os.set_inheritable(fd, True)  # held by the peer process after exec, released when it dies
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.uname().nodename}\n".encode())
        return slot
    die(f"no free slot under {root}")


def local_join(shared: Path, timeout: float = 600) -> None:
    """Wait for the coordinator's address (not loopback: that is its own container) and run key."""
    addr_file, key_file = shared / "coordinator.addr", shared / "coordinator.addr.run-key"
    deadline = time.monotonic() + timeout
    print(f"waiting for the coordinator's address in {addr_file}", flush=True)
    while time.monotonic() < deadline:
        if addr_file.is_file() and key_file.is_file():
            addrs = [a for a in addr_file.read_text().split() if "/127.0.0.1/" not in a and "/::1/" not in a]
            if addrs:
                os.environ["VOLOCO_JOIN"] = addrs[0]
                os.environ["VOLOCO_RUN_KEY"] = env("VOLOCO_RUN_KEY", key_file.read_text().strip())
                return
        time.sleep(1)
    die(f"no coordinator address in {addr_file} after {timeout:.0f} s (set VOLOCO_JOIN to join a remote run)")


def peer(extra: List[str]) -> None:
    if not env("VOLOCO_JOIN"):
        local_join(Path(env("VOLOCO_SHARED", "/shared")))
    if not env("VOLOCO_HOST_MADDRS"):
        os.environ["VOLOCO_HOST_MADDRS"] = f"/ip4/0.0.0.0/tcp/{env('VOLOCO_PORT', '0')}"
    os.environ["VOLOCO_DEVICE"] = env("VOLOCO_DEVICE", "auto")
    slot = claim_slot(Path(env("VOLOCO_PEERS_DIR", "/peers")))
    print(f"slot {slot}", flush=True)
    exec_voloco(["peer", "--identity", str(slot / "identity.key"), "--checkpoint-dir", str(slot / "checkpoint"),
                 "--status-file", str(slot / "status.json"), *flags_from_env(BOTH + PEER), *extra])


# --- health ----------------------------------------------------------------------------------

def voloco_process() -> Optional[Tuple[List[str], Dict[str, str], Path]]:
    """The command line (from the subcommand on), environment and working directory of this
    container's voloco process (PID 1, or under an init)."""
    for pid in sorted((p for p in os.listdir("/proc") if p.isdigit()), key=int):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        for i, a in enumerate(argv[:-1]):
            if (a == "voloco" or a.endswith("/voloco")) and argv[i + 1] in ("coordinator", "peer"):
                try:
                    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
                except OSError:
                    raw = []
                try:
                    cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
                except OSError:
                    cwd = Path("/")
                return argv[i + 1:], dict(kv.split("=", 1) for kv in raw if "=" in kv), cwd
    return None


def setting(argv: List[str], environ: Dict[str, str], name: str) -> Optional[str]:
    """A flag's value as the process got it: from its command line, else its VOLOCO_ variable."""
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return environ.get("VOLOCO_" + name.lstrip("-").upper().replace("-", "_")) or None


def health() -> int:
    """0 when healthy: a coordinator's dashboard answers (or, with no dashboard, its address file
    is written); a peer's status file was rewritten within VOLOCO_HEALTH_MAX_AGE s (900). A peer
    without a status file, and ``voloco --help``, are healthy while they run."""
    found = voloco_process()
    if found is None:
        print("no voloco process")
        return 1
    argv, environ, cwd = found
    if argv[0] == "coordinator":
        port = setting(argv, environ, "--dashboard-port")
        if port and port != "0":
            url = f"http://127.0.0.1:{port}/api/run"
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    r.read()
                return 0
            except Exception as e:  # anything short of an answer is unhealthy
                print(f"{url}: {e}")
                return 1
        addr = setting(argv, environ, "--address-file")
        if addr and not (cwd / addr).is_file():
            print(f"{addr} not written yet")
            return 1
        return 0
    status = setting(argv, environ, "--status-file")
    if not status:
        return 0
    max_age = float(env("VOLOCO_HEALTH_MAX_AGE", "900"))
    try:
        age = time.time() - (cwd / status).stat().st_mtime
    except OSError:
        print(f"{status}: no round finished yet")
        return 1
    if age > max_age:
        print(f"{status}: last round ended {age:.0f} s ago (limit {max_age:.0f} s)")
        return 1
    print(f"last round ended {age:.0f} s ago")
    return 0


def main(argv: List[str]) -> int:
    if not argv or argv[0] not in ("coordinator", "peer", "health"):
        print(__doc__)
        return 2
    if argv[0] == "health":
        return health()
    {"coordinator": coordinator, "peer": peer}[argv[0]](argv[1:])
    return 0  # not reached: exec


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
