"""Faults outside the worker processes: the database restarts, connections are cut, leases expire
under a live worker. Every run must end with every task done (at least once) and none stuck, and
a worker that lost a row must never be able to settle it over its new owner."""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
from conftest import ThreadWorker, every_statement, wait_until
from psycopg.conninfo import make_conninfo
from test_pool import (
    child_pids,
    create_tables,
    enqueue_sql,
    run_args,
    spawned,
    worker_env,
)

import worker
from worker import store as tr
from worker.db.migrate import migrate
from worker.dev.embedded import EmbeddedPostgres
from worker.engine.loop import WorkerConfig


def _query(dsn: str, sql: str, params: Any = None) -> list[tuple[Any, ...]] | None:
    """One query on a fresh connection; None while the server is unreachable."""
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=3) as c:
            return c.execute(sql, params).fetchall()
    except psycopg.OperationalError:
        return None


def _states(dsn: str, schema: str) -> dict[str, int] | None:
    rows = _query(dsn, f"SELECT state::text, count(*) FROM {schema}.tasks GROUP BY 1")
    return None if rows is None else dict(rows)  # type: ignore[arg-type]


def _assert_every_task_ran(conn: psycopg.Connection, schema: str) -> None:
    never = conn.execute(
        f"SELECT count(*) FROM {schema}.tasks t WHERE NOT EXISTS"
        f" (SELECT 1 FROM {schema}.executions e WHERE e.task_id = t.id)"
    ).fetchone()[0]
    assert never == 0
    # The run that completed the row is on record, by the worker that completed it.
    unproven = conn.execute(
        f"SELECT count(*) FROM {schema}.tasks t WHERE NOT EXISTS"
        f" (SELECT 1 FROM {schema}.executions e WHERE e.task_id = t.id"
        "   AND e.attempt = t.attempts AND e.worker_id = t.worker_id)"
    ).fetchone()[0]
    assert unproven == 0


# -- the database goes away ---------------------------------------------------------------------


def _prepare(dsn: str, schema: str, n: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        migrate(c, schema)
        create_tables(c, schema)
        enqueue_sql(c, schema, "record", n, sleep=0.01)


def test_database_restart_mid_run(private_server: EmbeddedPostgres) -> None:
    """The server is stopped in the middle of a run and started again ~2 s later on the same
    port. The worker processes ride it out (none dies) and the run completes: every task done
    at least once, none left queued or in progress."""
    dsn = private_server.start()
    schema, n = "faults", 4000
    _prepare(dsn, schema, n)
    args = run_args(dsn, schema, "--processes", "2", "--concurrency", "8", "--lease", "5")
    with spawned(*args, env=worker_env(dsn, schema)) as sup:
        wait_until(
            lambda: (_states(dsn, schema) or {}).get("done", 0) >= n // 5, timeout=40, interval=0.1
        )
        before = child_pids(sup)
        private_server.stop()
        time.sleep(2)
        assert private_server.start() == dsn  # same port, same DSN
        wait_until(lambda: _states(dsn, schema) == {"done": n}, timeout=60, interval=0.5)
        assert sup.poll() is None
        assert child_pids(sup) == before
    with psycopg.connect(dsn, autocommit=True) as c:
        _assert_every_task_ran(c, schema)


def test_an_outage_longer_than_the_stuck_limit_kills_no_worker(
    private_server: EmbeddedPostgres,
) -> None:
    """The database stays down for longer than --stuck-after, and a child is SIGKILLed during
    the outage. Workers that retry are not stuck: the supervisor kills none of them, and the
    replacement of the killed child waits for the database instead of exiting again and again
    (a crash loop the supervisor would give up on). The run then completes."""
    dsn = private_server.start()
    schema, n = "faults", 4000
    stuck_after = 8.0
    _prepare(dsn, schema, n)
    args = run_args(
        dsn,
        schema,
        "--processes",
        "2",
        "--concurrency",
        "8",
        "--lease",
        "5",
        "--stuck-after",
        str(stuck_after),
    )
    with spawned(*args, env=worker_env(dsn, schema)) as sup:
        wait_until(
            lambda: (_states(dsn, schema) or {}).get("done", 0) >= n // 5, timeout=40, interval=0.1
        )
        before = child_pids(sup)
        private_server.stop()
        victim, survivor = sorted(before)
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: len(child_pids(sup) - before) == 1, timeout=10)
        replacement = (child_pids(sup) - before).pop()
        time.sleep(stuck_after + 4)
        assert child_pids(sup) == {survivor, replacement}
        assert private_server.start() == dsn
        wait_until(lambda: _states(dsn, schema) == {"done": n}, timeout=60, interval=0.5)
        assert sup.poll() is None
        assert child_pids(sup) == {survivor, replacement}
        workers = {pid for (pid,) in _query(dsn, f"SELECT pid FROM {schema}.workers") or []}
        assert replacement in workers  # it did start working once the database was back
    with psycopg.connect(dsn, autocommit=True) as c:
        _assert_every_task_ran(c, schema)


def test_terminated_connections_mid_run(pg_dsn: str, schema: str, conn: psycopg.Connection) -> None:
    """Every connection of the workers (pool, LISTEN, the handlers' own) is killed with
    pg_terminate_backend again and again during a run. The processes survive and the run
    completes. The workers are told apart by their application_name."""
    create_tables(conn, schema)
    n = 4000
    enqueue_sql(conn, schema, "record", n, sleep=0.005)
    app = f"faults_{uuid.uuid4().hex[:8]}"
    dsn = make_conninfo(pg_dsn, application_name=app)
    args = run_args(dsn, schema, "--processes", "2", "--concurrency", "8", "--lease", "3")
    rng = random.Random(7)
    terminated = rounds = 0
    with spawned(*args, env=worker_env(dsn, schema)) as sup:
        wait_until(
            lambda: (
                conn.execute(
                    f"SELECT count(*) FROM {schema}.tasks WHERE state = 'done'"
                ).fetchone()[0]
                > 0
            ),
            timeout=30,
        )
        before = child_pids(sup)
        while (
            rounds < 15
            and conn.execute(
                f"SELECT count(*) FROM {schema}.tasks WHERE state <> 'done'"
            ).fetchone()[0]
            > n // 10
        ):
            terminated += conn.execute(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE application_name = %s AND pid <> pg_backend_pid()",
                (app,),
            ).fetchone()[0]
            rounds += 1
            time.sleep(rng.uniform(0.2, 0.5))
        wait_until(
            lambda: (
                conn.execute(
                    f"SELECT count(*) FILTER (WHERE state = 'done') FROM {schema}.tasks"
                ).fetchone()[0]
                == n
            ),
            timeout=60,
            interval=0.25,
        )
        assert sup.poll() is None
        assert child_pids(sup) == before
    assert rounds >= 5 and terminated >= rounds, (rounds, terminated)
    _assert_every_task_ran(conn, schema)


# -- fencing ------------------------------------------------------------------------------------


def test_an_expired_owner_cannot_settle_the_row_of_its_successor(
    conn: psycopg.Connection, schema: str
) -> None:
    """Worker A claims with a short lease, the lease runs out, the row is rescued and claimed by
    B. Nothing A sends afterwards (complete, delete, retry, release, heartbeat) touches B's row,
    nor does a stale attempt number from B itself; B's own acknowledgement still works."""
    q = every_statement(schema)
    task_id = worker.enqueue(conn, "fenced", {}, schema=schema)
    a, b = str(uuid.uuid4()), str(uuid.uuid4())
    [mine] = tr.claim(conn, q.schema, queues=["default"], limit=10, worker_id=a, lease_seconds=0.2)
    assert (mine.id, mine.attempt) == (task_id, 1)
    time.sleep(0.4)
    assert [(r[0], r[3]) for r in tr.rescue(conn, q.schema)] == [(task_id, "queued")]
    [theirs] = tr.claim(conn, q.schema, queues=["default"], limit=10, worker_id=b, lease_seconds=30)
    assert (theirs.id, theirs.attempt) == (task_id, 2)

    def row() -> tuple[Any, ...]:
        return conn.execute(
            f"SELECT state::text, worker_id::text, attempts, lease_expires_at, last_error"
            f" FROM {schema}.tasks WHERE id = %s",
            (task_id,),
        ).fetchone()

    before = row()
    assert before[:3] == ("in_progress", b, 2)
    assert tr.complete(conn, q.schema, worker_id=a, done=[(task_id, 1)]) == {}
    assert tr.complete(conn, q.schema, worker_id=a, done=[(task_id, 1)], delete=True) == {}
    assert tr.complete(conn, q.schema, worker_id=a, done=[(task_id, 2)]) == {}  # B's attempt number
    failure = tr.Failure(task_id, 1, 0.0, "ValueError: late", permanent=True)
    assert tr.fail(conn, q.schema, worker_id=a, failures=[failure]) == {}
    assert tr.release(conn, q.schema, worker_id=a, tasks=[(task_id, 1)]) == {}
    beat = tr.heartbeat(conn, q.schema, worker_id=a, tasks=[(task_id, 1)], lease_seconds=3600)
    assert beat.lost == {(task_id, 1)} and beat.cancel == set()
    assert tr.complete(conn, q.schema, worker_id=b, done=[(task_id, 1)]) == {}  # stale attempt
    assert row() == before
    assert tr.complete(conn, q.schema, worker_id=b, done=[(task_id, 2)]) == {task_id: "done"}
    assert row()[:3] == ("done", b, 2)


def test_a_worker_whose_heartbeats_stop_loses_its_row_to_another_worker(
    pg_dsn: str, schema: str, conn: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """Through real Worker loops: A's heartbeats are blocked while its handler runs past the
    lease, B rescues and claims the row, and when A's handler finally returns, A's completion is
    refused while B still holds the row; B then completes it."""
    caplog.set_level(logging.WARNING, logger="worker")
    runs: list[tuple[str, int]] = []
    a_go, b_go = threading.Event(), threading.Event()
    reg = worker.Registry()

    @reg.task("hold")
    def hold(payload: dict, ctx: worker.Context) -> None:
        runs.append((ctx.worker_id, ctx.attempt))
        (a_go if ctx.attempt == 1 else b_go).wait(30)

    def config(**kw: Any) -> WorkerConfig:
        return WorkerConfig(dsn=pg_dsn, schema=schema, poll_interval=0.1, lease_seconds=1.0, **kw)

    task_id = worker.enqueue(conn, "hold", {}, schema=schema)
    a = ThreadWorker(config(concurrency=1), reg)
    a.worker.lease.stop()  # as if A hung: its leases are no longer renewed
    b = ThreadWorker(config(concurrency=2), reg)
    try:
        with a:
            wait_until(lambda: runs == [(a.worker.id, 1)])
            with b:
                wait_until(lambda: len(runs) == 2, timeout=20)
                assert runs[1] == (b.worker.id, 2)
                a_go.set()  # A's handler returns and A tries to complete attempt 1
                wait_until(lambda: f"could not complete task {task_id}" in caplog.text)
                state, owner, attempts = conn.execute(
                    f"SELECT state::text, worker_id::text, attempts FROM {schema}.tasks"
                    " WHERE id = %s",
                    (task_id,),
                ).fetchone()
                assert (state, owner, attempts) == ("in_progress", b.worker.id, 2)
                b_go.set()
                wait_until(
                    lambda: (
                        conn.execute(
                            f"SELECT state::text FROM {schema}.tasks WHERE id = %s", (task_id,)
                        ).fetchone()[0]
                        == "done"
                    )
                )
    finally:
        a_go.set()
        b_go.set()
    state, owner, attempts, error = conn.execute(
        f"SELECT state::text, worker_id::text, attempts, last_error FROM {schema}.tasks"
        " WHERE id = %s",
        (task_id,),
    ).fetchone()
    assert (state, owner, attempts) == ("done", b.worker.id, 2)
    assert error.startswith("LeaseExpired:") and a.worker.id in error
