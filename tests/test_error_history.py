"""Each task keeps the errors of its last attempts (issue 12): column `errors`, appended by the
statements that record an error (retry, hand_back, worker_died, rescue), bounded in entries and
in characters, never touched by claim or complete, returned by get_task and shown by
`worker status --id`."""

from __future__ import annotations

import json
import re
import uuid
from datetime import datetime
from typing import Any

import psycopg
from conftest import every_statement, run_cli, wait_until

import worker
from worker import store as tr
from worker.ops import actions as _actions
from worker.ops import status as _admin

LONG = 5000  # characters of the error each failing attempt raises


def _history(conn: psycopg.Connection, schema: str, task_id: int) -> list[dict[str, Any]]:
    row = conn.execute(f"SELECT errors FROM {schema}.tasks WHERE id = %s", (task_id,)).fetchone()
    assert row is not None
    return row[0] or []


def test_fifteen_failing_attempts_keep_the_newest_ten_each_cut(
    pg_dsn: str, schema: str, conn: psycopg.Connection, thread_worker
) -> None:
    reg = worker.Registry()

    @reg.task("flaky", max_attempts=15, retry_backoff=0.0)
    def flaky(payload: Any, ctx: worker.Context) -> None:
        raise RuntimeError(f"attempt {ctx.attempt} failed " + "x" * LONG)

    task_id = worker.enqueue(conn, "flaky", {}, schema=schema)
    with thread_worker(reg) as w:
        wait_until(
            lambda: (
                conn.execute(
                    f"SELECT state::text FROM {schema}.tasks WHERE id = %s", (task_id,)
                ).fetchone()
                == ("failed",)
            ),
            timeout=60,
        )
        worker_id = w.worker.id
    errors = _history(conn, schema, task_id)
    assert len(errors) == tr.ERROR_HISTORY == 10
    assert [e["attempt"] for e in errors] == list(range(6, 16))  # the newest, oldest first
    for e in errors:
        assert e["error"].startswith(f"RuntimeError: attempt {e['attempt']} failed xxx")
        assert len(e["error"]) == tr.ERROR_HISTORY_CHARS
        assert e["worker_id"] == worker_id
        assert "counted" not in e
    times = [datetime.fromisoformat(e["at"]) for e in errors]
    assert times == sorted(times)
    # last_error still holds the latest error at its own (longer) bound, traceback included.
    task = _admin.get_task(conn, schema, task_id)
    assert task is not None and task["errors"] == errors
    assert task["last_error"].startswith("RuntimeError: attempt 15 failed")
    assert len(task["last_error"]) > tr.ERROR_HISTORY_CHARS

    common = ["--dsn", pg_dsn, "--schema", schema]
    r = run_cli("status", "--id", str(task_id), *common)
    assert r.returncode == 0, r.stderr
    assert "error history (the last 10 attempt(s), oldest first)" in r.stdout
    shown = re.findall(r"^  attempt (\d+) ", r.stdout, re.MULTILINE)
    assert shown == [str(n) for n in range(6, 16)]
    out = json.loads(run_cli("status", "--id", str(task_id), "--json", *common).stdout)
    assert [e["attempt"] for e in out["errors"]] == list(range(6, 16))
    missing = run_cli("status", "--id", "999999999", *common)
    assert missing.returncode == 1 and "does not exist" in missing.stderr

    # An operator's retry starts the attempts again; the history stays, and goes on.
    assert _actions.retry(conn, schema, [task_id]).changed == 1
    assert _history(conn, schema, task_id) == errors


def _running(conn: psycopg.Connection, schema: str, worker_id: str, *, expired: bool) -> int:
    row = conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, state, attempts, max_attempts, worker_id,"
        " started_at, lease_expires_at, errors)"
        " VALUES ('t', 'q', 'in_progress', 2, 5, %s, now(), now() + %s * interval '1 hour',"
        " %s) RETURNING id",
        (worker_id, -1 if expired else 1, json.dumps([{"attempt": 1, "error": "old"}])),
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_rescue_worker_died_and_hand_back_append_to_the_history(
    conn: psycopg.Connection, schema: str
) -> None:
    q = every_statement(schema)
    dead, gone, back = (str(uuid.uuid4()) for _ in range(3))
    rescued = _running(conn, schema, dead, expired=True)
    died = _running(conn, schema, gone, expired=False)
    handed = _running(conn, schema, back, expired=False)

    assert [r[0] for r in tr.rescue(conn, q.schema)] == [rescued]
    tr.worker_died(conn, q.schema, worker_id=gone, error="WorkerDied: process 42 died")
    hostile = 'UnknownTask: no handler named "t" \\ %s \n 100% ☃'
    assert tr.hand_back(conn, q.schema, worker_id=back, rows=[(handed, 2, hostile)]) == {
        handed: "scheduled"
    }

    for task_id, owner, text, extra in [
        (rescued, dead, f"LeaseExpired: worker {dead} stopped renewing", {}),
        (died, gone, "WorkerDied: process 42 died during attempt 2", {}),
        (handed, back, hostile, {"counted": False}),
    ]:
        first, entry = _history(conn, schema, task_id)
        assert first == {"attempt": 1, "error": "old"}
        assert entry["error"].startswith(text), entry
        assert (entry["attempt"], entry["worker_id"]) == (2, owner)
        assert {k: entry[k] for k in extra} == extra
        last = conn.execute(f"SELECT last_error FROM {schema}.tasks WHERE id = %s", (task_id,))
        assert last.fetchone() == (entry["error"],)


def test_claim_and_complete_leave_the_history_alone(
    conn: psycopg.Connection, schema: str, thread_worker
) -> None:
    """The history is written only when an attempt fails: the statements of the due path do not
    name the column, and a task that fails once then succeeds keeps its one error."""
    text = {name: every_statement(schema)[name].as_string(conn) for name in ("claim", "complete")}
    for name, statement in text.items():
        assert "errors" not in statement, name
    reg = worker.Registry()
    calls: list[int] = []

    @reg.task("once", retry_backoff=0.0)
    def once(payload: Any, ctx: worker.Context) -> None:
        calls.append(ctx.attempt)
        if ctx.attempt == 1:
            raise ValueError("first time")

    task_id = worker.enqueue(conn, "once", {}, schema=schema)
    with thread_worker(reg):
        wait_until(
            lambda: (
                conn.execute(
                    f"SELECT state::text FROM {schema}.tasks WHERE id = %s", (task_id,)
                ).fetchone()
                == ("done",)
            )
        )
    [entry] = _history(conn, schema, task_id)
    assert entry["attempt"] == 1 and entry["error"].startswith("ValueError: first time")
    assert calls == [1, 2]
