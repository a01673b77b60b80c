"""Routing (issue 11): a task enqueued without a queue lands in its handler's queue, whatever the
producer, once a worker that has the handler has run against the database. And the vacuum that
keeps a churning table small between autovacuum's rounds."""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path

import psycopg
import pytest
from conftest import every_statement, run_cli, wait_until

import worker
from worker.engine.vacuum import VacuumConfig, Vacuumer


def _queue(conn: psycopg.Connection, schema: str, task_id: int) -> str:
    row = conn.execute(f"SELECT queue FROM {schema}.tasks WHERE id = %s", (task_id,)).fetchone()
    assert row is not None
    return row[0]


def test_every_producer_lands_in_the_handlers_queue(
    pg_dsn: str, conn: psycopg.Connection, schema: str, thread_worker
) -> None:
    """`send_email` is registered with queue="mail". Before any worker declared it, a producer
    that does not know the handler lands in 'default' (as the README says). Once a worker that
    has it has started, a plain INSERT, the SQL function, the CLI and Python without the
    handler imported all land in 'mail', and a worker serving only 'mail' runs them."""
    before = worker.enqueue(conn, "send_email", schema=schema)
    assert _queue(conn, schema, before) == "default"

    reg = worker.Registry()
    sent: list[str] = []
    reg.task("send_email", queue="mail")(lambda p: sent.append(p.get("via", "?")))
    with thread_worker(reg, queues=["mail"]):
        wait_until(
            lambda: (
                conn.execute(
                    f"SELECT queue FROM {schema}.task_routes WHERE task = 'send_email'"
                ).fetchone()
                == ("mail",)
            )
        )
    ids = []
    row = conn.execute(
        f"INSERT INTO {schema}.tasks (task, payload)"
        " VALUES ('send_email', '{\"via\": \"insert\"}') RETURNING id"
    ).fetchone()
    assert row is not None
    ids.append(row[0])
    row = conn.execute(
        f"SELECT {schema}.enqueue('send_email', '{{\"via\": \"function\"}}')"
    ).fetchone()
    assert row is not None
    ids.append(row[0])
    out = run_cli(
        "enqueue",
        "send_email",
        "--payload",
        '{"via": "cli"}',
        "--schema",
        schema,
        env={"WORKER_DSN": pg_dsn},
    )
    assert out.returncode == 0, out.stderr
    ids.append(int(out.stdout.split()[-1]))
    # This process's registry does not have send_email: the database routes it.
    assert worker.registry.get("send_email") is None
    ids.append(worker.enqueue(conn, "send_email", {"via": "python"}, schema=schema))
    worker.enqueue_many(conn, "send_email", [{"via": "copy"}], schema=schema)
    assert [_queue(conn, schema, i) for i in ids] == ["mail"] * 4
    assert conn.execute(f"SELECT count(*) FROM {schema}.tasks WHERE queue = 'mail'").fetchone() == (
        5,
    )
    # An explicit queue still wins.
    assert _queue(conn, schema, worker.enqueue(conn, "send_email", queue="x", schema=schema)) == "x"

    with thread_worker(reg, queues=["mail"]):
        wait_until(lambda: len(sent) == 5)
    assert sorted(sent) == ["cli", "copy", "function", "insert", "python"]


def test_vacuum_removes_dead_rows_and_backs_off_when_the_horizon_is_held(
    pg_dsn: str, conn: psycopg.Connection, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The maintenance vacuum runs when the table holds many dead rows and nobody vacuumed it
    lately; when a held snapshot keeps it from removing them, it says so and waits longer."""
    q = every_statement(schema)
    vac = Vacuumer(q, schema, VacuumConfig(min_dead=2000, min_gap_seconds=0))

    def dead() -> int:
        return _dead_rows(conn, schema)

    with psycopg.connect(pg_dsn) as holder:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT 1").fetchone()
        worker.enqueue_many(conn, "t", ({"n": i} for i in range(5000)), schema=schema)
        conn.execute(f"UPDATE {schema}.tasks SET state = 'done', finished_at = now()")
        wait_until(lambda: dead() >= 4000, timeout=10)
        with caplog.at_level(logging.INFO, logger="worker"):
            assert vac.tick(conn, 10_000) == 0
        assert any("xmin horizon" in r.getMessage() for r in caplog.records)
        assert vac.tick(conn, 10_000) == 0  # backing off: not even looked at
        holder.rollback()
    vac = Vacuumer(q, schema, VacuumConfig(min_dead=2000, min_gap_seconds=0))
    before = dead()
    assert before >= 4000
    removed = vac.tick(conn, 10_000)
    assert removed >= 4000 and dead() < 1000, (before, removed, dead())
    time.sleep(0.01)
    assert vac.tick(conn, 10_000) == 0  # nothing left worth a vacuum


def _dead_rows(conn: psycopg.Connection, schema: str) -> int:
    """The task table's dead row versions, as the statistics say now."""
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = %s::regclass",
        (f"{schema}.tasks",),
    ).fetchone()
    return int(row[0]) if row else 0


def test_a_vacuum_left_to_another_one_running_is_no_sign_of_a_held_horizon(
    pg_dsn: str, conn: psycopg.Connection, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """While another vacuum has the table (autovacuum's; here a session holding the same lock),
    the worker's own VACUUM (SKIP_LOCKED) skips it. That skip is not a vacuum that removed
    nothing: no warning about a held horizon, no back-off, and the next look vacuums at once."""
    q = every_statement(schema)
    vac = Vacuumer(q, schema, VacuumConfig(min_dead=2000, min_gap_seconds=0))
    worker.enqueue_many(conn, "t", ({"n": i} for i in range(5000)), schema=schema)
    conn.execute(f"UPDATE {schema}.tasks SET state = 'done', finished_at = now()")

    wait_until(lambda: _dead_rows(conn, schema) >= 4000, timeout=10)
    with psycopg.connect(pg_dsn) as other:
        # The lock a running vacuum holds on its table.
        other.execute(f"LOCK TABLE {schema}.tasks IN SHARE UPDATE EXCLUSIVE MODE")
        with caplog.at_level(logging.DEBUG, logger="worker"):
            assert vac.tick(conn, 10_000) == 0
        other.rollback()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "left to the one running" in caplog.text
    assert vac.tick(conn, 10_000) >= 4000  # no back-off: the next look vacuums
    assert _dead_rows(conn, schema) < 1000


def test_vacuum_is_not_repeated_while_the_same_transaction_holds_the_horizon(
    pg_dsn: str, conn: psycopg.Connection, schema: str
) -> None:
    """A fruitless vacuum is not run again, however often the service looks, while the
    transaction that made it fruitless is still open (each would read the whole table and its
    indexes for nothing); once another transaction holds the horizon, it tries again."""
    q = every_statement(schema)
    vac = Vacuumer(q, schema, VacuumConfig(min_dead=2000, min_gap_seconds=0, max_backoff_seconds=0))

    def vacuums() -> int:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = %s::regclass",
            (f"{schema}.tasks",),
        ).fetchone()
        return int(row[0]) if row else 0

    def hold() -> psycopg.Connection:
        holder = psycopg.connect(pg_dsn)
        holder.execute("SELECT txid_current()").fetchone()
        return holder

    holder = hold()
    try:
        worker.enqueue_many(conn, "t", ({"n": i} for i in range(5000)), schema=schema)
        conn.execute(f"UPDATE {schema}.tasks SET state = 'done', finished_at = now()")

        wait_until(lambda: _dead_rows(conn, schema) >= 4000, timeout=10)
        vac.tick(conn, 10_000)
        wait_until(lambda: vacuums() == 1, timeout=10)
        for _ in range(3):
            vac.tick(conn, 10_000)
        time.sleep(0.5)
        assert vacuums() == 1
        holder.close()
        holder = hold()  # a later transaction: the horizon moves, not far enough to help
        wait_until(lambda: _dead_rows(conn, schema) >= 4000, timeout=10)
        vac.tick(conn, 10_000)
        wait_until(lambda: vacuums() == 2, timeout=10)
    finally:
        holder.close()


def test_migrate_with_a_module_routes_the_first_enqueue(pg_dsn: str, tmp_path: Path) -> None:
    """`worker migrate --module tasks` then `worker enqueue`, no worker ever started: the row is
    in its handler's queue, and a typo of the name is enqueued with one warning line."""
    schema = f"r_{uuid.uuid4().hex[:10]}"
    (tmp_path / "routed_tasks.py").write_text(
        "import worker\n\n\n@worker.task('send_email', queue='mail')\n"
        "def send_email(payload, ctx):\n    pass\n"
    )
    env = {"PYTHONPATH": str(tmp_path)}
    try:
        r = run_cli("migrate", "--dsn", pg_dsn, "--schema", schema, "--module", "routed_tasks",
                    env=env)  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert "recorded the queues of 1 task(s): send_email -> mail" in r.stdout
        r = run_cli("enqueue", "send_email", "--dsn", pg_dsn, "--schema", schema)
        assert r.returncode == 0 and r.stderr == "", r.stderr
        typo = run_cli("enqueue", "send_emial", "--dsn", pg_dsn, "--schema", schema)
        assert typo.returncode == 0
        assert typo.stderr.count("\n") == 1, typo.stderr
        assert "warning: no worker has declared task 'send_emial'" in typo.stderr
        quiet = run_cli("enqueue", "send_emial", "--quiet", "--dsn", pg_dsn, "--schema", schema)
        assert quiet.returncode == 0 and quiet.stderr == ""
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            rows = c.execute(f"SELECT task, queue FROM {schema}.tasks ORDER BY id").fetchall()
        typos = [("send_emial", "default")] * 2  # enqueued all the same
        assert rows == [("send_email", "mail"), *typos]
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            c.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
