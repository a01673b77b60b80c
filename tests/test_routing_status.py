"""Work that no live worker will do shows up: a queue that holds due tasks but that no live worker
serves, and a task that no live worker has a handler for (rows handed back, or waiting in a queue),
in `worker status` (human and --json), on the status page and in the metrics. And `worker run
--queues` warns about a queue that none of the module's tasks uses."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from conftest import run_cli, wait_until
from test_metrics import fetch

from worker.monitor.metrics.collector import DatabaseCollector
from worker.monitor.readmodel import Database
from worker.monitor.server import serve
from worker.tasks.registry import Registry


def _live_worker(
    conn: psycopg.Connection, schema: str, queues: list[str], tasks: list[str]
) -> None:
    conn.execute(
        f"INSERT INTO {schema}.workers (id, host, pid, queues, concurrency, tasks)"
        " VALUES (gen_random_uuid(), 'box-1', 4242, %s, 4, %s)",
        (queues, tasks),
    )


def _gauges(dsn: str, schema: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    db = Database(dsn, schema, ttl=0)
    try:
        out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        for family in DatabaseCollector(db).collect():
            for s in family.samples:
                out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
        return out
    finally:
        db.close()


@pytest.fixture
def misrouted(conn: psycopg.Connection, schema: str) -> Iterator[str]:
    """A live worker serves 'mail' and runs 'send'; three 'send' tasks went to 'mial' (a typo),
    and two tasks of a name nobody runs wait there too."""
    _live_worker(conn, schema, ["mail"], ["send"])
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue) SELECT 'send', 'mial' FROM generate_series(1, 3)"
    )
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue) SELECT 'sned', 'mial' FROM generate_series(1, 2)"
    )
    conn.execute(f"INSERT INTO {schema}.tasks (task, queue) VALUES ('send', 'mail')")
    yield schema


def test_status_names_a_queue_nobody_serves(pg_dsn: str, misrouted: str) -> None:
    common = ["--dsn", pg_dsn, "--schema", misrouted]
    r = run_cli("status", "--json", *common)
    assert r.returncode == 0, r.stderr
    routing = json.loads(r.stdout)["routing"]
    assert routing["workers_alive"] == 1
    assert routing["unserved_queues"] == [{"queue": "mial", "waiting": 5, "capped": False}]
    line = (
        "no live worker serves queue 'mial' (5 task(s) waiting): start one with --queues 'mial'"
        " or check the name"
    )
    assert line in routing["advice"]
    # The tasks in that queue that no live worker has a handler for, from the sample.
    missing = [m for m in routing["missing_handlers"] if m["kind"] == "queued"]
    assert missing == [
        {"kind": "queued", "task": "sned", "queue": "mial", "count": 2, "capped": False}
    ]
    queues = {q["queue"]: q for q in json.loads(r.stdout)["queues"]}
    assert queues["mial"]["served"] is False and queues["mail"]["served"] is True

    text = run_cli("status", *common).stdout
    assert "work no live worker will do" in text
    assert line in text
    assert "task 'sned' has no handler in any live worker (2 of all queued in queue 'mial')" in text


def test_a_queue_nobody_serves_is_a_metric_and_on_the_page(pg_dsn: str, misrouted: str) -> None:
    g = _gauges(pg_dsn, misrouted)
    assert g["worker_queue_unserved_tasks"][(("queue", "mial"),)] == 5
    assert g["worker_queue_unserved_tasks"][(("queue", "mail"),)] == 0
    assert g["worker_unserved_queues"][()] == 1
    assert g["worker_tasks_without_handler"][(("task", "sned"),)] == 2
    assert (("task", "send"),) not in g["worker_tasks_without_handler"]

    server = serve("127.0.0.1", 0, dsn=pg_dsn, schema=misrouted, ttl=0)
    try:
        status, body = fetch(server.url)
    finally:
        server.stop()
    assert status == 200
    assert "no live worker serves queue &#x27;mial&#x27; (5 task(s) waiting)" in body


def test_without_any_live_worker_status_says_so(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    conn.execute(f"INSERT INTO {schema}.tasks (task, queue) VALUES ('send', 'mail')")
    # A worker that stopped, and one whose heartbeat is long gone, are not live.
    _live_worker(conn, schema, ["mail"], ["send"])
    conn.execute(f"UPDATE {schema}.workers SET heartbeat_at = now() - interval '10 minutes'")
    r = run_cli("status", "--dsn", pg_dsn, "--schema", schema)
    assert r.returncode == 0, r.stderr
    assert "no live worker at all: 1 queue(s) hold 1 due task(s)" in r.stdout
    assert "no live worker serves queue 'mail' (1 task(s) waiting)" in r.stdout


def test_a_handed_back_task_waits_for_a_handler(
    pg_dsn: str,
    schema: str,
    conn: psycopg.Connection,
    thread_worker: Callable[..., Any],
) -> None:
    """A worker without the handler hands the row back (schema/0006); status, the metrics and
    the page say which task waits for a handler, and where."""
    tasks = Registry()

    @tasks.task("known", queue="jobs")
    def known(payload: dict) -> None:
        pass

    conn.execute(f"INSERT INTO {schema}.tasks (task, queue) VALUES ('ghost.task', 'jobs')")
    with thread_worker(tasks, queues=["jobs"]):
        wait_until(
            lambda: (
                conn.execute(
                    f"SELECT handed_back > 0 AND state = 'scheduled' FROM {schema}.tasks"
                    " WHERE task = 'ghost.task'"
                ).fetchone()
                == (True,)
            )
        )
        r = run_cli("status", "--json", "--dsn", pg_dsn, "--schema", schema)
        text = run_cli("status", "--dsn", pg_dsn, "--schema", schema).stdout
        g = _gauges(pg_dsn, schema)
    assert r.returncode == 0, r.stderr
    routing = json.loads(r.stdout)["routing"]
    assert routing["missing_handlers"] == [
        {"kind": "handed_back", "task": "ghost.task", "queue": "jobs", "count": 1, "capped": False}
    ]
    assert routing["unserved_queues"] == []
    assert (
        "task 'ghost.task' has no handler in any live worker (1 handed back, waiting in queue"
        " 'jobs'): start a worker whose module registers it, or check the name" in text
    )
    assert g["worker_tasks_without_handler"][(("task", "ghost.task"),)] == 1
    assert g["worker_unserved_queues"][()] == 0


def test_names_in_routing_lines_are_terminal_safe(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    _live_worker(conn, schema, ["mail"], ["send"])
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue) VALUES (%s, %s)",
        ("t\x1b]0;pwned\x07", "q\n\x1b[2J" + "x" * 240),
    )
    r = run_cli("status", "--dsn", pg_dsn, "--schema", schema)
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout
    lines = [line for line in r.stdout.splitlines() if "no live worker serves" in line]
    assert len(lines) == 1 and len(lines[0]) < 300, lines  # the name is cut to 80 characters
    assert "'q\\n\\x1b[2Jxx" in lines[0]  # shown as Python would write it


def test_run_warns_about_a_queue_no_task_uses(pg_dsn: str, schema: str) -> None:
    """One warning line, however many names are unknown (200 would otherwise be 200 lines)."""
    r = run_cli(
        "run",
        "tasks_module",
        "--queues",
        "default,mial," + ",".join(f"q{i}" for i in range(200)),
        "--processes",
        "1",
        "--burst",
        "--dsn",
        pg_dsn,
        "--schema",
        schema,
    )
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stderr.splitlines() if "--queues names" in line]
    assert len(warnings) == 1, r.stderr
    assert "'mial'" in warnings[0] and "check the name" in warnings[0]
    assert "and 196 more" in warnings[0] and len(warnings[0]) < 500, warnings[0]
    assert pg_dsn not in r.stderr
