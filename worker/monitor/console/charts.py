"""The console's reads behind the charts, on its own connections (``ConsoleData``): tasks
finished per minute, counted by the database from the finished rows retention keeps, and the
minute rollup the workers write (schema/0018) for queue depth and wait times. Both are what every
server shows, since both come from the database alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, TypeVar

import psycopg

from ...db.dsn import scrub
from ...db.sql import Queries
from ..page.trends import MINUTES, WAIT_QUEUES, Depth, Minute, Throughput, Trends, Wait

T = TypeVar("T")

MINUTE_CAP = 100_000  # rows counted per minute and outcome at most
SETTLE_SECONDS = 120  # a minute this long over is counted once and kept
MINUTES_PER_REFRESH = 15  # settled minutes counted per refresh at most (the first view's cost)


def _first_line(exc: BaseException) -> str:
    """An error's first line, any password it names replaced by ***."""
    text = str(exc).strip()
    return scrub(text.splitlines()[0] if text else type(exc).__name__)


class Charts:
    """The chart reads of ``ConsoleData`` (its ``_run``, ``q`` and ``ttl``), each cached for
    ``ttl`` seconds."""

    q: Queries
    ttl: float
    _run: Callable[..., Any]

    def __init__(self) -> None:
        self._minutes: dict[datetime, Minute] = {}
        self._throughput: tuple[float, Throughput] | None = None
        self._tp_lock = threading.Lock()
        self._trends: tuple[float, Trends] | None = None
        self._trends_lock = threading.Lock()

    # throughput

    def throughput(self) -> Throughput:
        """Done and failed tasks per minute over the last hour, by the database's clock. A minute
        over for SETTLE_SECONDS is counted once and kept; the newer ones are counted again at
        each refresh (at most every ``ttl`` seconds), and at most MINUTES_PER_REFRESH missing
        ones are added per refresh, newest first, so that no single view pays for a whole hour
        of a busy table."""
        with self._tp_lock:
            cached = self._throughput
            if cached is not None and time.monotonic() - cached[0] < self.ttl:
                return cached[1]
            try:
                result = self._run(self._count_minutes)
            except psycopg.Error as exc:
                result = Throughput(error=_first_line(exc))
            self._throughput = (time.monotonic(), result)
            return result

    def _count_minutes(self, conn: psycopg.Connection) -> Throughput:
        row = conn.execute(self.q["console_minute"]).fetchone()
        assert row is not None
        now: datetime = row[0]
        window = [now - timedelta(minutes=i) for i in range(MINUTES)]  # newest first
        settled = [m for m in window if now - m >= timedelta(seconds=SETTLE_SECONDS)]
        fresh = [m for m in window if m not in settled]
        missing = [m for m in settled if m not in self._minutes][:MINUTES_PER_REFRESH]
        counted = conn.execute(
            self.q["throughput_minutes"], {"minutes": fresh + missing, "cap": MINUTE_CAP}
        ).fetchall()
        recent = {}
        for at, done, failed in counted:
            minute = Minute(at, int(done), int(failed))
            if at in settled:
                self._minutes[at] = minute
            else:
                recent[at] = minute
        for old in [m for m in self._minutes if m not in window]:
            del self._minutes[old]
        shown = [self._minutes.get(m) or recent.get(m) for m in reversed(window)]
        return Throughput(
            [m for m in shown if m is not None],
            window[-1],
            sum(1 for m in shown if m is None),
            MINUTE_CAP,
        )

    # queue depth and wait times

    def trends(self) -> Trends:
        """The minute rollup of the last hour (schema/0018), read at most every ``ttl``
        seconds: what every server's charts show, since the workers wrote it."""
        with self._trends_lock:
            cached = self._trends
            if cached is not None and time.monotonic() - cached[0] < self.ttl:
                return cached[1]
            try:
                result = self._run(self._read_trends)
            except psycopg.Error as exc:
                result = Trends(error=_first_line(exc))
            self._trends = (time.monotonic(), result)
            return result

    def _read_trends(self, conn: psycopg.Connection) -> Trends:
        window = conn.execute(self.q["trend_window"], {"minutes": MINUTES}).fetchone()
        assert window is not None
        start, end = window
        depth = [
            Depth(at, int(queued), bool(capped), int(running))
            for at, queued, capped, running in conn.execute(self.q["trend_depth"], {"start": start})
        ]
        waits: dict[str, list[Wait]] = {}
        for queue, minute, n, p50, p99 in conn.execute(
            self.q["trend_waits"], {"start": start, "queues": WAIT_QUEUES}
        ):
            waits.setdefault(queue, []).append(Wait(minute, int(n), float(p50), float(p99)))
        return Trends(start, end, depth, waits)


__all__ = ["MINUTE_CAP", "Charts"]
