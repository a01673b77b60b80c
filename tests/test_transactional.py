"""Transactional handlers: the handler's writes and the task's completion commit together or not
at all, including when the worker process is killed between them."""

from __future__ import annotations

import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import spawn_cli, states, wait_until

import worker


def _tables(conn: psycopg.Connection, schema: str) -> None:
    conn.execute(f"CREATE TABLE {schema}.side_effects (task_id bigint, attempt int, pid int)")
    conn.execute(f"CREATE TABLE {schema}.progress (task_id bigint, attempt int, pid int)")


def _count(conn: psycopg.Connection, sql: str) -> int:
    return conn.execute(sql).fetchone()[0]


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.mark.slow
def test_worker_killed_between_the_handlers_writes_and_completion_leaves_neither(
    pg_dsn: str, conn: psycopg.Connection, schema: str, tmp_path: Path
) -> None:
    """kill -9 while a transactional handler sleeps after its write: the write is gone and the
    task is not done. After the lease runs out another worker runs it again, and then the write
    and the completion are both visible, exactly once."""
    _tables(conn, schema)
    task_id = worker.enqueue(conn, "tx_write", {"sleep": 60}, schema=schema)
    env = {"WORKER_DSN": pg_dsn, "WORKER_SCHEMA": schema}
    args = [
        "run",
        "transactional_module",
        "--processes",
        "1",
        "--concurrency",
        "1",
        "--lease",
        "2",
        "--dsn",
        pg_dsn,
        "--schema",
        schema,
    ]
    first = spawn_cli(*args, env=env, stderr=open(tmp_path / "first.log", "w"))  # noqa: SIM115
    second: subprocess.Popen[str] | None = None
    try:
        # The handler wrote its row (uncommitted) and is now sleeping inside the transaction.
        wait_until(lambda: _count(conn, f"SELECT count(*) FROM {schema}.progress"), timeout=30)
        assert _count(conn, f"SELECT count(*) FROM {schema}.side_effects") == 0
        assert states(conn, schema) == {"in_progress": 1}
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        # The server rolled the transaction back: no write, and the task is not done.
        assert _count(conn, f"SELECT count(*) FROM {schema}.side_effects") == 0
        assert states(conn, schema) == {"in_progress": 1}

        second = spawn_cli(*args, env=env, stderr=open(tmp_path / "second.log", "w"))  # noqa: SIM115
        wait_until(lambda: states(conn, schema) == {"done": 1}, timeout=30)
    finally:
        _stop(first)
        if second is not None:
            _stop(second)
    rows = conn.execute(f"SELECT task_id, attempt FROM {schema}.side_effects").fetchall()
    assert rows == [(task_id, 2)]
    attempts, error = conn.execute(
        f"SELECT attempts, last_error FROM {schema}.tasks WHERE id = %s", (task_id,)
    ).fetchone()
    assert attempts == 2
    assert error.startswith("LeaseExpired")  # rescued after its worker died
    progress = conn.execute(
        f"SELECT attempt, pid FROM {schema}.progress ORDER BY attempt"
    ).fetchall()
    assert [a for a, _ in progress] == [1, 2]
    assert progress[0][1] == first.pid and progress[1][1] == second.pid


def test_transactional_handler_commits_writes_and_completion_together(
    conn: psycopg.Connection, schema: str, thread_worker: Any
) -> None:
    """A failing transactional handler leaves no write behind; a succeeding one leaves its write
    and its completion, together."""
    conn.execute(f"CREATE TABLE {schema}.ledger (task_id bigint, note text)")
    reg = worker.Registry()

    @reg.task("post", transactional=True, max_attempts=2, retry_backoff=0.05)
    def post(payload: dict, ctx: worker.Context) -> None:
        assert ctx.conn is not None
        ctx.conn.execute(
            f"INSERT INTO {schema}.ledger VALUES (%s, %s)", (ctx.task_id, f"try {ctx.attempt}")
        )
        if payload.get("fail"):
            raise ValueError("refused")

    ok = worker.enqueue(conn, "post", {}, schema=schema)
    bad = worker.enqueue(conn, "post", {"fail": True}, schema=schema)
    with thread_worker(reg, poll_interval=0.05):
        wait_until(lambda: states(conn, schema) == {"done": 1, "failed": 1})
    rows = conn.execute(f"SELECT task_id, note FROM {schema}.ledger").fetchall()
    assert rows == [(ok, "try 1")]
    assert bad != ok


def test_advisory_lock_in_a_transactional_handler_is_released_by_the_tasks_commit(
    conn: psycopg.Connection, schema: str, thread_worker: Any
) -> None:
    """Taken on ctx.conn, the advisory lock joins the task's transaction: the handler's writes,
    the lock's release and the task's completion commit at the same moment."""
    conn.execute(f"CREATE TABLE {schema}.outbox (task_id bigint)")
    reg = worker.Registry()
    inside = threading.Event()
    go_on = threading.Event()
    won: list[bool] = []

    @reg.task("close_books", transactional=True)
    def close_books(payload: dict, ctx: worker.Context) -> None:
        assert ctx.conn is not None
        with worker.advisory_lock(ctx.conn, "close-books") as lock:
            won.append(lock.acquired)
            lock.conn.execute(f"INSERT INTO {schema}.outbox VALUES (%s)", (ctx.task_id,))
        inside.set()  # the block ended, but the task's transaction is still open
        go_on.wait(10)

    def lock_is_free() -> bool:
        with worker.advisory_lock(conn, "close-books") as probe:
            return probe.acquired

    worker.enqueue(conn, "close_books", {}, schema=schema)
    with thread_worker(reg, poll_interval=0.05):
        assert inside.wait(10)
        assert not lock_is_free()
        assert _count(conn, f"SELECT count(*) FROM {schema}.outbox") == 0
        go_on.set()
        wait_until(lambda: states(conn, schema) == {"done": 1})
    assert won == [True]
    assert lock_is_free()
    assert _count(conn, f"SELECT count(*) FROM {schema}.outbox") == 1
