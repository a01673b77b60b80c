"""Every statement that `worker status`, the status page, the console, the metrics collector,
purge, the minute rollup and `worker retry --failed` run, on a task table of 5M rows (issue 11): no
sequential scan of the task table, and under 200 ms each (the console's searches: a bounded walk,
under 1.5 s). Then the commands themselves, on that table.

The table is built once per test run, in a schema of its own: 4M finished rows (1M of them failed,
over the week failures are kept), 1M waiting (900k scheduled), a few thousand running, in ten
queues and five priorities; a queue that no worker serves, a task no worker has a handler for,
failures whose dedupe key a queued task holds, cron rows, and rows past their retention for purge;
and a day of the minute rollup, 100 queues a minute (the most it records).

Each statement runs under EXPLAIN (ANALYZE, BUFFERS, TIMING OFF) in a transaction that is rolled
back, with JIT off as the code runs it (no_jit). TIMING OFF: per-node clock
reads would add more than the counting itself to the statements that count index entries. The
time asserted is the fastest of three runs: the machine is shared, and the first run also warms
the cache.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from worker.cli.main import main
from worker.coord import pause as _pause
from worker.db.migrate import migrate
from worker.db.sql import notify_channel, parse_named, statements
from worker.engine import rollup
from worker.monitor.console.data import (
    MINUTE_CAP,
    PAGE_ROWS,
    SCAN_ROWS,
    browse_statement,
    download_params,
    task_params,
)
from worker.monitor.console.filter import Filter, encode_cursor
from worker.monitor.metrics.collector import DatabaseCollector
from worker.monitor.metrics.instruments import DEFAULT_COUNT_CAP
from worker.monitor.page.trends import MINUTES, WAIT_QUEUES
from worker.monitor.readmodel import FINISHED_CAP, MAX_QUEUES, REST_CAP, Database
from worker.ops import status as _admin

ROOT = Path(__file__).resolve().parent.parent
LIMIT_MS = 200.0
QUEUES = ["default", "mail", "reports", "images", "webhooks", "billing", "exports"]
PRIORITIES = "ARRAY[-5, 0, 0, 5, 10]"
KEEP_DONE, KEEP_FAILED, CRON_KEEP = 3600, 7 * 86400, 86400
TIMINGS: dict[str, float] = {}

# Rows per block, in id order: (what, rows). Their sum is the table.
BLOCKS = [
    ("done", 2_897_000),  # over the last 40 minutes (kept for an hour)
    ("done past retention", 3_000),
    ("cancelled", 100_000),
    ("failed", 999_000),  # over the last week (kept)
    ("failed past retention", 1_000),
    ("queued", 98_696),  # with the two blocks below: 100,000 due
    ("scheduled", 900_000),  # 2,000 of them handed back: a task no worker has
    ("in_progress", 2_000),
    ("queued in a queue nobody serves", 1_204),
    ("failed in small queues", 600),  # 300 in each; 50 of each with a key a queued task holds
    ("queued holding those keys", 100),
    ("cron", 2_000),
]


# The queue of row g, skewed: default gets three shares, mail two, the others one each.
SHARES = ["default", "default", "default", "mail", "mail", *QUEUES[2:]]
QUEUE_OF_G = f"(ARRAY{SHARES})[1 + g % {len(SHARES)}]"


def _inserts(s: str) -> list[str]:
    """INSERT ... SELECT statements that fill the table, with explicit ids (no sequence calls)."""
    q = QUEUE_OF_G
    t = f"{s}.tasks"
    prio = f"({PRIORITIES})[1 + g % 5]"
    task = "'app.task_' || (g % 20)"
    # A constant (gen_random_uuid() per row alone took 15 s of the build); no statement here
    # reads finished rows by worker.
    worker = "'00000000-0000-4000-8000-000000000001'::uuid"
    sql = []
    first = 0

    def block(columns: str, select: str, n: int) -> None:
        nonlocal first
        sql.append(
            f"INSERT INTO {t} (id, {columns}) SELECT {first} + g, {select}"
            f" FROM generate_series(1, {n}) AS g"
        )
        first += n

    n = dict(BLOCKS)

    def ago(seconds: str) -> str:
        return f"now() - ({seconds}) * interval '1 second'"

    def over(seconds: float, rows: int) -> str:
        """Row g's share of ``seconds`` (float8 arithmetic: numeric would double the build)."""
        return f"g::float8 * {seconds / rows!r}"

    # Times leave an hour's slack (20 minutes for done rows): the table ages while the run goes on.
    spread = over(2400, n["done"])  # the done rows over the last 40 minutes
    cancelled_spread = over(3000, n["cancelled"])
    failed_spread = over(KEEP_FAILED - 3600, n["failed"])  # the week they are kept
    block(
        "queue, task, priority, state, attempts, run_at, created_at, started_at, finished_at,"
        " worker_id",
        f"{q}, {task}, {prio}, 'done', 1, {ago(spread + ' + 6')}, {ago(spread + ' + 6')},"
        f" {ago(spread + ' + 1')}, {ago(spread)}, {worker}",
        n["done"],
    )
    block(
        "queue, task, state, attempts, finished_at",
        f"{q}, {task}, 'done', 1, {ago(f'{KEEP_DONE} + 60 + g')}",
        n["done past retention"],
    )
    block(
        "queue, task, state, finished_at",
        f"{q}, {task}, 'cancelled', {ago(cancelled_spread)}",
        n["cancelled"],
    )
    block(
        "queue, task, priority, state, attempts, max_attempts, last_error, dedupe_key, finished_at",
        f"{q}, {task}, {prio}, 'failed', 5, 5,"
        " 'ValueError: could not process record ' || g, CASE WHEN g % 10 = 0 THEN 'k' || g END,"
        f" {ago(failed_spread)}",
        n["failed"],
    )
    block(
        "queue, task, state, attempts, last_error, finished_at",
        f"{q}, {task}, 'failed', 5, 'old', {ago(f'{KEEP_FAILED} + 60 + g')}",
        n["failed past retention"],
    )
    block(
        "queue, task, priority, state, run_at, dedupe_key",
        f"{q}, {task}, {prio}, 'queued', {ago('g % 900')}, CASE WHEN g % 10 = 0 THEN 'q' || g END",
        n["queued"],
    )
    block(
        "queue, task, priority, state, run_at, handed_back, last_error",
        f"{q}, CASE WHEN g % 450 = 0 THEN 'ghost.task' ELSE {task} END, {prio}, 'scheduled',"
        f" now() + ({over(86400, n['scheduled'])} + 3600) * interval '1 second',"
        " CASE WHEN g % 450 = 0 THEN 1 + g % 3 ELSE 0 END,"
        " CASE WHEN g % 450 = 0 THEN 'UnknownTask: no handler for ghost.task' END",
        n["scheduled"],
    )
    block(
        "queue, task, state, attempts, worker_id, started_at, lease_expires_at",
        f"{q}, {task}, 'in_progress', 1, {worker}, now(), now() + interval '1 hour'",
        n["in_progress"],
    )
    block(
        "queue, task, state, run_at",
        f"'mial', {task}, 'queued', now() - interval '5 minutes'",
        n["queued in a queue nobody serves"],
    )
    block(
        "queue, task, state, attempts, last_error, finished_at, dedupe_key",
        "CASE WHEN g % 2 = 0 THEN 'small' ELSE 'retry-me' END, 'app.task_2', 'failed', 5,"
        f" 'boom', {ago('g')}, CASE WHEN g <= 100 THEN 'dup-' || g END",
        n["failed in small queues"],
    )
    block(
        "queue, task, state, dedupe_key",
        "CASE WHEN g % 2 = 0 THEN 'small' ELSE 'retry-me' END, 'app.task_2', 'queued', 'dup-' || g",
        n["queued holding those keys"],
    )
    block(
        "queue, task, state, cron_key, cron_at, finished_at",
        "'default', 'app.cron', 'done', 'cron-' || (g % 5), now() - g * interval '1 minute',"
        " now() - g * interval '1 minute'",
        n["cron"],
    )
    return sql


def _build(conn: psycopg.Connection, s: str) -> None:
    """Bulk load: indexes are dropped first and built afterwards (what CREATE INDEX builds is the
    same index an insert would have grown, at a fraction of the time), triggers and autovacuum
    are off while the rows go in."""
    t = f"{s}.tasks"
    conn.execute(f"ALTER TABLE {t} SET (autovacuum_enabled = false)")
    conn.execute(f"ALTER TABLE {t} DISABLE TRIGGER USER")
    indexes = conn.execute(
        "SELECT indexname, indexdef FROM pg_indexes"
        " WHERE schemaname = %s AND tablename = 'tasks' AND indexname <> 'tasks_pkey'",
        (s,),
    ).fetchall()
    for name, _ in indexes:
        conn.execute(f"DROP INDEX {s}.{name}")
    for statement in _inserts(s):
        conn.execute(statement)
    conn.execute("SET maintenance_work_mem = '256MB'")
    for _, definition in indexes:
        conn.execute(definition)
    conn.execute(f"ALTER TABLE {t} ENABLE TRIGGER USER")
    conn.execute(f"ALTER TABLE {t} RESET (autovacuum_enabled)")
    total = sum(n for _, n in BLOCKS)
    conn.execute("SELECT setval(pg_get_serial_sequence(%s, 'id'), %s)", (t, total))
    conn.execute(
        f"INSERT INTO {s}.workers (id, host, pid, queues, concurrency, tasks)"
        " SELECT gen_random_uuid(), 'host-' || g, 1000 + g, %s, 10,"
        "        ARRAY(SELECT 'app.task_' || i FROM generate_series(0, 19) AS i)"
        "   FROM generate_series(1, 4) AS g",
        ([*QUEUES, "small", "retry-me"],),
    )
    conn.execute(
        f"INSERT INTO {s}.workers (id, host, pid, queues, concurrency, stopped_at)"
        " VALUES (gen_random_uuid(), 'gone', 1, ARRAY['mial'], 1, now() - interval '1 hour')"
    )
    # A day of the minute rollup (schema/0018), as many queues a minute as it keeps.
    conn.execute(
        f"INSERT INTO {s}.stats_minutes (minute, sampled_at, queued, in_progress)"
        " SELECT m, m + interval '65 seconds', 100000, 2000"
        "   FROM generate_series(date_trunc('minute', now()) - interval '1 day',"
        "                        date_trunc('minute', now()), interval '1 minute') AS m"
    )
    conn.execute(
        f"INSERT INTO {s}.queue_minutes (minute, queue, queued, in_progress, waited, wait_p50,"
        " wait_p99)"
        " SELECT m.minute, 'queue-' || g, g, mod(g, 7), 100 * g, g * 0.01, g * 0.2"
        f"   FROM {s}.stats_minutes AS m CROSS JOIN generate_series(1, %s) AS g",
        (rollup.MAX_QUEUES,),
    )
    conn.execute(f"VACUUM ANALYZE {t}")
    conn.execute(f"VACUUM ANALYZE {s}.workers")
    conn.execute(f"VACUUM ANALYZE {s}.stats_minutes")
    conn.execute(f"VACUUM ANALYZE {s}.queue_minutes")


@pytest.fixture(scope="session")
def big(pg_dsn: str) -> Iterator[str]:
    name = f"x_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        try:
            migrate(conn, name)
            start = time.monotonic()
            _build(conn, name)
            built = time.monotonic() - start
            rows = conn.execute(f"SELECT count(*) FROM {name}.tasks").fetchone()
            assert rows is not None and rows[0] == sum(n for _, n in BLOCKS)
            print(f"\n{rows[0]:,} rows built in {built:.1f} s")
            yield name
        finally:
            conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")
            if TIMINGS:
                print("\nstatement timings (ms, fastest of three):")
                for stmt, ms in sorted(TIMINGS.items()):
                    print(f"  {stmt:32s} {ms:8.1f}")


@pytest.fixture(autouse=True)
def live_workers(request: pytest.FixtureRequest) -> None:
    """The registered workers stay live (a recent heartbeat) however long the run takes."""
    if "big" in request.fixturenames:
        schema = request.getfixturevalue("big")
        dsn = request.getfixturevalue("pg_dsn")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                f"UPDATE {schema}.workers SET heartbeat_at = now() WHERE stopped_at IS NULL"
            )


# -- the statements and their parameters ---------------------------------------------------------


def _one_id(conn: psycopg.Connection, s: str, where: str) -> int:
    row = conn.execute(f"SELECT id FROM {s}.tasks WHERE {where} LIMIT 1").fetchone()
    assert row is not None
    return int(row[0])


def _no_params(conn: psycopg.Connection, s: str) -> dict[str, Any]:
    return {}


def _fixed(**values: Any) -> Callable[[psycopg.Connection, str], dict[str, Any]]:
    return lambda conn, s: values


def _browse(**fields: Any) -> Callable[[psycopg.Connection, str], dict[str, Any]]:
    """A first page of the console's job browser for a filter, as the console runs it."""
    return lambda conn, s: browse_statement(
        Filter(**fields), None, limit=PAGE_ROWS, scan=SCAN_ROWS
    )[1]


def _ids(where: str, n: int = 100) -> Callable[[psycopg.Connection, str], dict[str, Any]]:
    def params(conn: psycopg.Connection, s: str) -> dict[str, Any]:
        rows = conn.execute(f"SELECT id FROM {s}.tasks WHERE {where} LIMIT {n}").fetchall()
        return {"ids": [r[0] for r in rows]}

    return params


def _busy_minute(conn: psycopg.Connection, s: str) -> dict[str, Any]:
    """The minute rollup's record of a minute among the done rows (72,000 of them a minute)."""
    row = conn.execute(
        f"SELECT date_trunc('minute', max(finished_at)) - interval '5 minutes' FROM {s}.tasks"
        " WHERE state IN ('done', 'cancelled')"
    ).fetchone()
    assert row is not None
    return rollup.record_params(row[0])


def _window_start(conn: psycopg.Connection, s: str) -> dict[str, Any]:
    """The charts' window, as trend_window gives it."""
    row = conn.execute(
        f"SELECT date_trunc('minute', now()) - make_interval(mins => {MINUTES - 1})"
    ).fetchone()
    assert row is not None
    return {"start": row[0], "queues": WAIT_QUEUES}


def _minutes(conn: psycopg.Connection, s: str) -> dict[str, Any]:
    """The minutes a refresh of the console's throughput counts once the older ones are kept:
    the two that are not settled yet and the current one."""
    now = conn.execute("SELECT date_trunc('minute', now())").fetchone()[0]  # type: ignore[index]
    return {"minutes": [now - i * timedelta(minutes=1) for i in range(3)], "cap": MINUTE_CAP}


# Every statement of the files in GUARDED (the status reads, the status page's and the metrics'
# reads, the console's pages and actions, pauses, cancels and operator actions), and purge, with
# the parameters the code gives it. A statement added to those files fails
# test_every_statement_is_listed until it is listed here, so none skips the guard.
STATEMENTS: dict[str, Callable[[psycopg.Connection, str], dict[str, Any]]] = {
    # ops/status.sql, and db/session.sql's reads
    "queue_stats": _fixed(
        cap=DEFAULT_COUNT_CAP,
        failed_cap=DEFAULT_COUNT_CAP,
        max_queues=MAX_QUEUES,
        alive_seconds=_admin.ALIVE_SECONDS,
    ),
    "queue_rest": _fixed(after="billing", listed=[], cap=REST_CAP),
    "finished_counts": _fixed(cap=FINISHED_CAP),
    "queue_state_estimates": _fixed(
        queues=[q for q in QUEUES for _ in _admin.STATES],
        states=[st for _ in QUEUES for st in _admin.STATES],
    ),
    "no_jit": _no_params,
    "recent_failed": _fixed(limit=20, chars=2**31 - 1),
    "workers": _fixed(limit=_admin.MAX_QUEUES),
    "missing_handlers": _fixed(
        alive_seconds=_admin.ALIVE_SECONDS,
        cap=_admin.STATUS_CAP,
        max_tasks=_admin.MAX_TASKS,
        queues=[*QUEUES, "mial"],
        sample=_admin.SAMPLE,
        limit=100,
    ),
    "get_task": lambda conn, s: {"id": _one_id(conn, s, "state = 'failed'")},
    "db_now": _no_params,
    "wake": lambda conn, s: {"channel": notify_channel(s)},
    # monitor/readmodel.sql, monitor/metrics/metrics.sql
    "metrics_state_estimates": lambda conn, s: {"schema": s},
    "metrics_workers_alive": _fixed(alive_seconds=_admin.ALIVE_SECONDS),
    "status_page_cron_runs": _fixed(limit=101),
    "status_page_table_exists": lambda conn, s: {"name": f"{s}.locks"},
    "status_page_cron_schedules": _fixed(limit=101),
    "status_page_locks": _fixed(limit=101),
    "status_page_advisory_locks": _fixed(limit=101),
    "metrics_current_xact_id": _no_params,
    "metrics_xact_status": lambda conn, s: {
        "xid": conn.execute("SELECT pg_current_xact_id()::text").fetchone()[0]  # type: ignore[index]
    },
    # monitor/console/browse.sql: the console's pages; a filter whose every row matches reads
    # its own rows (filters that narrow the walk: test_console_search_is_bounded)
    "browse_any": _browse(),
    "browse_running": _browse(state="in_progress"),
    "browse_queued": _browse(state="queued"),
    "browse_scheduled": _browse(state="scheduled", queue="mail"),
    "browse_finished": _browse(state="done"),
    "browse_failed": _browse(state="failed", queue="mail"),
    "browse_id": lambda conn, s: {
        **_browse(state="failed")(conn, s),
        "id": _one_id(conn, s, "state = 'failed'"),
    },
    "console_task": lambda conn, s: task_params(_one_id(conn, s, "state = 'failed'")),
    # a failed task's error history, read whole (the page offers it past STORED_BYTES)
    "console_download_exists": lambda conn, s: download_params(
        _one_id(conn, s, "state = 'failed'"), "errors"
    ),
    "console_download": lambda conn, s: download_params(
        _one_id(conn, s, "state = 'failed'"), "errors"
    ),
    "throughput_minutes": _minutes,
    "console_minute": _no_params,
    # monitor/console/trends.sql: the charts' reads of the minute rollup
    "trend_window": _fixed(minutes=MINUTES),
    "trend_depth": _window_start,
    "trend_waits": _window_start,
    # engine/rollup.sql: a worker's record of a minute (rolled back)
    "rollup_claim": _fixed(minute=None, settle=rollup.SETTLE_SECONDS),
    "rollup_record": _busy_minute,
    "rollup_forget": _fixed(keep=rollup.KEEP_SECONDS),
    # store/operator.sql, ops/audit.sql and coord/pause.sql: the console's actions (rolled back)
    "requeue": lambda conn, s: {**_ids("state = 'failed'")(conn, s), "dry_run": False},
    "delete_tasks": _ids("state = 'done'"),
    "action_record": _fixed(
        actor="alice",
        action="retry",
        filter="{}",
        counts="{}",
        source="console",
        finished=True,
        address="127.0.0.1",
    ),
    "action_finish": _fixed(id=1, counts="{}", finished=True, interrupted=None),
    "actions_recent": _fixed(limit=20),
    "pause_queue": _fixed(queue="mail", by="alice"),
    "resume_queue": _fixed(queue="mail"),
    "paused_queues": _fixed(limit=10_000),
    # a queue no row names (the read that warns `worker pause` of a typo): every probe misses
    "queue_known": _fixed(queue="mial", names=_pause.KNOWN_NAMES, recent=_pause.KNOWN_RECENT),
    # store/operator.sql and coord/cancel.sql: a cancel of queued and running tasks (rolled
    # back), and the lease keeper's read of cancel requests when it cannot LISTEN
    "cancel_tasks": lambda conn, s: {
        "ids": _ids("state = 'queued'", 50)(conn, s)["ids"]
        + _ids("state = 'in_progress'", 50)(conn, s)["ids"],
        "by": "alice",
    },
    "cancel_requests": lambda conn, s: {
        **_ids("state = 'in_progress'", 50)(conn, s),
        "worker_id": str(uuid.uuid4()),
    },
    # store/recovery.sql: retention
    "purge": _fixed(
        done_seconds=KEEP_DONE,
        failed_seconds=KEEP_FAILED,
        cron_keep_seconds=CRON_KEEP,
        limit=5000,
    ),
}


WORKER = ROOT / "worker"
# The files whose every statement is listed above, and the folders every statement is read from.
GUARDED = [
    "ops/status.sql",
    "ops/audit.sql",
    "monitor/readmodel.sql",
    "monitor/metrics/metrics.sql",
    "monitor/console/browse.sql",
    "monitor/console/trends.sql",
    "engine/rollup.sql",
    "coord/pause.sql",
    "coord/cancel.sql",
]
FOLDERS = sorted({(WORKER / f).parent for f in [*GUARDED, "db/session.sql", "store/x.sql"]})


def _named(path: str) -> set[str]:
    return set(parse_named((WORKER / path).read_text()))


def q_of(schema: str) -> Any:
    """Every statement of the guarded folders (and the store's and the session's)."""
    return statements(schema, *FOLDERS)


def test_every_statement_is_listed() -> None:
    guarded = {"purge", "no_jit", "db_now", "requeue", "delete_tasks", "cancel_tasks", "wake"}
    for path in GUARDED:
        guarded |= _named(path)
    assert guarded == set(STATEMENTS), (
        f"not guarded: {sorted(guarded - set(STATEMENTS))}; "
        f"listed but gone: {sorted(set(STATEMENTS) - guarded)}"
    )


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def explain(conn: psycopg.Connection, schema: str, name: str) -> tuple[float, dict[str, Any]]:
    """(execution ms, plan) of one run, rolled back."""
    q = q_of(schema)
    with conn.transaction(force_rollback=True):
        conn.execute(q["no_jit"])
        params = STATEMENTS[name](conn, schema)
        row = conn.execute(
            b"EXPLAIN (ANALYZE, BUFFERS, TIMING OFF, FORMAT JSON) " + q[name].as_bytes(conn),
            params,
        ).fetchone()
    assert row is not None
    return float(row[0][0]["Execution Time"]), row[0][0]["Plan"]


@pytest.mark.parametrize("name", sorted(STATEMENTS))
def test_statement_reads_indexes_and_is_fast(conn: psycopg.Connection, big: str, name: str) -> None:
    runs = [explain(conn, big, name) for _ in range(3)]
    ms, plan = min(runs, key=lambda r: r[0])
    TIMINGS[name] = ms
    scans = [
        n
        for n in _nodes(plan)
        if n["Node Type"] == "Seq Scan" and n.get("Relation Name") == "tasks"
    ]
    assert not scans, f"{name}: sequential scan of the task table"
    assert ms < LIMIT_MS, f"{name}: {ms:.1f} ms (runs: {[round(r[0], 1) for r in runs]})"


DONE_PAGES = {
    # (filter, offset of the page's cursor among the done rows of the filter, newest first)
    "the first page": ({"state": "done"}, None),
    "a page in the middle": ({"state": "done"}, 1_400_000),
    "the first page of a busy queue": ({"state": "done", "queue": "default"}, None),
    "a page in the middle of a busy queue": ({"state": "done", "queue": "default"}, 400_000),
}


@pytest.mark.parametrize("case", sorted(DONE_PAGES))
def test_the_done_browser_is_quick(conn: psycopg.Connection, big: str, case: str) -> None:
    """The job browser on done tasks (2.9M of them, with cancelled ones in the same index), as the
    console links to it (the state, or a queue's done count): under 200 ms a page, from the start
    or from a cursor deep in the rows."""
    fields, offset = DONE_PAGES[case]
    cursor = None
    if offset is not None:
        row = conn.execute(
            f"SELECT id, finished_at FROM {big}.tasks WHERE state IN ('done', 'cancelled')"
            " AND state = 'done' AND (%s::text IS NULL OR queue = %s)"
            " ORDER BY finished_at DESC, id DESC OFFSET %s LIMIT 1",
            (fields.get("queue"), fields.get("queue"), offset),
        ).fetchone()
        assert row is not None
        cursor = encode_cursor("finished", {"id": row[0], "finished_at": row[1]})
    name, params = browse_statement(Filter(**fields), cursor, limit=PAGE_ROWS, scan=SCAN_ROWS)
    assert name == "browse_finished"
    q = q_of(big)
    runs = []
    for _ in range(3):
        with conn.transaction(force_rollback=True):
            conn.execute(q["no_jit"])
            row = conn.execute(
                b"EXPLAIN (ANALYZE, TIMING OFF, FORMAT JSON) " + q[name].as_bytes(conn), params
            ).fetchone()
        assert row is not None
        runs.append((float(row[0][0]["Execution Time"]), row[0][0]["Plan"]))
    ms, plan = min(runs, key=lambda r: r[0])
    TIMINGS[f"(done) {case}"[:40]] = ms
    assert plan["Actual Rows"] == params["limit"]  # a full page, the next one begins after it
    assert not [n for n in _nodes(plan) if n["Node Type"] == "Seq Scan"]
    assert ms < LIMIT_MS, f"{case}: {ms:.1f} ms (runs: {[round(r[0], 1) for r in runs]})"


SEARCH_LIMIT_MS = 1500.0


@pytest.mark.parametrize(
    "fields",
    [
        {"text": "no such text"},
        {"queue": "mial"},
        {"state": "failed", "task": "app.task_7", "text": "no such text"},
        {"state": "done", "queue": "billing", "text": "no such text"},
        {"state": "cancelled", "task": "no.such.task"},
        {"state": "queued", "text": "no such text"},
    ],
    ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()),
)
def test_console_search_is_bounded(
    conn: psycopg.Connection, big: str, fields: dict[str, str]
) -> None:
    """A filter that rows of the walk may fail (a text search, a task, a queue the index does not
    lead with) reads at most SCAN_ROWS rows of the walk per page, however few rows match."""
    name, params = browse_statement(Filter(**fields), None, limit=PAGE_ROWS, scan=SCAN_ROWS)
    assert params["scan"] == SCAN_ROWS
    q = q_of(big)
    runs = []
    for _ in range(3):
        with conn.transaction(force_rollback=True):
            conn.execute(q["no_jit"])
            row = conn.execute(
                b"EXPLAIN (ANALYZE, TIMING OFF, FORMAT JSON) " + q[name].as_bytes(conn), params
            ).fetchone()
        assert row is not None
        runs.append((float(row[0][0]["Execution Time"]), row[0][0]["Plan"]))
    ms, plan = min(runs, key=lambda r: r[0])
    TIMINGS[f"(search) {name} {fields}"[:60]] = ms
    walked = max(n["Actual Rows"] for n in _nodes(plan) if n.get("Relation Name") == "tasks")
    assert walked <= SCAN_ROWS + 1, walked
    assert not [n for n in _nodes(plan) if n["Node Type"] == "Seq Scan"]
    assert ms < SEARCH_LIMIT_MS, f"{ms:.0f} ms"


def test_purge_reads_only_what_it_deletes(conn: psycopg.Connection, big: str) -> None:
    """Kept failures are not walked: besides the rows it deletes, purge reads only the cron rows
    still in their keep window (the old statement read every failure kept, 999,000 of them here,
    before it reached the expired done rows)."""
    _, plan = explain(conn, big, "purge")
    removed = sum(n.get("Rows Removed by Filter", 0) for n in _nodes(plan))
    assert removed <= dict(BLOCKS)["cron"], removed
    with conn.transaction(force_rollback=True):
        expired = conn.execute(
            f"SELECT count(*) FROM {big}.tasks WHERE state IN ('done', 'failed', 'cancelled')"
            " AND finished_at < now() - make_interval(secs => CASE WHEN state = 'failed'"
            f" THEN {KEEP_FAILED} ELSE {KEEP_DONE} END) AND (cron_key IS NULL"
            f" OR finished_at < now() - make_interval(secs => {CRON_KEEP}))"
        ).fetchone()
        deleted = conn.execute(q_of(big)["purge"], STATEMENTS["purge"](conn, big)).fetchone()[0]
    assert expired is not None and deleted == expired[0] > dict(BLOCKS)["failed past retention"]


# -- bulk actions (schema/0008) -------------------------------------------------------------------

# The statement of one batch of each walk (bulk_sql), run as bulk_step runs it: planned with the
# values bound. (action, state, filter, cursor, the indexes it may read.) Cursors sit in the middle
# of the rows they walk.
BULK: dict[str, tuple[str, list[str], dict[str, Any], dict[str, Any] | None, set[str]]] = {
    "retry failed of a queue": (
        "retry", ["failed"], {"queue": "small"}, None, {"tasks_failed_queue_idx"},
    ),
    "retry failed by error and age": (
        "retry", ["failed"], {"error": "ValueError%", "older_than": 86400}, None,
        {"tasks_failed_idx"},
    ),
    "retry failed from a cursor": (
        "retry", ["failed"], {}, {"phase": "dated", "at": "now-3d", "id": 1}, {"tasks_failed_idx"},
    ),
    "retry failed without finished_at": (
        "retry", ["failed"], {}, {"phase": "undated", "id": 5}, {"tasks_failed_idx"},
    ),
    "delete done by age": ("delete", ["done"], {"older_than": 1800}, None, {"tasks_done_idx"}),
    "delete cancelled of a queue": (
        "delete", ["cancelled"], {"queue": "mail"}, {"phase": "dated", "at": "now-1h", "id": 1},
        {"tasks_done_idx"},
    ),
    "cancel queued": ("cancel", ["queued"], {}, None, {"tasks_claim_idx"}),
    "cancel queued from a cursor": (
        "cancel", ["queued"], {"task": "app.task_3"},
        {"phase": "waiting", "queue": "mail", "priority": 0, "at": "now-5m", "id": 1},
        {"tasks_claim_idx"},
    ),
    "cancel queued of a queue": (
        "cancel", ["queued"], {"queue": "mail"},
        {"phase": "waiting", "priority": -5, "at": "now-5m", "id": 1}, {"tasks_claim_idx"},
    ),
    "cancel scheduled from a cursor": (
        "cancel", ["scheduled"], {}, {"phase": "waiting", "queue": "mail", "at": "now+6h", "id": 1},
        {"tasks_scheduled_queue_idx"},
    ),
    "cancel scheduled of a queue": (
        "cancel", ["scheduled"], {"queue": "webhooks"},
        {"phase": "waiting", "at": "now+6h", "id": 1},
        {"tasks_scheduled_queue_idx", "tasks_scheduled_idx"},
    ),
    "delete done and cancelled": (
        "delete", ["done", "cancelled"], {"queue": "mail", "older_than": 600}, None,
        {"tasks_done_idx"},
    ),
    "delete failed by id": ("delete", ["failed"], {"ids": "some"}, None, {"tasks_pkey"}),
}  # fmt: skip


def _bulk_args(
    conn: psycopg.Connection, s: str, flt: dict[str, Any], cursor: dict[str, Any] | None
) -> tuple[dict[str, Any], dict[str, Any] | None, list[Any]]:
    """The filter and cursor with real values, and bulk_step's bound parameters for them."""
    flt = dict(flt)
    if flt.get("ids") == "some":
        rows = conn.execute(f"SELECT id FROM {s}.tasks WHERE state = 'failed' LIMIT 200")
        flt["ids"] = [r[0] for r in rows]
    now = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
    if cursor is not None:
        cursor = dict(cursor)
        spec = cursor.get("at", "")
        if spec.startswith("now"):
            sign, amount, unit = spec[3], int(spec[4:-1]), spec[-1]
            step = {"m": 60, "h": 3600, "d": 86400}[unit] * amount * (1 if sign == "+" else -1)
            cursor["at"] = (now + timedelta(seconds=step)).isoformat()
        cursor.setdefault("before", now.isoformat())
    age = flt.get("older_than")
    params = [
        5000, flt.get("queue"), flt.get("task"), flt.get("error"),
        None if age is None else timedelta(seconds=age), flt.get("ids"),
        (cursor or {}).get("queue"), (cursor or {}).get("priority"),
        (cursor or {}).get("at"), (cursor or {}).get("id"),
        (cursor or {}).get("before", now),
    ]  # fmt: skip
    return flt, cursor, params


def _explain_bulk(
    conn: psycopg.Connection, s: str, case: str, *, dry_run: bool
) -> tuple[float, dict[str, Any]]:
    action, walk, flt, cursor, _ = BULK[case]
    with conn.transaction(force_rollback=True):
        conn.execute(q_of(s)["no_jit"])
        flt, cursor, params = _bulk_args(conn, s, flt, cursor)
        row = conn.execute(
            f"SELECT {s}.bulk_sql(%s, %s::text[], %s::jsonb, %s::jsonb, %s)",
            (action, walk, json.dumps(flt), json.dumps(cursor) if cursor else None, dry_run),
        ).fetchone()
        assert row is not None
        types = "integer, text, text, text, interval, bigint[], text, integer, timestamptz, bigint"
        conn.execute(f"PREPARE bulk_walk ({types}, timestamptz) AS {row[0]}")
        try:
            args = sql.SQL(", ").join(sql.Literal(v) for v in params)
            plan = conn.execute(
                sql.SQL(
                    "EXPLAIN (ANALYZE, BUFFERS, TIMING OFF, FORMAT JSON) EXECUTE bulk_walk({})"
                ).format(args)
            ).fetchone()
        finally:
            conn.execute("DEALLOCATE bulk_walk")
    assert plan is not None
    return float(plan[0][0]["Execution Time"]), plan[0][0]["Plan"]


@pytest.mark.parametrize("case", sorted(BULK))
def test_each_bulk_walk_reads_its_index_and_a_batch_is_quick(
    conn: psycopg.Connection, big: str, case: str
) -> None:
    """One batch of 5,000 rows: the dry run (what `worker retry|cancel|delete` counts with) in
    under 200 ms; the action itself, rolled back, reading the same indexes."""
    runs = [_explain_bulk(conn, big, case, dry_run=True) for _ in range(3)]
    ms, plan = min(runs, key=lambda r: r[0])
    TIMINGS[f"bulk: {case}"] = ms
    for dry_run, tree in ((True, plan), (False, _explain_bulk(conn, big, case, dry_run=False)[1])):
        tasks = [n for n in _nodes(tree) if n.get("Relation Name") == "tasks"]
        assert not [n for n in tasks if n["Node Type"] == "Seq Scan"], (case, dry_run)
        walked = {n["Index Name"] for n in _nodes(tree) if "Index Name" in n}
        assert walked & BULK[case][4], (case, dry_run, walked)
    assert ms < LIMIT_MS, f"{case}: {ms:.1f} ms (runs: {[round(r[0], 1) for r in runs]})"


# -- the commands ---------------------------------------------------------------------------------


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.monotonic()
    value = fn()
    return time.monotonic() - start, value


def test_worker_status_is_quick_and_names_the_routing_problems(
    pg_dsn: str, big: str, capsys: pytest.CaptureFixture[str]
) -> None:
    seconds, code = _timed(lambda: main(["status", "--dsn", pg_dsn, "--schema", big]))
    out = capsys.readouterr().out
    assert code == 0
    assert seconds < 1.5, seconds
    assert "no live worker serves queue 'mial' (1,204 task(s) waiting)" in out
    assert "task 'ghost.task' has no handler in any live worker (2,000 handed back" in out
    assert re.search(r"^default\s+≈", out, re.MULTILINE), out  # past the cap: the estimate
    TIMINGS["(command) worker status"] = seconds * 1000


def test_metrics_scrape_is_quick(pg_dsn: str, big: str) -> None:
    db = Database(pg_dsn, big, ttl=0)
    try:
        seconds, families = _timed(lambda: list(DatabaseCollector(db).collect()))
        page_seconds, page = _timed(db.page)
    finally:
        db.close()
    by_name = {f.name: f for f in families}
    assert by_name["worker_database_up"].samples[0].value == 1.0
    unserved = {s.labels["queue"]: s.value for s in by_name["worker_queue_unserved_tasks"].samples}
    assert unserved["mial"] == 1204
    assert seconds < 1.0 and page_seconds < 1.0, (seconds, page_seconds)
    assert page.error is None
    TIMINGS["(command) metrics scrape"] = seconds * 1000
    TIMINGS["(command) status page data"] = page_seconds * 1000


def test_retry_failed_on_a_small_queue_is_quick_and_skips_taken_keys(
    pg_dsn: str, big: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["retry", "--failed", "--queue", "retry-me", "--json", "--dsn", pg_dsn, "--schema", big]
    seconds, code = _timed(lambda: main(args))
    assert code == 0
    out = capsys.readouterr().out
    assert '"requeued": 250' in out and '"dedupe_key_taken": 50' in out, out
    assert seconds < 1.0, seconds
    TIMINGS["(command) worker retry --failed --queue"] = seconds * 1000
