"""The read model behind the status page, /readyz and the queue gauges.

Everything the monitor reads from the database goes through ``Database``, which caches: every
scrape and page view within a cache period shares one query set, so scrapers and browsers cannot
multiply the load on the database, and none of the statements counts the finished history (see
readmodel.sql).

Over 400 lines on purpose: one cache over one connection, read by the page, the gauges, /readyz
and the health panel; each reader's refresh shares the lock and the connection's recovery.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from psycopg.rows import dict_row

from ..coord import pause as _pause
from ..db.connect import METRICS, READYZ, connect
from ..db.dsn import redact, scrub
from ..db.migrate import current_version, latest_version
from ..db.sql import queries
from ..ops import status as _admin
from ..ops import workflows as _workflows
from ..ops.status import ALIVE_SECONDS, MissingHandler, QueueStats, Routing
from ..tasks import limits as _limits
from ..tasks.limits import QueueLimits
from .bounds import ERROR_CHARS, QUEUES_PER_PAGE, ROWS_SHOWN, QueueRow
from .doctor import checkup as doctor

# The statements of this room lie beside its modules (the core never loads them).
SQL_DIR = Path(__file__).resolve().parent

log = logging.getLogger("worker.metrics")

T = TypeVar("T")

READY_CACHE_SECONDS = 1.0
FAILED_SHOWN = 20
# Queue names the statistics walk at most (one index probe each, about 25 µs): the queues past
# them are counted together (see queue_rest in ops/status.sql).
MAX_QUEUES = 10_000
# The queues past them are counted in one range scan per state, together, up to this many rows.
REST_CAP = 100_000
# Done and cancelled rows are counted per queue (exactly) only while the table holds fewer than
# this many; above it the page shows the planner's per-queue estimates.
FINISHED_CAP = 10_000

# -- data ------------------------------------------------------------------------------------------


PAUSED_LISTED = 1000  # paused queues read per refresh (each one a metrics series)


@dataclass
class Snapshot:
    """The queue statistics of one refresh (or the error that refresh met)."""

    taken: float
    wall: datetime
    queues: list[QueueRow] = field(default_factory=list)
    estimates: dict[str, float] = field(default_factory=dict)
    workers_alive: int = 0
    in_flight: int = 0
    # The queues past the scan limit, summed (queue is the last name scanned), or None when the
    # scan saw every queue.
    rest: QueueRow | None = None
    # Queues nobody serves and tasks nobody has a handler for (see ops.status.Routing).
    routing: Routing = field(default_factory=lambda: Routing([], [], 0))
    duration: float = 0.0
    error: str | None = None
    # Paused queues (schema/0009), by name, at most PAUSED_LISTED of them.
    paused: list[str] = field(default_factory=list)
    # Limited queues (schema/0014) with their counts, at most PAUSED_LISTED of them.
    limits: list[QueueLimits] = field(default_factory=list)
    # Workflows (schema/0022) with steps not finished: {"steps": {state: n}, "workflows": n}.
    workflows: dict[str, Any] = field(default_factory=dict)

    def age(self) -> float:
        return time.monotonic() - self.taken


@dataclass
class PageData:
    snapshot: Snapshot
    taken: float
    wall: datetime
    version: int = 0
    # Done and cancelled rows per (queue, state): exact when ``finished_exact``, otherwise the
    # planner's estimates (for the first queues only).
    finished: dict[tuple[str, str], int] = field(default_factory=dict)
    finished_exact: bool = True
    workers: list[dict[str, Any]] = field(default_factory=list)
    failed: list[dict[str, Any]] = field(default_factory=list)
    cron_schedules: list[dict[str, Any]] | None = None  # None: no cron table
    cron_runs: list[dict[str, Any]] = field(default_factory=list)
    locks: list[dict[str, Any]] | None = None  # None: no lock table
    advisory: list[dict[str, Any]] = field(default_factory=list)
    # Each list above holds at most ROWS_SHOWN + 1 rows: one more than the page shows, to know
    # that there are more.
    error: str | None = None
    health: doctor.Report | None = None  # the doctor's cheap checks (see Database.health)

    def age(self) -> float:
        return time.monotonic() - self.taken


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return scrub(text.splitlines()[0] if text else type(exc).__name__)


# -- the database side -----------------------------------------------------------------------------


class Database:
    """Cached, read-only access for the metrics server.

    One connection, used under a lock: concurrent scrapes wait for the refresh in progress and
    share its result instead of starting their own. Every read runs in a READ ONLY transaction
    with a statement timeout, so a slow database delays a scrape by seconds at most and the page
    can never write.
    """

    def __init__(
        self,
        dsn: str,
        schema: str,
        *,
        ttl: float = 10.0,
        count_cap: int = 10_000,
        max_queues: int = MAX_QUEUES,
        alive_seconds: float = ALIVE_SECONDS,
        connect_timeout: int = 3,
        statement_timeout_ms: int = 5000,
    ) -> None:
        self.dsn = dsn
        self.schema = schema
        self.ttl = ttl
        self.count_cap = count_cap
        self.max_queues = max_queues
        self.alive_seconds = alive_seconds
        self.connect_timeout = connect_timeout
        self.statement_timeout_ms = statement_timeout_ms
        self.q = queries(schema, SQL_DIR)
        self.expected_version = latest_version()
        self._conn: psycopg.Connection | None = None
        self._lock = threading.Lock()
        self._snapshot: Snapshot | None = None
        self._page: PageData | None = None
        self._health: doctor.Report | None = None
        self._ready_lock = threading.Lock()
        self._ready: tuple[float, bool, str] | None = None

    @property
    def display_dsn(self) -> str:
        return redact(self.dsn)

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None

    def _run(self, fn: Callable[[psycopg.Connection], T]) -> T:
        """Run ``fn`` in a read-only transaction; reconnect once if the kept connection broke."""
        for attempt in (1, 2):
            fresh = self._conn is None or self._conn.closed
            if fresh:
                # Never prepared, no session setting: PgBouncer in transaction mode may sit
                # between (statement timeouts are set per transaction, below).
                duty = replace(METRICS, connect_timeout=self.connect_timeout)
                conn = connect(self.dsn, duty, session=False)
                conn.read_only = True
                # One moment for all the reads of a snapshot: its counts agree with each other.
                conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
                self._conn = conn
            conn = self._conn
            assert conn is not None
            try:
                with conn.transaction():
                    # set_config(..., true) is SET LOCAL: it also behaves behind PgBouncer.
                    conn.execute(
                        "SELECT set_config('statement_timeout', %s, true)",
                        (str(self.statement_timeout_ms),),
                    )
                    conn.execute(self.q["no_jit"])
                    return fn(conn)
            except psycopg.OperationalError:
                self._close()
                if fresh or attempt == 2:
                    raise
        raise AssertionError("unreachable")

    # queue statistics (for /metrics and the page)

    def queue_snapshot(self) -> Snapshot:
        snap = self._snapshot
        if snap is not None and snap.age() < self.ttl:
            return snap
        with self._lock:
            snap = self._snapshot
            if snap is not None and snap.age() < self.ttl:
                return snap  # another thread refreshed it while we waited
            snap = self._refresh_snapshot()
            self._snapshot = snap
            return snap

    def _refresh_snapshot(self) -> Snapshot:
        start = time.monotonic()
        try:
            snap = self._run(self._read_snapshot)
        except psycopg.Error as exc:
            log.warning("queue statistics unavailable: %s", _first_line(exc))
            return Snapshot(time.monotonic(), datetime.now(UTC), error=_first_line(exc))
        snap.duration = time.monotonic() - start
        return snap

    def _read_snapshot(self, conn: psycopg.Connection) -> Snapshot:
        q, cap = self.q, self.count_cap
        scan = _admin.queue_stats(
            conn,
            self.schema,
            cap=cap,
            failed_cap=cap,
            max_queues=self.max_queues,
            alive_seconds=self.alive_seconds,
        )
        cells = [(s.queue, state) for s in scan.queues for state in s.capped]
        guesses = _admin.estimates(conn, self.schema, cells)
        queues = [_row(s, guesses) for s in scan.queues]
        rest = None
        if scan.truncated_after is not None:  # the scan stopped early: count the rest
            last = scan.truncated_after
            # Only running or served queues can be listed without having been scanned.
            listed = [r.queue for r in queues if r.queue > last]
            rest_cap = max(cap, REST_CAP)
            queued, delayed = _admin.queue_rest(
                conn, self.schema, after=last, listed=listed, cap=rest_cap
            )
            rest = QueueRow(last, queued, delayed, 0, max(queued, delayed) >= rest_cap, None)
        missing = _admin.missing_handlers(
            conn, self.schema, scan.queues, alive_seconds=self.alive_seconds, cap=cap
        )
        estimates = {
            state: float(n)
            for state, n in conn.execute(
                q["metrics_state_estimates"], {"schema": self.schema}
            ).fetchall()
        }
        alive, in_flight = conn.execute(
            q["metrics_workers_alive"], {"alive_seconds": self.alive_seconds}
        ).fetchone() or (0, 0)
        paused = [p.queue for p in _pause.paused(conn, self.schema, limit=PAUSED_LISTED)]
        limits = _limits.list_limits(conn, self.schema, limit=PAUSED_LISTED)
        flows = _workflows.workflow_gauges(conn, self.schema, cap=max(cap, REST_CAP))
        return Snapshot(
            time.monotonic(),
            datetime.now(UTC),
            queues=queues,
            paused=paused,
            limits=limits,
            workflows=flows,
            rest=rest,
            routing=Routing(_admin.unserved(scan.queues), missing, int(alive)),
            estimates=estimates,
            workers_alive=int(alive),
            in_flight=int(in_flight),
        )

    # the doctor's checks (for /metrics and the page), but the claim probe

    def health(self) -> doctor.Report:
        """`worker doctor` without its claim probe, cached like the queue statistics: a few
        reads of the statistics views, each bounded by a short statement timeout."""
        report = self._health
        if report is not None and report.age() < self.ttl:
            return report
        snap = self.queue_snapshot()
        with self._lock:
            report = self._health
            if report is not None and report.age() < self.ttl:
                return report
            if snap.error:  # the database just failed: no second wait for it in this scrape
                self._health = doctor.failed(self.schema, snap.error)
                return self._health
            routing = snap.routing
            try:
                report = self._run(
                    lambda conn: doctor.diagnose(
                        conn,
                        self.schema,
                        probe="off",
                        routing=routing,
                        statement_ms=min(self.statement_timeout_ms, doctor.SCRAPE_STATEMENT_MS),
                    )
                )
            except psycopg.Error as exc:
                log.warning("database health checks unavailable: %s", _first_line(exc))
                report = doctor.failed(self.schema, _first_line(exc))
            self._health = report
            return report

    # the status page

    def page(self) -> PageData:
        snap = self.queue_snapshot()
        health = self.health()
        page = self._page
        if page is not None and page.age() < self.ttl and page.snapshot is snap:
            return page
        with self._lock:
            page = self._page
            if page is not None and page.age() < self.ttl and page.snapshot is snap:
                return page
            try:
                page = self._run(lambda conn: self._read_page(conn, snap))
            except psycopg.Error as exc:
                page = PageData(snap, time.monotonic(), datetime.now(UTC), error=_first_line(exc))
            page.health = health
            self._page = page
            return page

    def _exists(self, conn: psycopg.Connection, table: str) -> bool:
        row = conn.execute(
            self.q["status_page_table_exists"], {"name": f"{self.schema}.{table}"}
        ).fetchone()
        return bool(row and row[0])

    def _read_page(self, conn: psycopg.Connection, snap: Snapshot) -> PageData:
        q = self.q
        page = PageData(snap, time.monotonic(), datetime.now(UTC))
        page.version = current_version(conn, self.schema)
        if page.version == 0:
            page.error = f"schema {self.schema!r} has no worker tables: run `worker migrate`"
            return page
        page.finished, page.finished_exact = _admin.finished_counts(
            conn, self.schema, cap=FINISHED_CAP
        )
        if not page.finished_exact:
            names = sorted({r.queue for r in snap.queues} | {k[0] for k in page.finished})
            cells = [(n, s) for n in names[:QUEUES_PER_PAGE] for s in ("done", "cancelled")]
            guesses = _admin.estimates(conn, self.schema, cells)
            page.finished = _admin.finished_estimates(page.finished, guesses)
        rows = {"limit": ROWS_SHOWN + 1}
        with conn.cursor(row_factory=dict_row) as cur:
            page.workers = cur.execute(q["workers"], rows).fetchall()
            page.failed = cur.execute(
                q["recent_failed"], {"limit": FAILED_SHOWN, "chars": ERROR_CHARS}
            ).fetchall()
            page.cron_runs = cur.execute(q["status_page_cron_runs"], rows).fetchall()
            page.advisory = cur.execute(q["status_page_advisory_locks"], rows).fetchall()
        if self._exists(conn, "cron_schedules"):
            page.cron_schedules = [
                r[0] for r in conn.execute(q["status_page_cron_schedules"], rows).fetchall()
            ]
        if self._exists(conn, "locks"):
            page.locks = [r[0] for r in conn.execute(q["status_page_locks"], rows).fetchall()]
        return page

    # readiness

    def ready(self) -> tuple[bool, str]:
        """Reachable and migrated, checked on a new connection (a kept one could hide an outage)
        and cached for a second so that a burst of probes costs one connection."""
        with self._ready_lock:
            cached = self._ready
            if cached is not None and time.monotonic() - cached[0] < READY_CACHE_SECONDS:
                return cached[1], cached[2]
            ok, why = self._check_ready()
            self._ready = (time.monotonic(), ok, why)
            return ok, why

    def _check_ready(self) -> tuple[bool, str]:
        try:
            with connect(self.dsn, READYZ, session=False) as conn:
                version = current_version(conn, self.schema)
        except psycopg.Error as exc:
            return False, f"database unreachable: {_first_line(exc)}"
        if version < self.expected_version:
            return False, (
                f"schema {self.schema} is at version {version}, this worker needs "
                f"{self.expected_version}: run `worker migrate`"
            )
        return True, f"ok: schema {self.schema} at version {version}"


def _row(s: QueueStats, guesses: dict[tuple[str, str], float]) -> QueueRow:
    """A queue's numbers for the page and the gauges: a count that stopped at the cap becomes the
    planner's estimate when that is larger."""
    capped = frozenset(s.capped)
    values = {"queued": s.queued, "scheduled": s.scheduled, "failed": s.failed}
    estimated = set()
    for state in capped:
        guess = guesses.get((s.queue, state))
        if guess is not None and guess > values[state]:
            values[state] = round(guess)
            estimated.add(state)
    return QueueRow(
        s.queue,
        values["queued"],
        values["scheduled"],
        s.running,
        s.queued_capped or s.scheduled_capped,
        s.oldest_seconds,
        s.served,
        s.waiting,
        values["failed"],
        capped,
        frozenset(estimated),
    )


__all__ = ["ALIVE_SECONDS", "Database", "MissingHandler", "PageData", "QueueRow", "Snapshot"]
