"""`worker doctor`: a health check of the database for the queue, as a list of findings.

``diagnose`` runs every check on one connection and returns a ``Report``: the findings (see
``doctor_findings``) and the figures behind the gauges of /metrics. Each check runs in a
transaction (or a savepoint, inside the read model's) of its own with a statement and lock
timeout, so a check that fails or times out becomes a ``check_failed`` finding and the others
still run. The checks:

- what holds the xmin horizon back: sessions with an old snapshot or transaction id (idle in a
  transaction or not), prepared transactions, replication slots; with the dead row versions of the
  task table that vacuum therefore cannot remove (``checks``, ``tables``);
- dead rows, sizes and vacuums of the queue's tables, and whether autovacuum keeps up;
- connection headroom, and how many connections the fleet holds;
- tasks running far longer than expected, or past a lease nobody rescued;
- queues no live worker serves and tasks no live worker has a handler for (``ops.status``);
- what the claim statement reads per row (``claim``): the CLI only, never at scrape time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

from ...db.dsn import scrub
from ...db.sql import queries
from ...ops.status import QueueStats, Routing
from . import checks
from . import horizon as horizon_checks
from . import tables as tables_check
from .claim import claim_findings
from .findings import WARNING, Finding, Thresholds, ordered, worst

# The statements of this room lie beside its modules (the core never loads them).
SQL_DIR = Path(__file__).resolve().parent

log = logging.getLogger("worker.doctor")

STATEMENT_MS = 10_000  # the CLI's default bound on one statement
SCRAPE_STATEMENT_MS = 2_000  # at scrape time
LOCK_MS = 1_000
PROBE_QUEUES = 10  # queues the claim probe looks at, at most


@dataclass
class Report:
    schema: str
    findings: list[Finding] = field(default_factory=list)
    # The figures behind the gauges: horizon age, dead rows and sizes per table, connections.
    figures: dict[str, Any] = field(default_factory=dict)
    taken: float = field(default_factory=time.monotonic)
    wall: datetime = field(default_factory=lambda: datetime.now(UTC))
    duration: float = 0.0
    error: str | None = None  # the whole read failed (the scrape's connection, say)

    @property
    def status(self) -> str:
        return worst(self.findings)

    def age(self) -> float:
        return time.monotonic() - self.taken

    def problems(self) -> list[Finding]:
        return [f for f in ordered(self.findings) if f.severity != "ok"]

    def as_dict(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "status": self.status,
            "checked_at": self.wall.isoformat(),
            "duration_seconds": round(self.duration, 3),
            "counts": {
                s: sum(1 for f in self.findings if f.severity == s)
                for s in ("ok", "warning", "critical")
            },
            "findings": [f.as_dict() for f in ordered(self.findings)],
            "figures": self.figures,
            "error": self.error,
        }


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return scrub(text.splitlines()[0] if text else type(exc).__name__)


class _Run:
    """One diagnosis: the connection, the timeouts, and the findings so far."""

    def __init__(self, conn: psycopg.Connection, schema: str, statement_ms: int) -> None:
        self.conn = conn
        self.schema = schema
        self.statement_ms = statement_ms
        self.findings: list[Finding] = []

    def guarded(
        self, name: str, fn: Callable[[], Any], default: Any = None, *, own: bool = False
    ) -> Any:
        """``fn()`` in a transaction (a savepoint inside one) of its own with the timeouts, or,
        ``own``, as it is (it opens its transactions itself); a database error becomes a
        check_failed finding, and ``default`` is returned."""
        try:
            if own:
                return fn()
            with self.conn.transaction():
                self.conn.execute(
                    queries(self.schema, SQL_DIR)["doctor_local_timeouts"],
                    {"statement_ms": str(self.statement_ms), "lock_ms": str(LOCK_MS)},
                )
                return fn()
        except psycopg.Error as exc:
            if self.conn.closed or self.conn.broken:
                raise
            self.findings.append(
                Finding(
                    "check_failed",
                    WARNING,
                    f"the {name} check could not run: {_first_line(exc)}",
                    "check this role's privileges (pg_monitor helps) and the statement timeout; "
                    "run `worker doctor` again",
                    {"check": name, "error": _first_line(exc)},
                )
            )
            return default


def _probe_queues(stats: list[QueueStats]) -> list[str]:
    """The queues worth probing: those with queued rows (most first), then those served."""
    busy = sorted((s for s in stats if s.queued), key=lambda s: (-s.queued, s.queue))
    served = sorted(s.queue for s in stats if s.served and not s.queued)
    names = [s.queue for s in busy] + served
    return names[:PROBE_QUEUES] or ["default"]


def diagnose(
    conn: psycopg.Connection,
    schema: str,
    thresholds: Thresholds | None = None,
    *,
    probe: str = "claim",
    probe_rows: int = 10,
    routing: Routing | None = None,
    statement_ms: int = STATEMENT_MS,
) -> Report:
    """Every check, on ``conn``. ``routing``: the queue routing already read (the scrape passes
    its snapshot's); otherwise it is read here. ``probe``: ``claim`` (EXPLAIN ANALYZE of the real
    claim, rolled back), ``read-only`` or ``off`` (the scrape's)."""
    th = thresholds or Thresholds()
    started = time.monotonic()
    run = _Run(conn, schema, statement_ms)
    settings: dict[str, str] = run.guarded(
        "settings", lambda: checks.read_settings(conn, schema), {}
    )
    read_tables = run.guarded("tables", lambda: tables_check.read_tables(conn, schema))
    tables: list[dict[str, Any]] = read_tables or []
    tasks = next((t for t in tables if t["name"] == "tasks"), None)
    pinned = int(tasks["dead"]) if tasks else None
    horizon = run.guarded("xmin horizon", lambda: horizon_checks.read_horizon(conn, schema))
    figures: dict[str, Any] = {"xmin_horizon_age_seconds": 0.0, "xmin_horizon_age_xids": 0}
    held = False
    if horizon is not None:
        sessions, prepared, slots = horizon["sessions"], horizon["prepared"], horizon["slots"]
        found = [
            *horizon_checks.horizon_findings(sessions, pinned, th),
            *horizon_checks.prepared_findings(prepared, pinned, th),
            *horizon_checks.slot_findings(slots, th),
            *horizon_checks.hidden_findings(
                int(horizon["hidden"][0]["hidden"]) if horizon["hidden"] else 0,
                settings.get("sees_all_sessions") == "true",
            ),
        ]
        held = any(
            f.severity != "ok"
            and f.code in ("xmin_horizon_held", "prepared_xact_held", "replication_slot_held")
            for f in found
        )
        run.findings += found
        seconds, xids = horizon_checks.horizon_age(sessions, prepared, slots)
        figures |= {"xmin_horizon_age_seconds": seconds, "xmin_horizon_age_xids": xids}
    if read_tables is not None:
        run.findings += tables_check.table_findings(schema, tables, settings, th, horizon_held=held)
    figures["tables"] = {
        t["name"]: {
            "dead": int(t.get("dead") or 0),
            "live": int(t.get("live") or 0),
            "table_bytes": int(t.get("table_bytes") or 0),
            "index_bytes": int(t.get("index_bytes") or 0),
        }
        for t in tables
    }
    connections = run.guarded("connections", lambda: checks.read_connections(conn, schema))
    if connections is not None:
        found = checks.connection_findings(connections, settings, th)
        run.findings += found
        figures["connections"] = {k: found[0].details[k] for k in ("used", "limit", "fleet")}
    running = run.guarded("running tasks", lambda: checks.read_running(conn, schema, th))
    if running is not None:
        run.findings += checks.running_findings(running, th)
    stats: list[QueueStats] = []
    if routing is None:
        read = run.guarded("queue routing", lambda: checks.read_routing(conn, schema))
        if read is not None:
            routing, stats = read
    if routing is not None:
        run.findings += checks.routing_findings(routing)
    if probe != "off":
        queues = _probe_queues(stats)
        found = run.guarded(
            "claim cost",
            lambda: claim_findings(
                conn,
                schema,
                queues,
                th,
                rows=probe_rows,
                mode=probe,
                statement_ms=statement_ms,
                horizon_held=held,
            ),
            [],
            own=True,  # each probe in a transaction of its own, rolled back whole
        )
        run.findings += found
    return Report(
        schema,
        run.findings,
        figures,
        duration=time.monotonic() - started,
    )


def failed(schema: str, error: str) -> Report:
    """The report of a read that could not run at all."""
    return Report(
        schema,
        [
            Finding(
                "check_failed",
                WARNING,
                f"the database health checks could not run: {error}",
                "check that the database is reachable and this role may read pg_stat_activity",
                {"check": "all", "error": error},
            )
        ],
        error=error,
    )


__all__ = ["Report", "Thresholds", "diagnose", "failed"]
