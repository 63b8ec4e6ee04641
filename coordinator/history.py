"""The loss history behind the dashboard's chart: a bounded series, kept in the DHT.

``LossSeries`` holds at most ``MAX_POINTS`` points, at most one per round. Kept points lie on a grid
of ``stride`` rounds; when the series is full, every other one goes and the stride doubles, so a
long run keeps an evenly spaced outline of its whole history. The newest point may lie between two
grid rounds: it is replaced by the next one.

``HistoryKeeper`` samples the swarm once per coordinator pass (from the snapshot of
coordinator/run_view.py), stores the series in the DHT signed by the run's key (protocol/dht/history.py,
swarm/records.py) when it changed and at least every ``refresh`` seconds, and, after a restart,
reads back what an earlier coordinator stored and merges it in front of its own points. It stores
nothing before that read succeeded or ``restore_for`` seconds passed: its record has the same owned
subkey as the earlier coordinator's (the run's key) and would replace it.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict
from typing import Any, Dict, List, Optional

from protocol.dht.history import HISTORY_TTL, MAX_COUNT, MAX_POINTS, HistoryPoint, HistoryRecord

logger = logging.getLogger("voloco.coordinator")


class LossSeries:
    def __init__(self, max_points: int = MAX_POINTS):
        if max_points < 3:
            raise ValueError("a series keeps at least 3 points")
        self.max_points = max_points
        self.stride = 1
        self.points: List[HistoryPoint] = []

    def add(self, point: HistoryPoint) -> bool:
        """Add the sample of ``point.round``; returns whether the series changed. A round before the
        newest is ignored (the swarm's round never goes back; a restored history is merged instead)."""
        last = self.points[-1] if self.points else None
        if last is not None and point.round < last.round:
            return False
        if last is not None and point.round == last.round:
            if point == last:
                return False
            self.points[-1] = point
            return True
        if last is not None and len(self.points) > 1 and last.round % self.stride:
            self.points.pop()  # an off-grid newest point gives way to the next newest
        self.points.append(point)
        self._thin()
        return True

    def merge(self, older: HistoryRecord) -> None:
        """Put the points of an earlier coordinator before this one's (rounds this one holds win)."""
        first = self.points[0].round if self.points else math.inf
        before = [p for p in older.points if p.round < first]
        self.points = before + self.points
        self.stride = max(self.stride, older.stride)
        self._thin()

    def _thin(self) -> None:
        while len(self.points) > self.max_points:
            self.stride *= 2
            newest = self.points[-1]
            self.points = [p for p in self.points[:-1] if p.round % self.stride == 0] + [newest]
            if len(self.points) > self.max_points:  # rounds too sparse for the grid: keep every other one
                self.points = self.points[:-1:2] + [newest]

    def record(self, spec_digest: str) -> HistoryRecord:
        return HistoryRecord(spec=spec_digest, stride=self.stride, points=list(self.points))

    def as_json(self) -> Dict[str, Any]:
        return {"stride": self.stride, "points": [asdict(p) for p in self.points]}


def sample(run: Dict[str, Any], now: Optional[float] = None) -> Optional[HistoryPoint]:
    """The history point of a snapshot's run section; None before any live peer reported a round."""
    if run["round"] < 0 or run["peers"] == 0 or run["round"] > MAX_COUNT:
        return None  # a round past MAX_COUNT is no honest one, and would make the stored record unreadable
    nan = float("nan")
    return HistoryPoint(  # totals are sums of peers' claims: capped, so the record always parses (and packs)
        round=int(run["round"]),
        tokens=min(int(run["tokens_total"]), MAX_COUNT),
        bytes=min(int(run["bytes_sent_total"]), MAX_COUNT),
        peers=int(run["peers"]),
        loss=run["loss"] if run["loss"] is not None else nan,
        val_loss=run["val_loss"] if run["val_loss"] is not None else nan,
        time=time.time() if now is None else now,
    )


class HistoryKeeper:
    """The series, its copy in the DHT, and the restore of an earlier coordinator's copy.

    ``store(record)`` and ``load()`` do the DHT I/O (swarm.records ``publish_history`` and
    ``read_history``); the coordinator calls ``observe`` from its watch loop, one thread."""

    def __init__(self, spec_digest: str, store, load, refresh: float = HISTORY_TTL / 6, restore_for: float = 60.0,
                 max_points: int = MAX_POINTS, clock=time.monotonic):
        self.spec_digest = spec_digest
        self.series = LossSeries(max_points)
        self._store, self._load, self._clock = store, load, clock
        self.refresh = refresh
        self._started = clock()
        self._restore_until = self._started + restore_for
        self.restored: Optional[int] = None  # how many points came back from the DHT
        self._dirty = False
        self._stored_at = -math.inf

    def observe(self, run: Dict[str, Any]) -> None:
        """One coordinator pass: restore if still due, add the sample, store if due."""
        now = self._clock()
        if self.restored is None and now <= self._restore_until:
            self._try_restore()
        point = sample(run)
        if point is not None and self.series.add(point):
            self._dirty = True
        if self.restored is None and now <= self._restore_until:
            return  # storing first would overwrite the earlier coordinator's copy (the same owned subkey)
        if self.series.points and (self._dirty and now - self._stored_at >= 5.0 or now - self._stored_at >= self.refresh):
            self._put(now)

    def flush(self, timeout: float = 5.0) -> None:
        """Store what has not been stored yet and wait for it (the coordinator stops)."""
        if self._dirty and self.series.points and (self.restored is not None or self._clock() > self._restore_until):
            self._put(self._clock(), timeout)

    def _put(self, now: float, wait: Optional[float] = None) -> None:
        try:
            stored = self._store(self.series.record(self.spec_digest))
            if wait is not None and hasattr(stored, "result"):
                stored.result(timeout=wait)
            self._stored_at, self._dirty = now, False
        except Exception as e:  # a DHT hiccup: the next pass tries again
            logger.warning(f"could not store the loss history: {e!r}")

    def _try_restore(self) -> None:
        try:
            older = self._load()
        except Exception as e:
            logger.debug(f"could not read the loss history: {e!r}")
            return
        if older is None or older.spec != self.spec_digest:
            return
        self.series.merge(older)
        self.restored = len(older.points)
        self._dirty = True
        logger.info(f"restored the loss history: {self.restored} points up to round {older.points[-1].round}"
                    if older.points else "restored an empty loss history")

    @property
    def floor(self) -> Dict[str, int]:
        """Tokens and bytes the restored history had counted (a restarted coordinator never shows less)."""
        last = self.series.points[-1] if self.series.points else None
        return {"tokens": last.tokens if last else 0, "bytes": last.bytes if last else 0}
