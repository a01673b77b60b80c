"""A page of the console and a snapshot of the metrics each read the database at one moment: a
task that finishes between two of their statements shows in neither or in both, so a page's
counts always agree with its rows (a workflow whose steps all show finished never counts one
as running)."""

from __future__ import annotations

import psycopg
import pytest

import worker
from worker.monitor.console.data import ConsoleData
from worker.monitor.readmodel import Database


def _reads_one_moment(run, pg_dsn: str, schema: str) -> None:  # type: ignore[no-untyped-def]
    count = f"SELECT count(*) FILTER (WHERE state = 'done'), count(*) FROM {schema}.tasks"

    def read(conn: psycopg.Connection) -> tuple[tuple[int, int], tuple[int, int]]:
        first = conn.execute(count).fetchone()
        # Another session finishes a task and enqueues one while the page is half read.
        with psycopg.connect(pg_dsn, autocommit=True) as other:
            other.execute(f"UPDATE {schema}.tasks SET state = 'done' WHERE state = 'queued'")
            worker.enqueue(other, "later", {}, schema=schema)
        second = conn.execute(count).fetchone()
        assert first is not None and second is not None
        return first, second

    first, second = run(read)
    assert first == second == (0, 1)


def test_a_console_page_reads_one_moment(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    worker.enqueue(conn, "first", {}, schema=schema)
    data = ConsoleData(pg_dsn, schema, ttl=0)
    try:
        _reads_one_moment(data._run, pg_dsn, schema)
        # What the other session did shows in the next read, all of it.
        assert data._run(
            lambda c: c.execute(
                f"SELECT count(*) FILTER (WHERE state = 'done'), count(*) FROM {schema}.tasks"
            ).fetchone()
        ) == (1, 2)
        # And a read still cannot write.
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            data._run(lambda c: c.execute(f"DELETE FROM {schema}.tasks"))
    finally:
        data.close()


def test_a_metrics_snapshot_reads_one_moment(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    worker.enqueue(conn, "first", {}, schema=schema)
    db = Database(pg_dsn, schema, ttl=0)
    try:
        _reads_one_moment(db._run, pg_dsn, schema)
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            db._run(lambda c: c.execute(f"DELETE FROM {schema}.tasks"))
    finally:
        db.close()
