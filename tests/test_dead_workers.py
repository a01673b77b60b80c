"""What an operator sees of a worker process that died without stopping: once its tasks are
rescued, its row in `worker.workers` says it stopped, with nothing in flight, and `worker status`
neither counts it nor shows its tasks. A worker that was only frozen and comes back is live again
with its next heartbeat. Real `worker run` processes, real signals (see test_pool's helpers)."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import psycopg
from conftest import run_cli, states, wait_until
from test_pool import create_tables, enqueue_sql, live_workers, run_args, spawned, worker_env

LEASE = 2.0
FLAGS = ("--processes", "1", "--concurrency", "4", "--lease", str(LEASE), "--poll-interval", "0.5")


def _row(conn: psycopg.Connection, schema: str, worker_id: str) -> dict[str, Any]:
    cur = conn.execute(
        f"SELECT stopped_at, heartbeat_at, in_flight FROM {schema}.workers WHERE id = %s",
        (worker_id,),
    )
    stopped, beat, in_flight = cur.fetchone()
    return {"stopped_at": stopped, "heartbeat_at": beat, "in_flight": in_flight}


def _status(dsn: str, schema: str) -> dict[str, Any]:
    r = run_cli("status", "--dsn", dsn, "--schema", schema, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _rescued(conn: psycopg.Connection, schema: str, ids: list[int]) -> bool:
    errors = conn.execute(
        f"SELECT last_error FROM {schema}.tasks WHERE id = ANY(%s)", (ids,)
    ).fetchall()
    return all(e and e.startswith("LeaseExpired") for (e,) in errors)


def test_a_sigkilled_worker_is_stopped_in_the_registry_once_its_tasks_are_rescued(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """Worker A runs three long tasks and is SIGKILLed; worker B rescues them. A's row then says
    it stopped at its last heartbeat with nothing in flight, and `worker status` shows one live
    worker (B), not A with its three stale tasks in flight."""
    create_tables(conn, schema)
    env = worker_env(pg_dsn, schema)
    with spawned(*run_args(pg_dsn, schema, *FLAGS), env=env) as a:
        wait_until(lambda: a.pid in live_workers(conn, schema), timeout=30)
        a_id = live_workers(conn, schema)[a.pid]
        ids = enqueue_sql(conn, schema, "slow", 3, sleep=60.0)
        # A's heartbeat has counted them (what status showed for good before).
        wait_until(lambda: _row(conn, schema, a_id)["in_flight"] == 3, timeout=20)
        with spawned(*run_args(pg_dsn, schema, *FLAGS), env=env) as b:
            wait_until(lambda: b.pid in live_workers(conn, schema), timeout=30)
            b_id = live_workers(conn, schema)[b.pid]
            a.kill()
            a.wait()
            wait_until(lambda: _rescued(conn, schema, ids), timeout=30)
            row = _row(conn, schema, a_id)
            assert row["stopped_at"] is not None, row
            assert row["stopped_at"] == row["heartbeat_at"]  # when it was last heard from
            assert row["in_flight"] == 0
            assert a.pid not in live_workers(conn, schema)

            st = _status(pg_dsn, schema)
            assert [w["id"] for w in st["workers"]] == [b_id]
            assert st["routing"]["workers_alive"] == 1
            text = run_cli("status", "--dsn", pg_dsn, "--schema", schema)
            assert text.returncode == 0, text.stderr
            assert "workers (1 registered, 1 alive)" in text.stdout, text.stdout
            assert f" {a.pid} " not in text.stdout
            # B, which rescued them, is untouched: live, and now running them.
            assert _row(conn, schema, b_id)["stopped_at"] is None
            wait_until(lambda: states(conn, schema) == {"in_progress": 3}, timeout=20)


def test_a_worker_frozen_past_its_lease_is_marked_stopped_and_live_again_when_it_wakes(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """SIGSTOP freezes worker A past its lease: B's rescue takes its task and marks A stopped.
    SIGCONT: A's next heartbeat says it lives, and the registry and `worker status` count it
    again (it would otherwise look dead while it claims and runs tasks)."""
    create_tables(conn, schema)
    env = worker_env(pg_dsn, schema)
    with spawned(*run_args(pg_dsn, schema, *FLAGS), env=env) as a:
        wait_until(lambda: a.pid in live_workers(conn, schema), timeout=30)
        a_id = live_workers(conn, schema)[a.pid]
        ids = enqueue_sql(conn, schema, "slow", 1, sleep=60.0)
        wait_until(lambda: _row(conn, schema, a_id)["in_flight"] == 1, timeout=20)
        with spawned(*run_args(pg_dsn, schema, *FLAGS), env=env) as b:
            wait_until(lambda: b.pid in live_workers(conn, schema), timeout=30)
            os.kill(a.pid, signal.SIGSTOP)
            try:
                wait_until(lambda: _rescued(conn, schema, ids), timeout=30)
                assert _row(conn, schema, a_id)["stopped_at"] is not None
                assert len(_status(pg_dsn, schema)["workers"]) == 1
            finally:
                os.kill(a.pid, signal.SIGCONT)
            wait_until(lambda: _row(conn, schema, a_id)["stopped_at"] is None, timeout=20)
            assert a.pid in live_workers(conn, schema)
            st = _status(pg_dsn, schema)
            assert len(st["workers"]) == 2 and st["routing"]["workers_alive"] == 2
            # And the pool goes on: tasks enqueued now are done.
            done = enqueue_sql(conn, schema, "record", 8)
            finished = f"SELECT count(*) FROM {schema}.tasks WHERE id = ANY(%s) AND state = 'done'"
            wait_until(lambda: conn.execute(finished, (done,)).fetchone()[0] == 8, timeout=30)


def test_a_pool_child_killed_by_a_signal_is_stopped_in_the_registry_at_once(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """Under a supervisor, the dead child's rows go back at once (no lease to wait for), and its
    row in the registry says it stopped, with nothing in flight."""
    create_tables(conn, schema)
    args = run_args(pg_dsn, schema, "--processes", "2", "--concurrency", "2")
    with spawned(*args, env=worker_env(pg_dsn, schema)):
        wait_until(lambda: len(live_workers(conn, schema)) == 2, timeout=30)
        ids = enqueue_sql(conn, schema, "slow", 4, sleep=60.0)
        wait_until(lambda: states(conn, schema).get("in_progress") == 4, timeout=20)
        victim, victim_id = next(iter(live_workers(conn, schema).items()))
        wait_until(lambda: _row(conn, schema, victim_id)["in_flight"] == 2, timeout=20)
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: _row(conn, schema, victim_id)["stopped_at"] is not None, timeout=20)
        assert _row(conn, schema, victim_id)["in_flight"] == 0
        assert victim_id not in [w["id"] for w in _status(pg_dsn, schema)["workers"]]
        # Its two tasks went back at once, saying how it died.
        died = conn.execute(
            f"SELECT count(*) FROM {schema}.tasks WHERE id = ANY(%s)"
            " AND last_error LIKE 'WorkerDied:%%'",
            (ids,),
        ).fetchone()[0]
        assert died == 2
