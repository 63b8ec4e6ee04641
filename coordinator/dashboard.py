"""The coordinator's web dashboard, its JSON API and its Prometheus metrics.

``Dashboard.refresh`` runs in the coordinator's watch loop (the one thread that talks to the DHT):
it reads the progress records, chain assignments and candidates, builds a snapshot
(coordinator/run_view.py), adds a point to the loss history (coordinator/history.py) and swaps the
snapshot in. ``WebServer`` runs aiohttp on an event loop of its own in a background thread and
only ever reads the latest snapshot:

    GET /               the page (coordinator/static/: vanilla JS, an SVG chart drawn in place)
    GET /api/snapshot   everything below in one document (what the page polls every 2 s)
    GET /api/run        the run: round, members, peers, tokens, bytes, losses
    GET /api/peers      the peers table ({"total", "shown", "rows"})
    GET /api/chains     the chains and their stages
    GET /api/history    the loss history ({"stride", "points"})
    GET /metrics        Prometheus text format (coordinator/metrics.py)

Everything is strict JSON (swarm/jsonout.py: NaN and infinities become null). Every page response
carries a Content-Security-Policy that allows only this origin's script and no inline script, so
even a string a peer wrote that slipped past the page's text-only rendering could not run.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional

from aiohttp import web
from hivemind.utils import get_dht_time
from prometheus_client import CONTENT_TYPE_LATEST

from coordinator.history import HistoryKeeper
from coordinator.metrics import make_registry, render
from coordinator.run_view import RunInfo, Totals, build_snapshot
from protocol.dht.records import peer_record_ttl
from swarm.jsonout import dumps
from swarm.records import publish_history, read_assignments, read_candidates, read_history, read_progress

logger = logging.getLogger("voloco.coordinator")

STATIC = Path(__file__).resolve().parent / "static"
SECTIONS = ("run", "peers", "chains", "history")
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def json_response(value: Any) -> web.Response:
    return web.Response(text=dumps(value), content_type="application/json", headers=HEADERS)


def make_app(snapshot: Callable[[], Optional[Dict[str, Any]]]) -> web.Application:
    """The aiohttp application over a snapshot getter; no DHT here (tests give a fake snapshot)."""
    registry = make_registry(snapshot)

    def current() -> Dict[str, Any]:
        return snapshot() or {"run": None, "peers": {"total": 0, "shown": 0, "rows": []}, "chains": [],
                              "history": {"stride": 1, "points": []}}

    async def page(request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC / "index.html", headers=HEADERS)

    async def whole(request: web.Request) -> web.Response:
        return json_response(current())

    def section(name: str):
        async def handler(request: web.Request) -> web.Response:
            return json_response(current()[name])
        return handler

    async def metrics(request: web.Request) -> web.Response:
        body = await asyncio.get_running_loop().run_in_executor(None, render, registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST, "Cache-Control": "no-store"})

    @web.middleware
    async def secure(request: web.Request, handler):
        response = await handler(request)
        for k, v in HEADERS.items():
            response.headers.setdefault(k, v)
        return response

    app = web.Application(middlewares=[secure])
    app.router.add_get("/", page)
    app.router.add_get("/api/snapshot", whole)
    for name in SECTIONS:
        app.router.add_get(f"/api/{name}", section(name))
    app.router.add_get("/metrics", metrics)
    app.router.add_static("/static/", STATIC, follow_symlinks=False)
    return app


class WebServer:
    """An aiohttp app served from a background thread with its own event loop."""

    def __init__(self, app: web.Application, host: str, port: int):
        self.app, self.host, self.port = app, host, port
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None

    def start(self, timeout: float = 10.0) -> "WebServer":
        """Bind and serve; raises OSError if the address cannot be bound."""
        self._thread = threading.Thread(target=self._serve, name="voloco-web", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise OSError(f"the web server did not start in {timeout:.0f} s")
        if self._error is not None:
            raise self._error
        return self

    def _serve(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=1.0)  # aiohttp >= 3.9
        try:
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, self.host, self.port)
            loop.run_until_complete(site.start())
            bound = [a for a in runner.addresses if isinstance(a, tuple)]
            if bound:
                self.port = bound[0][1]
        except BaseException as e:  # noqa: B902 - reported to start()
            self._error = e
            loop.run_until_complete(runner.cleanup())
            loop.close()
            self._ready.set()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(runner.cleanup())
            loop.close()

    def stop(self, timeout: float = 5.0) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)


def dashboard_url(host: str, port: int) -> str:
    shown = "localhost" if host in ("0.0.0.0", "::", "") else (f"[{host}]" if ":" in host else host)
    return f"http://{shown}:{port}/"


class Dashboard:
    """The snapshot the web server shows, refreshed from the DHT by the coordinator's watch loop."""

    def __init__(self, dht, spec, clock: Callable[[], float] = time.monotonic, restore_for: float = 60.0):
        self.dht, self.spec = dht, spec
        self.info = RunInfo(run_id=spec.run_id, spec=spec.digest(), strategy=spec.outer.strategy,
                            params=spec.model.num_params(), inner_steps=spec.outer.inner_steps,
                            slices=spec.partial.slices, heartbeat_period=spec.swarm.heartbeat_period)
        self.totals = Totals()
        self.keeper = HistoryKeeper(self.info.spec, lambda rec: publish_history(dht, spec, rec),
                                    lambda: read_history(dht, spec), restore_for=restore_for, clock=clock)
        self.snapshot: Optional[Dict[str, Any]] = None
        self.server: Optional[WebServer] = None

    def serve(self, host: str, port: int) -> Optional[str]:
        """Start the web server; its URL, or None (logged) when the address cannot be bound."""
        try:
            self.server = WebServer(make_app(lambda: self.snapshot), host, port).start()
        except OSError as e:
            logger.warning(f"dashboard: cannot listen on {host}:{port} ({e.strerror or e}); the run goes on without "
                           f"it (choose another --dashboard-port, or 0 to turn it off)")
            self.server = None
            return None
        return dashboard_url(host, self.server.port)

    def refresh(self) -> None:
        """Read the DHT and rebuild the snapshot (the coordinator's watch loop calls this)."""
        views = read_progress(self.dht, self.spec.run_id)
        assignments = read_assignments(self.dht, self.spec)
        candidates = read_candidates(self.dht, self.spec)
        floor = self.keeper.floor
        self.totals.tokens.floor, self.totals.sent.floor = floor["tokens"], floor["bytes"]
        snap = build_snapshot(self.info, views, assignments, candidates, now=get_dht_time(),
                              record_ttl=peer_record_ttl(self.spec.swarm.heartbeat_period), totals=self.totals,
                              history=self.keeper.series.as_json(), wall_time=time.time())
        self.keeper.observe(snap["run"])
        snap["history"] = self.keeper.series.as_json()
        self.snapshot = snap

    def stop(self) -> None:
        """Stop serving, and store the loss history's last points (the DHT is still up)."""
        self.keeper.flush()
        if self.server is not None:
            self.server.stop()
            self.server = None
