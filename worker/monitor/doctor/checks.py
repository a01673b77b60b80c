"""The checks of `worker doctor` but the xmin horizon's (``doctor_horizon``) and the claim probe
(``claim``): each turns rows of the statistics views (doctor.sql) into findings.

Reading and judging are apart: ``read_*`` run the statements, the other functions are pure, so
a test can hand them any figures. None of the reads costs more than a few milliseconds, which is
why the /metrics scrape may run them (through the read model's cache).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import dict_row

from ...db.sql import queries
from ...ops import status as _admin
from ...ops.status import ADVICE_LINES, STATUS_CAP, QueueStats, Routing
from .findings import CRITICAL, OK, WARNING, Finding, Thresholds, age, quote

# The statements of this room lie beside its modules (the core never loads them).
SQL_DIR = Path(__file__).resolve().parent

ROWS = 200  # sessions, slots, prepared transactions and tables read at most
RUNNING_CAP = 100_000  # in-progress rows counted at most
SAMPLE = 5  # long-running or expired tasks named

Row = Mapping[str, Any]


def rows(
    conn: psycopg.Connection, schema: str, name: str, params: Mapping[str, Any] | None = None
) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(queries(schema, SQL_DIR)[name], params or {}).fetchall()


# -- settings --------------------------------------------------------------------------------------


def read_settings(conn: psycopg.Connection, schema: str) -> dict[str, str]:
    return {r["name"]: r["setting"] for r in rows(conn, schema, "doctor_settings")}


def int_setting(settings: Mapping[str, str], name: str, default: int = 0) -> int:
    try:
        return int(float(settings.get(name, default)))
    except ValueError:
        return default


# -- tables and vacuum -----------------------------------------------------------------------------


# -- connections -----------------------------------------------------------------------------------


def read_connections(conn: psycopg.Connection, schema: str) -> dict[str, Any]:
    return rows(conn, schema, "doctor_connections")[0]


def connection_limit(settings: Mapping[str, str]) -> int:
    """The connections a non-superuser may open."""
    return max(
        int_setting(settings, "max_connections", 100)
        - int_setting(settings, "superuser_reserved_connections", 3)
        - int_setting(settings, "reserved_connections", 0),
        1,
    )


def connection_findings(row: Row, settings: Mapping[str, str], th: Thresholds) -> list[Finding]:
    limit = connection_limit(settings)
    used, fleet = int(row.get("used") or 0), int(row.get("fleet") or 0)
    share = used / limit
    sev = OK
    if share >= th.connections_critical:
        sev = CRITICAL
    elif share >= th.connections_warning:
        sev = WARNING
    action = (
        "none needed"
        if sev == OK
        else "put PgBouncer in front (worker run --pgbouncer), lower --processes or "
        "--concurrency, close idle clients, or raise max_connections"
    )
    return [
        Finding(
            "connections_low",
            sev,
            f"{used} of {limit} connections in use ({share:.0%}; {fleet} by the fleet, "
            f"application_name worker*), {max(limit - used, 0)} free",
            action,
            {
                "used": used,
                "limit": limit,
                "fleet": fleet,
                "free": max(limit - used, 0),
                "this_database": row.get("this_database"),
                "idle_in_transaction": row.get("idle_in_transaction"),
            },
        )
    ]


# -- running tasks ---------------------------------------------------------------------------------


def read_running(conn: psycopg.Connection, schema: str, th: Thresholds) -> dict[str, Any]:
    params = {
        "cap": RUNNING_CAP,
        "long_seconds": th.long_task_seconds,
        "grace_seconds": th.lease_grace_seconds,
    }
    row = rows(conn, schema, "doctor_running", params)[0]
    row["sample"] = rows(conn, schema, "doctor_running_sample", {**params, "limit": SAMPLE})
    return row


def running_findings(row: Row, th: Thresholds) -> list[Finding]:
    sample = row.get("sample") or []
    long_n, expired = int(row.get("long_running") or 0), int(row.get("expired") or 0)
    more = "+" if row.get("capped") else ""

    def named(key: str) -> str:
        rows = [r for r in sample if (r.get(key) or 0) > 0][:SAMPLE]
        return ", ".join(
            f"#{r['id']} {quote(r['task'], 60)} in {quote(r['queue'], 40)} ({age(r[key])})"
            for r in rows
        )

    out = []
    if long_n:
        long_rows = [r for r in sample if (r.get("running_seconds") or 0) >= th.long_task_seconds]
        out.append(
            Finding(
                "tasks_running_long",
                WARNING,
                f"{long_n:,}{more} task(s) in progress for over {age(th.long_task_seconds)} "
                f"(oldest {age(row.get('oldest_seconds'))}): "
                + ", ".join(
                    f"#{r['id']} {quote(r['task'], 60)} in {quote(r['queue'], 40)} "
                    f"({age(r['running_seconds'])})"
                    for r in long_rows
                ),
                "look at what those handlers wait on (their worker's log, pg_stat_activity); give "
                "long jobs a timeout, or raise the threshold if they are meant to run this long",
                {"count": long_n, "oldest_seconds": row.get("oldest_seconds"), "sample": long_rows},
            )
        )
    if expired:
        out.append(
            Finding(
                "leases_expired",
                WARNING if int(row.get("running") or 0) > expired else CRITICAL,
                f"{expired:,}{more} running task(s) whose lease ran out over "
                f"{age(th.lease_grace_seconds)} ago and that nobody rescued (most overdue "
                f"{age(row.get('most_expired_seconds'))}): {named('expired_seconds')}",
                "start a worker (every live worker's maintenance rescues expired leases), or "
                "check the workers' logs for database errors",
                {
                    "count": expired,
                    "most_expired_seconds": row.get("most_expired_seconds"),
                    "sample": [r for r in sample if (r.get("expired_seconds") or 0) > 0],
                },
            )
        )
    running = int(row.get("running") or 0)
    if not long_n:
        out.append(
            Finding(
                "tasks_running_long",
                OK,
                f"{running:,}{more} task(s) in progress, none for over {age(th.long_task_seconds)}",
                "none needed",
                {"running": running},
            )
        )
    if not expired:
        out.append(
            Finding("leases_expired", OK, "no expired lease waits to be rescued", "none needed")
        )
    return out


# -- routing ---------------------------------------------------------------------------------------


def read_routing(conn: psycopg.Connection, schema: str) -> tuple[Routing, list[QueueStats]]:
    """The routing `worker status` shows, and the queue statistics it comes from."""
    scan = _admin.queue_stats(
        conn, schema, cap=STATUS_CAP, failed_cap=0, max_queues=_admin.MAX_QUEUES
    )
    missing = _admin.missing_handlers(conn, schema, scan.queues)
    row = conn.execute(
        queries(schema, SQL_DIR)["metrics_workers_alive"], {"alive_seconds": _admin.ALIVE_SECONDS}
    ).fetchone()
    alive = int(row[0]) if row else 0
    return Routing(_admin.unserved(scan.queues), missing, alive), scan.queues


def routing_findings(routing: Routing) -> list[Finding]:
    """Queues nobody serves, tasks nobody has a handler for (``ops.status.Routing``)."""
    out = []
    unserved = sorted(routing.unserved, key=lambda q: (-q.waiting, q.queue))
    if unserved:
        total = sum(q.waiting for q in unserved)
        none_alive = routing.workers_alive == 0
        names = ", ".join(f"{quote(q.queue, 40)} ({q.waiting:,})" for q in unserved[:ADVICE_LINES])
        more = f" and {len(unserved) - ADVICE_LINES} more" if len(unserved) > ADVICE_LINES else ""
        out.append(
            Finding(
                "queue_unserved",
                CRITICAL if none_alive else WARNING,
                f"{'no live worker at all: ' if none_alive else ''}{len(unserved)} queue(s) hold "
                f"{total:,} due task(s) that no live worker serves: {names}{more}",
                "start a worker with `worker run MODULE`"
                if none_alive
                else f"start a worker with --queues naming {quote(unserved[0].queue, 40)}"
                f"{' (and the others)' if len(unserved) > 1 else ''}, or check the queue names",
                {
                    "workers_alive": routing.workers_alive,
                    "queues": [{"queue": q.queue, "waiting": q.waiting} for q in unserved],
                },
            )
        )
    else:
        out.append(
            Finding(
                "queue_unserved",
                OK,
                f"a live worker serves every queue with due tasks ({routing.workers_alive} alive)",
                "none needed",
                {"workers_alive": routing.workers_alive},
            )
        )
    missing = routing.missing if routing.workers_alive else []
    if missing:
        names = ", ".join(
            f"{quote(m.task, 60)} ({m.count:,}{'+' if m.capped else ''} in {quote(m.queue, 40)})"
            for m in missing[:ADVICE_LINES]
        )
        out.append(
            Finding(
                "handler_missing",
                WARNING,
                f"{len(missing)} task name(s) wait for a handler no live worker has: {names}",
                "start a worker whose module registers them, or fix the producer's task name",
                {"tasks": [{"task": m.task, "queue": m.queue, "count": m.count} for m in missing]},
            )
        )
    else:
        out.append(
            Finding(
                "handler_missing",
                OK,
                "every task seen waiting has a handler in a live worker"
                if routing.workers_alive
                else "no live worker to compare handlers with (see queue_unserved)",
                "none needed",
            )
        )
    return out
