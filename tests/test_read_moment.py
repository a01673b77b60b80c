"""A page of the console and a snapshot of the metrics each read the database at one moment: a
task that finishes between two of their statements shows in neither or in both, so a page's
counts always agree with its rows (a workflow whose steps all show finished never counts one
as running)."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

import worker
from worker.monitor.console.data import ConsoleData
from worker.monitor.readmodel import Database


@pytest.mark.parametrize("reader", [ConsoleData, Database], ids=["console", "metrics"])
def test_a_read_sees_one_moment(
    pg_dsn: str, schema: str, conn: psycopg.Connection, reader: Any
) -> None:
    count = f"SELECT count(*) FILTER (WHERE state = 'done'), count(*) FROM {schema}.tasks"
    worker.enqueue(conn, "first", {}, schema=schema)

    def read(c: psycopg.Connection) -> tuple[Any, Any]:
        first = c.execute(count).fetchone()
        # Another session finishes the task and enqueues one while the page is half read.
        with psycopg.connect(pg_dsn, autocommit=True) as other:
            other.execute(f"UPDATE {schema}.tasks SET state = 'done' WHERE state = 'queued'")
            worker.enqueue(other, "later", {}, schema=schema)
        return first, c.execute(count).fetchone()

    source = reader(pg_dsn, schema, ttl=0)
    try:
        assert source._run(read) == ((0, 1), (0, 1))
        # What the other session did shows in the next read, all of it.
        assert source._run(lambda c: c.execute(count).fetchone()) == (1, 2)
        # And a read still cannot write.
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            source._run(lambda c: c.execute(f"DELETE FROM {schema}.tasks"))
    finally:
        source.close()
