"""Pausing a queue (issue 12): fleet-wide, through the database, from the CLI, SQL, Python and the
metrics. Real worker processes: a pause stops new claims at once, running tasks finish, the pause
survives a restart of the fleet, and a resume starts the backlog within a second."""

from __future__ import annotations

import html
import json
import signal
import subprocess
import time

import psycopg
from conftest import run_cli, spawn_cli, states, wait_until
from test_cli import _executions_table
from test_metrics import fetch, scrape

import worker
from worker.coord import pause as _pause
from worker.monitor.server import serve


def _fleet(pg_dsn: str, schema: str) -> subprocess.Popen[str]:
    return spawn_cli(
        "run",
        "tasks_module",
        "--processes",
        "2",
        "--dsn",
        pg_dsn,
        "--schema",
        schema,
        "--poll-interval",
        "5",  # a resume must not wait for the poll: it notifies
        env={"WORKER_DSN": pg_dsn, "WORKER_SCHEMA": schema},
    )


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _alive(conn: psycopg.Connection, schema: str) -> int:
    return conn.execute(f"SELECT count(*) FROM {schema}.workers").fetchone()[0]


def _enqueue(conn: psycopg.Connection, schema: str, n: int, sleep: float = 0.0) -> None:
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, payload) SELECT 'record', 'default',"
        " jsonb_build_object('sleep', %s::float8) FROM generate_series(1, %s)",
        (sleep, n),
    )


def test_a_pause_stops_claims_fleet_wide_lets_running_tasks_finish_and_survives_restarts(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    _executions_table(conn, schema)
    proc = _fleet(pg_dsn, schema)
    try:
        wait_until(lambda: _alive(conn, schema) >= 2)
        _enqueue(conn, schema, 1, sleep=3.0)  # running when the pause comes
        wait_until(lambda: states(conn, schema).get("in_progress") == 1)
        r = run_cli("pause", "default", "--dsn", pg_dsn, "--schema", schema, "--by", "ops-anna")
        assert r.returncode == 0, r.stderr
        assert "paused queue default" in r.stdout
        _enqueue(conn, schema, 20)
        time.sleep(4.0)  # the running task's 3 s are over; nothing new may have started
        assert states(conn, schema) == {"done": 1, "queued": 20}
        # `worker status`, human and JSON, says so.
        r = run_cli("status", "--dsn", pg_dsn, "--schema", schema)
        assert r.returncode == 0, r.stderr
        assert "default (paused)" in r.stdout and "by ops-anna" in r.stdout
        r = run_cli("status", "--dsn", pg_dsn, "--schema", schema, "--json")
        assert [p["queue"] for p in json.loads(r.stdout)["paused"]] == ["default"]
        _stop(proc)
        proc = _fleet(pg_dsn, schema)  # a new fleet reads the same pause
        wait_until(
            lambda: (
                conn.execute(
                    f"SELECT count(*) FROM {schema}.workers WHERE stopped_at IS NULL"
                    " AND heartbeat_at > now() - interval '5 seconds'"
                ).fetchone()[0]
                >= 2
            )
        )
        time.sleep(2.0)
        assert states(conn, schema) == {"done": 1, "queued": 20}
        before = conn.execute("SELECT clock_timestamp()").fetchone()[0]
        assert _pause.resume(conn, schema, "default") is True
        wait_until(lambda: states(conn, schema) == {"done": 21}, timeout=30)
        first = conn.execute(
            f"SELECT min(started) FROM {schema}.executions WHERE started >= %s", (before,)
        ).fetchone()[0]
        # The backlog started within a second of the resume, not at the next poll (5 s).
        assert (first - before).total_seconds() < 1.0, first - before
    finally:
        _stop(proc)


def test_pause_and_resume_from_sql_and_python(conn: psycopg.Connection, schema: str) -> None:
    assert conn.execute(f"SELECT {schema}.pause_queue('mail', 'dba')").fetchone()[0] is True
    assert conn.execute(f"SELECT {schema}.pause_queue('mail')").fetchone()[0] is False
    [p] = _pause.paused(conn, schema)
    assert (p.queue, p.paused_by) == ("mail", "dba")  # the first pause stands
    assert _pause.resume(conn, schema, "mail") is True
    assert _pause.resume(conn, schema, "mail") is False
    assert worker.pause_queue(conn, "mail", by="py", schema=schema) is True
    assert [p.queue for p in worker.paused_queues(conn, schema=schema)] == ["mail"]
    assert conn.execute(f"SELECT {schema}.resume_queue('mail')").fetchone()[0] is True
    assert _pause.paused(conn, schema) == []
    try:
        conn.execute(f"SELECT {schema}.pause_queue('')")
    except psycopg.errors.InvalidParameterValue as exc:
        assert "1 to 255 characters" in str(exc)
    else:
        raise AssertionError("an empty queue name was accepted")


def test_cli_pause_refuses_bad_names_and_resume_of_an_unpaused_queue(
    pg_dsn: str, schema: str
) -> None:
    r = run_cli("pause", "", "--dsn", pg_dsn, "--schema", schema)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = run_cli("pause", "x" * 256, "--dsn", pg_dsn, "--schema", schema)
    assert r.returncode == 2 and "1 to 255" in r.stderr
    r = run_cli("resume", "never-paused", "--dsn", pg_dsn, "--schema", schema)
    assert r.returncode == 1 and r.stderr.strip().endswith("is not paused"), r.stderr
    assert run_cli("pause", "q1", "--dsn", pg_dsn, "--schema", schema).returncode == 0
    r = run_cli("pause", "q1", "--dsn", pg_dsn, "--schema", schema)
    assert r.returncode == 0 and "was paused already" in r.stdout
    r = run_cli("resume", "q1", "--dsn", pg_dsn, "--schema", schema)
    assert r.returncode == 0 and "resumed queue q1" in r.stdout


def test_paused_queues_show_on_the_status_page_and_in_metrics(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """A hostile queue name is paused: the page lists it escaped, /metrics has one series."""
    name = '<b id="x">mail</b>'
    _pause.pause(conn, schema, name, "ops")
    server = serve("127.0.0.1", 0, dsn=pg_dsn, schema=schema, ttl=0)
    try:
        status, body = fetch(server.url)
        assert status == 200
        assert "Paused queues" in body and html.escape(name) in body and name not in body
        samples = scrape(server.url.rstrip("/") + "/metrics")
        paused = {
            dict(labels)["queue"]: v
            for (n, labels), v in samples.items()
            if n == "worker_queue_paused"
        }
        assert paused == {name: 1.0}
        _pause.resume(conn, schema, name)
        samples = scrape(server.url.rstrip("/") + "/metrics")
        assert not [k for k in samples if k[0] == "worker_queue_paused"]
    finally:
        server.stop()


# -- a queue nothing has named --------------------------------------------------------------------


def test_pausing_a_queue_nothing_has_named_pauses_it_and_warns_with_the_known_queues(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """`worker pause typo_queue` reported success silently. It still pauses (an operator may
    pause ahead of a deploy), and says on stderr, in one line, that no task, worker, limit,
    pause or action has named the queue, with the known queues (the likeliest first)."""
    common = ["--dsn", pg_dsn, "--schema", schema]
    conn.execute(f"INSERT INTO {schema}.tasks (task, queue) VALUES ('t', 'mail'), ('t', 'zz')")
    conn.execute(f"INSERT INTO {schema}.task_routes (task, queue) VALUES ('r', 'reports')")
    conn.execute(f"SELECT {schema}.set_queue_limit('limited', concurrency => 1)")
    r = run_cli("pause", "maill", *common)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "paused queue maill: workers claim nothing from it until resumed\n"
    assert r.stderr.splitlines() == [
        "worker: warning: no task, worker, limit, pause or recent action has named queue "
        "'maill': paused it all the same (for tasks still to come); did you mean 'mail'? "
        "known queues: 'mail', 'limited', 'reports', 'zz'"
    ]
    assert [p.queue for p in _pause.paused(conn, schema)] == ["maill"]
    r = run_cli("pause", "maill", "--json", *common)  # paused before: named now
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert json.loads(r.stdout) == {"queue": "maill", "paused": True, "changed": False,
                                    "known": True}  # fmt: skip
    # Resumed, it is still known: the record of actions names it.
    assert run_cli("resume", "maill", *common).returncode == 0
    r = run_cli("pause", "maill", *common)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    rows = conn.execute(
        f"SELECT action, filter, counts, source FROM {schema}.actions ORDER BY id"
    ).fetchall()
    assert rows == [
        ("pause", {"queue": "maill"}, {"changed": 1}, "cli"),
        ("pause", {"queue": "maill"}, {"changed": 0}, "cli"),
        ("resume", {"queue": "maill"}, {"changed": 1}, "cli"),
        ("pause", {"queue": "maill"}, {"changed": 1}, "cli"),
    ]


def test_pausing_a_known_queue_says_nothing_more(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """Known from any of: a waiting, running or failed task, a recently finished one, a
    worker's route, a registered worker, a limit."""
    common = ["--dsn", pg_dsn, "--schema", schema]
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, state, attempts, finished_at) VALUES"
        " ('t', 'q_queued', 'queued', 0, NULL), ('t', 'q_failed', 'failed', 1, now()),"
        " ('t', 'q_done', 'done', 1, now()), ('t', 'q_cancelled', 'cancelled', 0, now())"
    )
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, run_at) VALUES"
        " ('t', 'q_scheduled', now() + interval '1 hour')"
    )
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, state, attempts, worker_id,"
        " lease_expires_at) VALUES ('t', 'q_running', 'in_progress', 1, gen_random_uuid(),"
        " now() + interval '1 minute')"
    )
    conn.execute(f"INSERT INTO {schema}.task_routes (task, queue) VALUES ('r', 'q_route')")
    conn.execute(
        f"INSERT INTO {schema}.workers (id, host, pid, queues, concurrency)"
        " VALUES (gen_random_uuid(), 'box', 1, ARRAY['q_worker'], 4)"
    )
    conn.execute(f"SELECT {schema}.set_queue_limit('q_limit', rate => 5)")
    for queue in ("q_queued", "q_scheduled", "q_running", "q_failed", "q_done", "q_cancelled",
                  "q_route", "q_worker", "q_limit"):  # fmt: skip
        r = run_cli("pause", queue, *common)
        assert r.returncode == 0 and r.stderr == "", (queue, r.stderr)
        assert r.stdout.startswith(f"paused queue {queue}:"), r.stdout
    assert run_cli("pause", "q_unheard", *common).stderr.startswith("worker: warning: ")
    # On a schema with no queue at all, the warning says so.
    conn.execute(f"DELETE FROM {schema}.tasks; DELETE FROM {schema}.task_routes;"
                 f" DELETE FROM {schema}.workers; DELETE FROM {schema}.queue_limits;"
                 f" DELETE FROM {schema}.paused_queues; DELETE FROM {schema}.actions")  # fmt: skip
    r = run_cli("pause", "first", *common)
    assert r.returncode == 0 and r.stderr.rstrip().endswith("no queue is known yet"), r.stderr
