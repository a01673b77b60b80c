"""Producing tasks: plain SQL, the enqueue() function, the Python API, COPY, dedupe keys."""

from __future__ import annotations

import asyncio
import threading
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from conftest import states, wait_until
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

import worker
from worker.db.migrate import latest_version, migrate
from worker.db.sql import notify_channel


def test_plain_sql_insert_is_a_complete_enqueue(
    conn: psycopg.Connection, schema: str, thread_worker
) -> None:
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, payload) VALUES ('send_email', '{{\"to\": \"a@b.c\"}}')"
    )
    row = conn.execute(
        f"SELECT queue, state::text, priority, attempts, max_attempts, run_at <= now(),"
        f" created_at IS NOT NULL FROM {schema}.tasks"
    ).fetchone()
    # max_attempts NULL: the handler of whichever worker claims the row decides (schema/0003).
    assert row == ("default", "queued", 0, 0, None, True, True)

    got: list[dict] = []
    reg = worker.Registry()
    reg.task("send_email")(got.append)
    with thread_worker(reg):
        wait_until(lambda: states(conn, schema) == {"done": 1})
    assert got == [{"to": "a@b.c"}]


def test_enqueue_function_defaults_and_named_arguments(
    conn: psycopg.Connection, schema: str
) -> None:
    a = conn.execute(f"SELECT {schema}.enqueue('t1')").fetchone()[0]
    b = conn.execute(
        f"SELECT {schema}.enqueue('t2', '{{\"x\": 1}}', queue => 'mail', priority => 7,"
        f" max_attempts => 2, run_at => now() + interval '1 hour')"
    ).fetchone()[0]
    rows = dict(
        (r[0], r[1:])
        for r in conn.execute(
            f"SELECT id, task, payload, queue, priority, max_attempts, run_at > now()"
            f" FROM {schema}.tasks"
        )
    )
    assert rows[a] == ("t1", {}, "default", 0, None, False)
    assert rows[b] == ("t2", {"x": 1}, "mail", 7, 2, True)


def test_dedupe_key_returns_the_existing_task_while_it_is_active(
    conn: psycopg.Connection, schema: str
) -> None:
    first = worker.enqueue(conn, "job", {"n": 1}, dedupe_key="k1", schema=schema)
    again = worker.enqueue(conn, "job", {"n": 2}, dedupe_key="k1", schema=schema)
    other = worker.enqueue(conn, "job", {"n": 3}, dedupe_key="k2", schema=schema)
    assert again == first and other != first
    assert conn.execute(f"SELECT count(*) FROM {schema}.tasks").fetchone()[0] == 2
    # Once the task is finished the key is free again.
    conn.execute(
        f"UPDATE {schema}.tasks SET state = 'done', finished_at = now() WHERE id = %s", (first,)
    )
    fresh = worker.enqueue(conn, "job", {"n": 4}, dedupe_key="k1", schema=schema)
    assert fresh not in (first, other)


def test_dedupe_key_holds_under_concurrent_producers(pg_dsn: str, schema: str) -> None:
    ids: list[int] = []
    barrier = threading.Barrier(8)

    def produce() -> None:
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            barrier.wait()
            ids.append(worker.enqueue(c, "job", {}, dedupe_key="same", schema=schema))

    threads = [threading.Thread(target=produce) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ids) == 8 and len(set(ids)) == 1
    with psycopg.connect(pg_dsn) as c:
        assert c.execute(f"SELECT count(*) FROM {schema}.tasks").fetchone()[0] == 1


def test_enqueue_joins_the_callers_transaction(pg_dsn: str, schema: str) -> None:
    with psycopg.connect(pg_dsn) as c:  # not autocommit: the caller owns the transaction
        worker.enqueue(c, "job", {"n": 1}, schema=schema)
        c.rollback()
        worker.enqueue(c, "job", {"n": 2}, schema=schema)
        c.commit()
        rows = c.execute(f"SELECT payload FROM {schema}.tasks").fetchall()
    assert rows == [({"n": 2},)]


def test_enqueue_uses_the_registered_tasks_queue(conn: psycopg.Connection, schema: str) -> None:
    """The queue of a task registered in the producer is its default. Its max_attempts is not
    copied into the row: the claiming worker's handler applies it (see test_worker)."""

    @worker.task("test_enqueue.defaults", queue="reports", max_attempts=9)
    def handler(payload: dict) -> None:
        pass

    task_id = worker.enqueue(conn, "test_enqueue.defaults", schema=schema)
    explicit = worker.enqueue(conn, "test_enqueue.defaults", max_attempts=2, schema=schema)
    rows = conn.execute(
        f"SELECT queue, max_attempts FROM {schema}.tasks WHERE id = ANY(%s) ORDER BY id",
        ([task_id, explicit],),
    ).fetchall()
    assert rows == [("reports", None), ("reports", 2)]
    with pytest.raises(ValueError, match="max_attempts must be at least 1"):
        worker.enqueue(conn, "test_enqueue.defaults", max_attempts=0, schema=schema)


def test_enqueue_many_copies_rows(conn: psycopg.Connection, schema: str) -> None:
    when = datetime.now(UTC) + timedelta(minutes=5)
    n = worker.enqueue_many(
        conn,
        "bulk",
        ({"i": i} for i in range(5000)),
        queue="bulkq",
        priority=3,
        run_at=when,
        schema=schema,
    )
    assert n == 5000
    row = conn.execute(
        f"SELECT count(*), count(DISTINCT payload->>'i'), min(queue), max(priority),"
        f" bool_and(run_at = %s) FROM {schema}.tasks",
        (when,),
    ).fetchone()
    assert row == (5000, 5000, "bulkq", 3, True)


def test_bulk_inserts_send_one_notification(
    pg_dsn: str, conn: psycopg.Connection, schema: str
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as listener:
        listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(notify_channel(schema))))
        worker.enqueue_many(conn, "bulk", ({"i": i} for i in range(2000)), schema=schema)
        conn.execute(
            f"INSERT INTO {schema}.tasks (task) SELECT 'multi' FROM generate_series(1, 500)"
        )
        got = list(listener.notifies(timeout=1.0))
    assert len(got) == 2  # one per statement, not one per row


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"payload": {"x": object()}}, TypeError, "not JSON-serialisable"),
        ({"run_at": datetime(2030, 1, 1)}, ValueError, "timezone-aware"),
        ({"run_at": datetime.now(UTC), "delay": 5}, ValueError, "not both"),
    ],
)
def test_enqueue_rejects_bad_input_before_touching_the_database(
    conn: psycopg.Connection, schema: str, kwargs: dict, error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        worker.enqueue(conn, "job", schema=schema, **kwargs)
    assert conn.execute(f"SELECT count(*) FROM {schema}.tasks").fetchone()[0] == 0


def test_enqueue_many_rejects_a_bad_payload_and_writes_nothing(
    conn: psycopg.Connection, schema: str
) -> None:
    with pytest.raises(TypeError, match="payload #2"):
        worker.enqueue_many(conn, "bulk", [{}, {}, {"x": {1, 2}}], schema=schema)
    assert conn.execute(f"SELECT count(*) FROM {schema}.tasks").fetchone()[0] == 0


def test_database_rejects_invalid_rows_from_sql(conn: psycopg.Connection, schema: str) -> None:
    for bad in (
        f"INSERT INTO {schema}.tasks (task, payload) VALUES ('x', 'not json')",
        f"INSERT INTO {schema}.tasks (task) VALUES ('')",
        f"INSERT INTO {schema}.tasks (task, max_attempts) VALUES ('x', 0)",
    ):
        with pytest.raises(psycopg.errors.DataError if "json" in bad else psycopg.Error):
            conn.execute(bad)


def test_enqueue_async_with_connection_and_pool(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    import asyncio

    from psycopg_pool import AsyncConnectionPool

    async def produce() -> list[int]:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as aconn:
            a = await worker.enqueue_async(aconn, "job", {"n": 1}, schema=schema)
            b = await worker.enqueue_async(aconn, "job", {"n": 2}, dedupe_key="d", schema=schema)
        async with AsyncConnectionPool(pg_dsn, open=False) as pool:
            c = await worker.enqueue_async(pool, "job", {"n": 3}, dedupe_key="d", schema=schema)
        return [a, b, c]

    a, b, c = asyncio.run(produce())
    assert a != b and b == c
    rows = conn.execute(f"SELECT payload FROM {schema}.tasks ORDER BY id").fetchall()
    assert rows == [({"n": 1},), ({"n": 2},)]


def _absent_schema(conn: psycopg.Connection) -> str:
    name = f"absent_{uuid.uuid4().hex[:12]}"
    assert conn.execute("SELECT to_regnamespace(%s)", (name,)).fetchone() == (None,)
    return name


def test_enqueue_on_a_missing_schema_says_to_migrate_it(
    pg_dsn: str, conn: psycopg.Connection
) -> None:
    """Every way in (a DSN, a connection inside the caller's transaction, COPY, asyncio with a
    pool) raises worker.SchemaMissing with one line naming the command, not PostgreSQL's error."""
    absent = _absent_schema(conn)
    line = (
        f"schema '{absent}' has no worker tables in this database: "
        f"run `worker migrate --schema {absent}`"
    )

    def raised(call: Any) -> str:
        with pytest.raises(worker.SchemaMissing) as info:
            call()
        return str(info.value)

    assert raised(lambda: worker.enqueue(pg_dsn, "job", {"n": 1}, schema=absent)) == line
    assert raised(lambda: worker.enqueue_many(pg_dsn, "job", [{}, {}], schema=absent)) == line
    assert raised(lambda: worker.enqueue_many(conn, "job", [{}], delay=5, schema=absent)) == line
    with psycopg.connect(pg_dsn) as txn:  # not autocommit: inside the caller's transaction
        txn.execute("SELECT 1")
        assert raised(lambda: worker.enqueue(txn, "job", schema=absent)) == line

    async def through_a_pool() -> None:
        async with AsyncConnectionPool(pg_dsn, open=False) as pool:
            await worker.enqueue_async(pool, "job", {"n": 1}, schema=absent)

    assert raised(lambda: asyncio.run(through_a_pool())) == line


def test_enqueue_on_an_empty_or_older_schema_says_to_migrate_it(
    pg_dsn: str, conn: psycopg.Connection
) -> None:
    empty, older = _absent_schema(conn), _absent_schema(conn)
    conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(empty)))
    migrate(conn, older, up_to=12)  # before trace contexts (0013): enqueue() has fewer arguments
    try:
        for name in (empty, older):
            with pytest.raises(worker.SchemaMissing) as info:
                worker.enqueue(pg_dsn, "job", schema=name)
            assert str(info.value) == (
                f"schema '{name}' is not migrated to version {latest_version()}, which this "
                f"version of worker-pg needs: run `worker migrate --schema {name}`"
            )
        with pytest.raises(worker.SchemaMissing, match="has no worker tables"):
            worker.enqueue_many(pg_dsn, "job", [{}], schema=empty)
    finally:
        for name in (empty, older):
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


def test_only_the_queues_own_schema_is_translated(
    pg_dsn: str, conn: psycopg.Connection, schema: str
) -> None:
    """A trigger of the user's on the task table that reads a table that is not there (in a
    schema whose name even starts with the queue's) fails with PostgreSQL's own error; the queue's
    missing schema, beside it, with SchemaMissing."""
    conn.execute(
        f"""
        CREATE FUNCTION {schema}.audit() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN PERFORM 1 FROM {schema}_audit.log; RETURN NEW; END $$;
        CREATE TRIGGER audit BEFORE INSERT ON {schema}.tasks
            FOR EACH ROW EXECUTE FUNCTION {schema}.audit();
        """
    )
    with pytest.raises(psycopg.errors.UndefinedTable, match=f"{schema}_audit.log"):
        worker.enqueue(pg_dsn, "job", schema=schema)
    with pytest.raises(psycopg.errors.UndefinedTable, match=f"{schema}_audit.log"):
        worker.enqueue_many(pg_dsn, "job", [{}], schema=schema)
    with pytest.raises(worker.SchemaMissing, match=f"run `worker migrate --schema {schema}_a`"):
        worker.enqueue(pg_dsn, "job", schema=f"{schema}_a")
