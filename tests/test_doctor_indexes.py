"""`worker doctor` on indexes that outgrew their rows: a table whose rows have gone (a backlog
drained, the dead rows of a held transaction vacuumed at last) keeps indexes of the size they
reached. Reported with the rebuild that gives the room back; never for indexes in proportion to
their rows, nor after the statistics' counts were reset."""

from __future__ import annotations

import psycopg
from conftest import run_cli, wait_until

from worker.monitor.doctor.checkup import Report, diagnose
from worker.monitor.doctor.findings import Finding, Thresholds

ROWS = 100_000


def oversized(conn: psycopg.Connection, schema: str, **th: int) -> list[Finding]:
    report: Report = diagnose(conn, schema, Thresholds(**th), probe="off")
    return [f for f in report.findings if f.code == "indexes_oversized" and f.severity != "ok"]


def index_bytes(conn: psycopg.Connection, schema: str) -> int:
    row = conn.execute(f"SELECT pg_indexes_size('{schema}.tasks')").fetchone()
    assert row is not None
    return int(row[0])


def test_indexes_left_large_by_rows_since_removed_are_reported_until_rebuilt(
    conn: psycopg.Connection, schema: str, pg_dsn: str
) -> None:
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, state, attempts, started_at, finished_at)"
        f" SELECT 'app.report', 'q' || (g % 7), 'done', 1, now(), now()"
        f"   FROM generate_series(1, {ROWS}) AS g"
    )
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue) SELECT 'app.mail', 'mail'"
        f" FROM generate_series(1, {ROWS}) AS g"
    )
    conn.execute(f"VACUUM ANALYZE {schema}.tasks")
    grown = index_bytes(conn, schema)
    assert grown > 4 * 1024**2
    # Indexes in proportion to their rows: nothing to report, even with no floor at all.
    assert oversized(conn, schema, index_min_bytes=0) == []

    conn.execute(f"DELETE FROM {schema}.tasks")
    conn.execute(f"VACUUM ANALYZE {schema}.tasks")
    assert index_bytes(conn, schema) == grown  # vacuum gives no index page back

    found = wait_until(lambda: oversized(conn, schema, index_min_bytes=1024**2), timeout=10)
    assert len(found) == 1
    assert f"{schema}.tasks" in found[0].summary
    assert found[0].action.startswith(f"REINDEX TABLE CONCURRENTLY {schema}.tasks")
    assert found[0].details["index_bytes"] == grown
    # Under the default floor (64 MB) the same indexes are not worth a line.
    assert oversized(conn, schema) == []

    # From the command line: one line, and exit 1 as for any warning.
    done = run_cli(
        "doctor", "--dsn", pg_dsn, "--schema", schema, "--probe", "off", "--index-mb", "1"
    )
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stdout.splitlines() if "indexes_oversized" in line]
    assert len(lines) == 1 and lines[0].startswith("WARNING"), done.stdout
    assert "REINDEX TABLE CONCURRENTLY" in lines[0]

    # A reset of the statistics' counts (as after a crash) does not make full indexes look
    # oversized: the catalog's row count from the last vacuum is the floor.
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue) SELECT 'app.mail', 'mail'"
        f" FROM generate_series(1, {2 * ROWS}) AS g"
    )
    conn.execute(f"VACUUM ANALYZE {schema}.tasks")
    assert oversized(conn, schema, index_min_bytes=0) == []
    conn.execute(f"SELECT pg_stat_reset_single_table_counters('{schema}.tasks'::regclass)")
    assert oversized(conn, schema, index_min_bytes=0) == []

    conn.execute(f"DELETE FROM {schema}.tasks")
    conn.execute(f"VACUUM ANALYZE {schema}.tasks")
    assert oversized(conn, schema, index_min_bytes=1024**2) != []
    conn.execute(f"REINDEX TABLE CONCURRENTLY {schema}.tasks")
    assert index_bytes(conn, schema) < grown // 10
    assert oversized(conn, schema, index_min_bytes=1024**2) == []
