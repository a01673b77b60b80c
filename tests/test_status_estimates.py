"""Counts past the cap in `worker status` and on the status page: a state with no rows shows 0,
never the planner's floor of one row (`cancelled ≈1` with nothing cancelled), while a state the
newest finished rows miss but the planner sees still shows its estimate."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import psycopg
import pytest
from conftest import run_cli
from test_metrics import fetch
from test_status_page import parse

from worker.monitor.server import MetricsServer, serve
from worker.ops.status import STATUS_CAP

STATES = ("waiting", "scheduled", "queued", "in progress", "done", "failed", "cancelled")


@pytest.fixture
def finished(schema: str, conn: psycopg.Connection) -> str:
    """More done rows than the cap in queue 'busy', none cancelled anywhere but in queue 'old',
    whose 3,000 cancelled rows are older than the newest 10,000 finished ones: counted among
    those, 'old' has none, though the planner sees them."""
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, state, attempts, finished_at)"
        " SELECT 'job', 'old', 'cancelled', 0, now() - interval '50 minutes'"
        " FROM generate_series(1, 3000)"
    )
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, state, attempts, finished_at)"
        " SELECT 'job', 'busy', 'done', 1, now() - interval '1 minute'"
        " FROM generate_series(1, %s)",
        (STATUS_CAP + 5000,),
    )
    # One due task each, so that both queues are listed.
    conn.execute(f"INSERT INTO {schema}.tasks (task, queue) VALUES ('job', 'busy'), ('job', 'old')")
    conn.execute(f"ANALYZE {schema}.tasks")
    return schema


def _cells(out: str, queue: str) -> dict[str, str]:
    """The status table's row of ``queue``, by its header's column names (the waiting column is
    shown only where workflow steps wait)."""
    lines = out.splitlines()
    head = re.split(r"\s{2,}", lines[0].strip())
    line = next(x for x in lines if re.match(rf"{queue}\s", x))
    cells = dict(zip(head, re.split(r"\s{2,}", line.strip()), strict=True))
    cells.setdefault("waiting", "0")  # the one column shown only when not all 0
    return {s: cells[s] for s in STATES}


def test_status_shows_0_for_a_state_with_no_rows_past_the_cap(pg_dsn: str, finished: str) -> None:
    r = run_cli("status", "--dsn", pg_dsn, "--schema", finished)
    assert r.returncode == 0, r.stderr
    busy = _cells(r.stdout, "busy")
    assert busy["done"].startswith("≈"), r.stdout  # past the cap: the estimate
    assert busy["cancelled"] == "0", r.stdout  # none: not the planner's "≈1"
    assert busy["queued"] == "1"
    old = _cells(r.stdout, "old")
    assert old["done"] == "0", r.stdout
    # Not among the newest finished rows, but the planner sees them: an estimate, not 0.
    assert old["cancelled"].startswith("≈"), r.stdout
    assert 1000 < int(old["cancelled"][1:].replace(",", "")) < 9000

    st = json.loads(run_cli("status", "--dsn", pg_dsn, "--schema", finished, "--json").stdout)
    by_queue = {q["queue"]: q for q in st["queues"]}
    assert by_queue["busy"]["counts"]["cancelled"] == 0
    assert "cancelled" not in by_queue["busy"]["capped"]
    assert "cancelled" not in by_queue["busy"]["estimates"]
    assert "done" in by_queue["busy"]["capped"]


@pytest.fixture
def page_server(pg_dsn: str, finished: str) -> Iterator[MetricsServer]:
    server = serve("127.0.0.1", 0, dsn=pg_dsn, schema=finished, ttl=0)
    yield server
    server.stop()


def test_the_status_page_shows_0_for_a_state_with_no_rows_past_the_cap(
    page_server: MetricsServer,
) -> None:
    status, body = fetch(page_server.url)
    assert status == 200
    page = parse(body)
    assert page.queues["busy"]["done"].startswith("≈"), page.queues
    assert page.queues["busy"]["cancelled"] == "0", page.queues
    assert page.queues["old"]["done"] == "0", page.queues
    assert page.queues["old"]["cancelled"].startswith("≈"), page.queues


def test_done_tasks_in_the_history_are_estimated_past_the_cap(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """A worker that keeps a history (--keep-history) moves its done tasks out of the task
    table: past the cap, status estimates them from the history's statistics too, instead of
    showing only the cap (`≥10,000` for 25,000 done tasks)."""
    n = STATUS_CAP + 15000
    conn.execute(
        f"INSERT INTO {schema}.task_history (id, task, queue, state, attempts, finished_at, slot)"
        f" SELECT nextval(pg_get_serial_sequence('{schema}.tasks', 'id')), 'job', 'kept',"
        "        'done', 1, now() - interval '1 minute',"
        f"        (SELECT slot FROM {schema}.history_slots WHERE state = 'current')"
        " FROM generate_series(1, %s)",
        (n,),
    )
    conn.execute(f"INSERT INTO {schema}.tasks (task, queue) VALUES ('job', 'kept')")
    conn.execute(f"ANALYZE {schema}.task_history")
    conn.execute(f"ANALYZE {schema}.tasks")
    r = run_cli("status", "--dsn", pg_dsn, "--schema", schema)
    assert r.returncode == 0, r.stderr
    kept = _cells(r.stdout, "kept")
    assert kept["done"].startswith("≈"), r.stdout
    assert 0.8 * n < int(kept["done"][1:].replace(",", "")) < 1.2 * n, r.stdout
    assert kept["queued"] == "1" and kept["cancelled"] == "0", r.stdout

    st = json.loads(run_cli("status", "--dsn", pg_dsn, "--schema", schema, "--json").stdout)
    q = {x["queue"]: x for x in st["queues"]}["kept"]
    assert "done" in q["capped"]
    assert 0.8 * n < q["estimates"]["done"] < 1.2 * n, q
