"""The `worker` command as a user meets it: real processes, real database, one-line errors."""

from __future__ import annotations

import json
import signal

import psycopg
import pytest
from conftest import run_cli, spawn_cli, states, wait_until


def _one_line_error(r, code: int = 2) -> str:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    return lines[0]


def test_unreachable_database_is_one_line_without_the_password() -> None:
    r = run_cli("status", "--dsn", "postgresql://app:s3cret-pw@127.0.0.1:1/nodb")
    line = _one_line_error(r, 4)  # cannot reach the database
    assert "cannot connect to the database" in line
    assert "s3cret-pw" not in r.stderr + r.stdout
    assert "app:***@127.0.0.1:1" in line


def test_malformed_dsn_is_one_line() -> None:
    line = _one_line_error(run_cli("status", "--dsn", "host=localhost port='"))
    assert "the DSN given by --dsn cannot be parsed" in line


def test_missing_schema_says_to_migrate(pg_dsn: str) -> None:
    line = _one_line_error(run_cli("status", "--dsn", pg_dsn, "--schema", "never_migrated"))
    assert "worker migrate" in line


def test_bad_module_path_is_one_line(pg_dsn: str, schema: str) -> None:
    line = _one_line_error(
        run_cli("run", "no_such_module_xyz", "--dsn", pg_dsn, "--schema", schema)
    )
    assert "cannot import module 'no_such_module_xyz'" in line


def test_module_that_crashes_on_import_is_one_line(tmp_path, pg_dsn: str, schema: str) -> None:
    bad = tmp_path / "crashes.py"
    bad.write_text("raise RuntimeError('config missing')\n")
    line = _one_line_error(run_cli("run", str(bad), "--dsn", pg_dsn, "--schema", schema))
    assert "RuntimeError: config missing" in line


def test_module_without_tasks_is_one_line(tmp_path, pg_dsn: str, schema: str) -> None:
    empty = tmp_path / "empty_tasks.py"
    empty.write_text("X = 1\n")
    line = _one_line_error(run_cli("run", str(empty), "--dsn", pg_dsn, "--schema", schema))
    assert "registered no tasks" in line


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--payload", "{not json"], "--payload is not valid JSON"),
        (["--run-at", "tomorrow"], "--run-at is not an ISO timestamp"),
        (["--run-at", "2030-01-01T00:00:00"], "needs a time zone"),
    ],
)
def test_enqueue_bad_input_is_one_line_and_writes_nothing(
    pg_dsn: str, schema: str, conn: psycopg.Connection, args: list[str], match: str
) -> None:
    line = _one_line_error(run_cli("enqueue", "job", *args, "--dsn", pg_dsn, "--schema", schema))
    assert match in line
    assert conn.execute(f"SELECT count(*) FROM {schema}.tasks").fetchone()[0] == 0


def test_bad_flag_values_are_rejected(pg_dsn: str, schema: str) -> None:
    r = run_cli("run", "tasks_module", "--concurrency", "0", "--dsn", pg_dsn, "--schema", schema)
    assert r.returncode == 2 and "expected 1 to 1000" in r.stderr


def test_enqueue_status_cancel_retry_round_trip(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    common = ["--dsn", pg_dsn, "--schema", schema]
    r = run_cli("enqueue", "record", "--payload", '{"a": 1}', "--priority", "3", "--json", *common)
    assert r.returncode == 0, r.stderr
    task_id = json.loads(r.stdout)["id"]
    r = run_cli("enqueue", "boom", "--queue", "mail", "--delay", "3600", *common)
    delayed_id = int(r.stdout)

    status = json.loads(run_cli("status", "--json", *common).stdout)
    by_queue = {q["queue"]: q for q in status["queues"]}
    assert by_queue["default"]["counts"]["queued"] == 1
    assert by_queue["mail"]["delayed"] == 1

    assert run_cli("cancel", str(delayed_id), *common).returncode == 0
    again = run_cli("cancel", str(delayed_id), *common)
    assert again.returncode == 1 and "it is cancelled" in again.stderr

    conn.execute(
        f"UPDATE {schema}.tasks SET state = 'failed', attempts = 5,"
        " last_error = 'ValueError: x' WHERE id = %s",
        (task_id,),
    )
    text = run_cli("status", *common).stdout
    assert "recent failed tasks" in text and "ValueError: x" in text
    assert run_cli("retry", str(task_id), *common).returncode == 0
    row = conn.execute(
        f"SELECT state::text, attempts FROM {schema}.tasks WHERE id = %s", (task_id,)
    ).fetchone()
    assert row == ("queued", 0)
    conn.execute(f"UPDATE {schema}.tasks SET state = 'failed' WHERE id = %s", (task_id,))
    r = run_cli("retry", "--failed", *common)
    assert r.returncode == 0 and "requeued 1" in r.stdout


def test_dsn_command_prints_the_configured_dsn(pg_dsn: str) -> None:
    r = run_cli("dsn", env={"WORKER_DSN": pg_dsn})
    assert r.returncode == 0 and r.stdout.strip() == pg_dsn


def _executions_table(conn: psycopg.Connection, schema: str) -> None:
    conn.execute(
        f"CREATE TABLE {schema}.executions (task_id bigint, attempt int, pid int,"
        " started timestamptz, finished timestamptz)"
    )


def test_run_burst_processes_everything_then_exits(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    _executions_table(conn, schema)
    conn.execute(f"INSERT INTO {schema}.tasks (task) SELECT 'record' FROM generate_series(1, 300)")
    r = run_cli(
        "run",
        "tasks_module",
        "--burst",
        "--processes",
        "1",
        "--dsn",
        pg_dsn,
        "--schema",
        schema,
        env={"WORKER_DSN": pg_dsn, "WORKER_SCHEMA": schema},
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert states(conn, schema) == {"done": 300}


def test_sigterm_stops_a_worker_gracefully(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    _executions_table(conn, schema)
    proc = spawn_cli(
        "run",
        "tasks_module",
        "--processes",
        "1",
        "--dsn",
        pg_dsn,
        "--schema",
        schema,
        "--grace",
        "10",
        env={"WORKER_DSN": pg_dsn, "WORKER_SCHEMA": schema},
    )
    try:
        wait_until(lambda: conn.execute(f"SELECT count(*) FROM {schema}.workers").fetchone()[0])
        conn.execute(
            f"INSERT INTO {schema}.tasks (task, payload) VALUES ('slow', '{{\"sleep\": 1}}')"
        )
        wait_until(lambda: states(conn, schema).get("in_progress") == 1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert states(conn, schema) == {"done": 1}


def test_two_worker_processes_share_the_work_and_never_run_a_task_twice(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """Thousands of tasks, two processes: every task runs exactly once, both processes take
    part, and no task ever has two overlapping executions."""
    _executions_table(conn, schema)
    n = 4000
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, payload) SELECT 'record',"
        " jsonb_build_object('sleep', 0.001) FROM generate_series(1, %s)",
        (n,),
    )
    env = {"WORKER_DSN": pg_dsn, "WORKER_SCHEMA": schema}
    args = [
        "run",
        "tasks_module",
        "--processes",
        "1",
        "--concurrency",
        "8",
        "--batch-size",
        "20",
        "--dsn",
        pg_dsn,
        "--schema",
        schema,
    ]
    procs = [spawn_cli(*args, env=env) for _ in range(2)]
    try:
        wait_until(lambda: states(conn, schema) == {"done": n}, timeout=120, interval=0.2)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=30)
    total, distinct, pids = conn.execute(
        f"SELECT count(*), count(DISTINCT task_id), count(DISTINCT pid) FROM {schema}.executions"
    ).fetchone()
    assert (total, distinct) == (n, n)
    assert pids == 2
    overlaps = conn.execute(
        f"SELECT count(*) FROM {schema}.executions a JOIN {schema}.executions b"
        " ON a.task_id = b.task_id AND a.ctid < b.ctid"
        " AND tstzrange(a.started, a.finished) && tstzrange(b.started, b.finished)"
    ).fetchone()[0]
    assert overlaps == 0


def test_demo_says_settled_only_when_its_retries_have_run(
    pg_dsn: str, conn: psycopg.Connection, schema: str
) -> None:
    """The demo's first attempts fail on purpose and retry after a backoff, as scheduled rows:
    "settled" must wait for them, so the table then holds done rows and the one bad address."""
    r = run_cli("demo", "--dsn", pg_dsn, "--schema", schema, "--tasks", "300", timeout=120)
    assert r.returncode == 0, r.stderr
    assert "settled" in r.stdout
    assert states(conn, schema) == {"done": 299, "failed": 1}
