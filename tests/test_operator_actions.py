"""`worker retry --failed` and `worker cancel` on the states a row can be in now: a dedupe key that
a live task holds no longer aborts a whole retry, and a scheduled task can be cancelled."""

from __future__ import annotations

import json

import psycopg
from conftest import run_cli

from worker.ops import bulk as _bulk


def _failed(conn: psycopg.Connection, schema: str, queue: str, keys: list[str | None]) -> None:
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, state, attempts, finished_at, last_error,"
        " dedupe_key) SELECT 'send', %s, 'failed', 5, now() - interval '1 minute', 'boom', k"
        " FROM unnest(%s::text[]) AS k",
        (queue, keys),
    )


def _states(conn: psycopg.Connection, schema: str, queue: str) -> dict[str, int]:
    rows = conn.execute(
        f"SELECT state::text, count(*) FROM {schema}.tasks WHERE queue = %s GROUP BY 1", (queue,)
    ).fetchall()
    return dict(rows)


def test_retry_failed_skips_rows_whose_dedupe_key_is_taken(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """Before, the first conflict raised a unique violation and nothing was retried."""
    _failed(conn, schema, "mail", ["k1", "k2", "k3", None, None, "k4", "k4"])
    conn.execute(  # k1 is queued again, k2 is scheduled
        f"INSERT INTO {schema}.tasks (task, queue, dedupe_key, run_at) VALUES"
        " ('send', 'other', 'k1', now()), ('send', 'other', 'k2', now() + interval '1 hour')"
    )
    common = ["--dsn", pg_dsn, "--schema", schema]
    r = run_cli("retry", "--failed", "--queue", "mail", *common)
    assert r.returncode == 0, r.stderr
    # k3, two without a key, and one of the two k4: the other k4 would take the same key.
    assert "requeued 4 failed task(s)" in r.stdout
    assert "skipped 3 whose dedupe key a scheduled, queued or running task holds" in r.stdout
    assert _states(conn, schema, "mail") == {"queued": 4, "failed": 3}
    kept = conn.execute(
        f"SELECT dedupe_key FROM {schema}.tasks WHERE queue = 'mail' AND state = 'failed'"
        " ORDER BY dedupe_key"
    ).fetchall()
    assert [k for (k,) in kept] == ["k1", "k2", "k4"]

    # Again, with --json: nothing left to retry; the same three are reported, by id.
    r = run_cli("retry", "--failed", "--queue", "mail", "--json", *common)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["requeued"] == 0 and out["skipped"] == {"dedupe_key_taken": 3}
    ids = conn.execute(
        f"SELECT id FROM {schema}.tasks WHERE queue = 'mail' AND state = 'failed' ORDER BY id"
    ).fetchall()
    assert out["skipped_ids"] == [i for (i,) in ids]


def test_retry_failed_goes_through_every_batch_of_every_queue(
    conn: psycopg.Connection, schema: str
) -> None:
    _failed(conn, schema, "a", [None] * 5 + ["x"])
    _failed(conn, schema, "b", [None] * 4 + ["x"])
    # A failure without finished_at (set by hand) is retried too.
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, state, attempts)"
        " VALUES ('send', 'b', 'failed', 1)"
    )
    done = _bulk.retry_failed(conn, schema, None, batch=2)
    assert (done.requeued, done.skipped) == (11, 1)
    # The older failure holding "x" (in a) went back first; the one in b stays failed.
    assert _states(conn, schema, "a") == {"queued": 6}
    assert _states(conn, schema, "b") == {"queued": 5, "failed": 1}


def test_retry_failed_does_not_retry_what_fails_again_meanwhile(
    conn: psycopg.Connection, schema: str
) -> None:
    """Only failures from before the command started: a task that fails again during a long
    retry is not retried a second time by it."""
    _failed(conn, schema, "a", [None] * 3)
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, state, attempts, finished_at)"
        " VALUES ('send', 'a', 'failed', 5, now() + interval '1 hour')"
    )
    done = _bulk.retry_failed(conn, schema, "a", batch=1)
    assert done.requeued == 3
    assert _states(conn, schema, "a") == {"queued": 3, "failed": 1}


def test_retry_one_task_whose_key_is_taken_says_why(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    _failed(conn, schema, "mail", ["k1"])
    conn.execute(f"INSERT INTO {schema}.tasks (task, queue, dedupe_key) VALUES ('send', 'x', 'k1')")
    (task_id,) = conn.execute(
        f"SELECT id FROM {schema}.tasks WHERE state = 'failed'"
    ).fetchone() or (0,)
    r = run_cli("retry", str(task_id), "--dsn", pg_dsn, "--schema", schema)
    assert r.returncode == 1
    assert "its dedupe key is held by a scheduled, queued or running task" in r.stderr


def test_a_scheduled_task_can_be_cancelled(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    common = ["--dsn", pg_dsn, "--schema", schema]
    r = run_cli("enqueue", "send", "--queue", "mail", "--delay", "3600", *common)
    task_id = int(r.stdout)
    row = conn.execute(f"SELECT state::text FROM {schema}.tasks WHERE id = %s", (task_id,))
    assert row.fetchone() == ("scheduled",)
    assert run_cli("cancel", str(task_id), *common).returncode == 0
    row = conn.execute(f"SELECT state::text FROM {schema}.tasks WHERE id = %s", (task_id,))
    assert row.fetchone() == ("cancelled",)
    again = run_cli("cancel", str(task_id), *common)
    assert again.returncode == 1
    assert "was not cancelled: it is cancelled already" in again.stderr
