"""One connection factory (worker.db.connect): every connection of the package is made there,
says what it is for in pg_stat_activity, keeps TCP keepalives on, and carries its duty's session
settings (timeouts, plans on the indexes, WORKER_DB_ROLE), none of which is made behind
PgBouncer."""

from __future__ import annotations

import ast
import re
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import wait_until

import worker
from worker.db import connect as factory

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "worker"
FACTORY = PACKAGE / "db" / "connect.py"


def test_nothing_but_the_factory_opens_a_connection() -> None:
    """No module of the package calls psycopg.connect, AsyncConnection.connect or builds a pool
    itself (a connection the caller hands us is used as it is)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == FACTORY:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                text = ast.unparse(node.func)
                if re.fullmatch(
                    r"psycopg\.(connect|Connection\.connect|AsyncConnection\.connect)"
                    r"|(Async)?ConnectionPool|psycopg_pool\.(Async)?ConnectionPool",
                    text,
                ):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {text}")
    assert found == []


def _setting(conn: psycopg.Connection, name: str) -> str:
    row = conn.execute("SELECT current_setting(%s)", (name,)).fetchone()
    assert row is not None
    return str(row[0])


def test_a_duty_sets_its_name_keepalives_and_session_settings(pg_dsn: str) -> None:
    duty = factory.LEASE.with_timeouts(statement_ms=1234, lock_ms=567)
    with factory.connect(pg_dsn, duty) as conn:
        assert _setting(conn, "application_name") == "worker-lease"
        assert _setting(conn, "statement_timeout") == "1234ms"
        assert _setting(conn, "lock_timeout") == "567ms"
        assert _setting(conn, "enable_seqscan") == "off"
        params = conn.info.get_parameters()
        assert params.get("keepalives") == "1" and params.get("keepalives_idle") == "10"
        assert conn.prepare_threshold == 5 and conn.autocommit


def test_behind_pgbouncer_nothing_is_prepared_and_no_session_setting_is_made(
    pg_dsn: str,
) -> None:
    duty = factory.LEASE.with_timeouts(statement_ms=1234)
    with factory.connect(pg_dsn, duty, session=False) as conn:
        assert conn.prepare_threshold is None
        assert _setting(conn, "statement_timeout") == "0"
        assert _setting(conn, "enable_seqscan") == "on"
        assert _setting(conn, "application_name") == "worker-lease"


def test_worker_db_role_is_taken_on_every_session_connection(
    pg_dsn: str, conn: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    role = f"r_{uuid.uuid4().hex[:10]}"
    conn.execute(f"CREATE ROLE {role} NOLOGIN")
    conn.execute(f"GRANT {role} TO current_user")
    try:
        monkeypatch.setenv(factory.ROLE_ENV, role)
        with factory.connect(pg_dsn, factory.CLAIM) as c:
            assert c.execute("SELECT current_user").fetchone() == (role,)
        with factory.connect(pg_dsn, factory.CLAIM, session=False) as c:
            assert c.execute("SELECT current_user").fetchone() != (role,)
    finally:
        conn.execute(f"DROP ROLE {role}")


def test_the_pool_applies_the_duty_and_replaces_a_connection_the_server_closed(
    pg_dsn: str, conn: psycopg.Connection
) -> None:
    made = factory.pool(pg_dsn, factory.HANDLERS, max_size=2, name="test-pool")
    try:
        with made.connection() as c:
            assert _setting(c, "application_name") == "worker-handler"
            pid = c.info.backend_pid
        conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with made.connection() as c:
            assert c.execute("SELECT 1").fetchone() == (1,)
            assert c.info.backend_pid != pid
    finally:
        made.close()


def test_every_connection_of_a_running_worker_says_what_it_is_for(
    conn: psycopg.Connection, schema: str, thread_worker: Any
) -> None:
    """A worker process's claim loop, lease keeper, maintenance and transactional handlers are
    told apart in pg_stat_activity, as doctor, bench and the embedded server's stop count them."""
    reg = worker.Registry()

    @reg.task("txn", transactional=True)
    def txn(payload: Any, ctx: worker.Context) -> None:
        assert ctx.conn is not None
        ctx.conn.execute("SELECT 1")

    def names() -> set[str]:
        rows = conn.execute(
            "SELECT application_name FROM pg_stat_activity WHERE datname = current_database()"
        ).fetchall()
        return {r[0] for r in rows}

    with thread_worker(reg):
        worker.enqueue(conn, "txn", {}, schema=schema)
        wait_until(
            lambda: {"worker", "worker-lease", "worker-maintenance", "worker-handler"} <= names(),
            timeout=15,
        )
