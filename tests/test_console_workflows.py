"""Workflows in the console and wherever states are listed, without a browser: a workflow's page
reads a bounded number of rows whatever its size (a workflow of 100,000 steps shows 200 a page,
counted by state in one aggregate, and a join of 99,999 inputs lists ten of them), its actions
are refused without a session and its CSRF token, and `waiting` is a state of the job browser's
filter, of the overview's counts and of `worker status`. The page in a browser, with real
workers, is in tests/test_console_ui.py."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from conftest import run_cli
from test_console_http import TOKEN, origin, request, signed_in
from test_status_page import parse

import worker
from worker.db.sql import queries
from worker.monitor.console import data as console_data
from worker.monitor.console.data import SQL_DIR
from worker.monitor.server import MetricsServer, serve

BIG = 100_000


@pytest.fixture
def armed(pg_dsn: str, schema: str) -> Iterator[MetricsServer]:
    server = serve("127.0.0.1", 0, dsn=pg_dsn, schema=schema, ttl=0, console_token=TOKEN)
    yield server
    server.stop()


def _small(conn: psycopg.Connection, schema: str) -> tuple[int, dict[str, int]]:
    """A chain a -> b -> c in queue 'flows': a failed, b and c cancelled by its failure."""
    (wf,) = conn.execute(
        f"INSERT INTO {schema}.workflows (name) VALUES ('nightly') RETURNING id"
    ).fetchone()
    ids = {}
    for key in ("a", "b", "c"):
        (ids[key],) = conn.execute(
            f"INSERT INTO {schema}.tasks (task, queue, workflow_id) VALUES (%s, 'flows', %s)"
            " RETURNING id",
            (f"wf.{key}", wf),
        ).fetchone()
    conn.execute(
        f"INSERT INTO {schema}.task_deps (task_id, depends_on) VALUES (%s, %s), (%s, %s)",
        (ids["b"], ids["a"], ids["c"], ids["b"]),
    )
    return wf, ids


def _state(conn: psycopg.Connection, schema: str) -> Any:
    return (
        conn.execute(f"SELECT id, state::text FROM {schema}.tasks ORDER BY id").fetchall(),
        conn.execute(f"SELECT count(*) FROM {schema}.actions").fetchall(),
    )


def test_waiting_is_a_state_of_the_filter_the_overview_and_worker_status(
    armed: MetricsServer, pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    wf, ids = _small(conn, schema)
    waiting = conn.execute(
        f"SELECT id FROM {schema}.tasks WHERE state = 'waiting' ORDER BY id"
    ).fetchall()
    assert [r[0] for r in waiting] == [ids["b"], ids["c"]]
    # The job browser: a state of its filter, and its rows.
    page = request(armed, "GET", "/console/jobs")[2]
    assert '<option value="waiting">waiting</option>' in page
    page = request(armed, "GET", "/console/jobs?state=waiting")[2]
    assert "state ignored" not in page
    listed = re.findall(r'<tr data-task-id="(\d+)">', page)
    assert sorted(map(int, listed)) == [ids["b"], ids["c"]]
    assert '<span class="state state-waiting">waiting</span>' in page
    # The overview (and the status page, the same panels): a card, and a column per queue.
    for path in ("/console/", "/"):
        body = request(armed, "GET", path)[2]
        assert parse(body).queues["flows"]["waiting"] == "2", path
        assert parse(body).queues["flows"]["queued"] == "1", path
        card = re.search(r'class="card card-waiting"><b>([^<]*)</b>', body)
        assert card is not None and card.group(1) == "2", path
    # `worker status`: a column, first as a step goes through it, and in the JSON.
    out = run_cli("status", "--dsn", pg_dsn, "--schema", schema)
    assert out.returncode == 0, out.stderr
    head = next(line for line in out.stdout.splitlines() if line.startswith("queue"))
    assert head.split()[:3] == ["queue", "waiting", "scheduled"]
    row = next(line for line in out.stdout.splitlines() if line.startswith("flows"))
    assert row.split()[1:4] == ["2", "0", "1"]
    out = run_cli("status", "--dsn", pg_dsn, "--schema", schema, "--json")
    (flows,) = [q for q in json.loads(out.stdout)["queues"] if q["queue"] == "flows"]
    assert flows["counts"]["waiting"] == 2 and flows["counts"]["queued"] == 1
    # A bulk action by state does not take waiting steps, and says why.
    out = run_cli("cancel", "--state", "waiting", "--yes", "--dsn", pg_dsn, "--schema", schema)
    assert out.returncode != 0
    assert "waiting steps are a workflow's: cancel the workflow" in out.stderr, out.stderr
    # The task page of a step links to its workflow.
    page = request(armed, "GET", f"/console/jobs/{ids['b']}")[2]
    assert f'href="/console/workflows/{wf}#step-{ids["b"]}"' in page
    assert "waiting for 1 step(s) to finish" in page


def test_workflow_actions_are_refused_without_a_session_and_its_csrf_token(
    armed: MetricsServer, schema: str, conn: psycopg.Connection
) -> None:
    wf, ids = _small(conn, schema)
    conn.execute(
        f"UPDATE {schema}.tasks SET state = 'failed', attempts = 1, finished_at = now()"
        " WHERE id = %s",
        (ids["a"],),
    )
    session, csrf = signed_in(armed)
    cookie = {"Cookie": session["Cookie"]}
    before = _state(conn, schema)
    for path, form in (
        (f"/console/workflows/{wf}/cancel", {}),
        (f"/console/workflows/{wf}/retry", {"step": str(ids["a"])}),
    ):
        for extra, headers in (
            ({"csrf": csrf}, cookie),  # no Origin
            ({"csrf": csrf}, {**cookie, "Origin": "http://evil.example"}),
            ({}, session),  # no CSRF token
            ({"csrf": csrf + "x"}, session),
            ({"csrf": csrf}, origin(armed)),  # no session
        ):
            status, _, text = request(armed, "POST", path, {**form, **extra}, headers)
            assert status == 403, (path, extra, headers, text[:200])
    assert _state(conn, schema) == before
    # Complete, they act: the retry first (the failed step back to the queue, its dependents
    # waiting for it again), then the cancel (every step not finished).
    status, headers, _ = request(
        armed,
        "POST",
        f"/console/workflows/{wf}/retry",
        {"csrf": csrf, "step": str(ids["a"])},
        session,
    )
    assert status == 303
    assert headers["location"] == f"/console/workflows/{wf}#step-{ids['a']}"
    page = request(armed, "GET", headers["location"].split("#")[0], headers=session)[2]
    assert f"step {ids['a']} retried" in page
    states = dict(conn.execute(f"SELECT id, state::text FROM {schema}.tasks").fetchall())
    assert [states[ids[k]] for k in "abc"] == ["queued", "waiting", "waiting"]
    status, headers, _ = request(
        armed, "POST", f"/console/workflows/{wf}/cancel", {"csrf": csrf}, session
    )
    assert status == 303 and headers["location"] == f"/console/workflows/{wf}"
    page = request(armed, "GET", f"/console/workflows/{wf}", headers=session)[2]
    assert f"workflow {wf}: 3 step(s) cancelled or asked to stop" in page
    states = dict(conn.execute(f"SELECT id, state::text FROM {schema}.tasks").fetchall())
    assert [states[ids[k]] for k in "abc"] == ["cancelled"] * 3
    audit = conn.execute(
        f"SELECT actor, action, filter, (counts->>'changed')::int FROM {schema}.actions"
        " WHERE source = 'console' ORDER BY id"
    ).fetchall()
    assert audit == [
        ("bob", "retry", {"task_id": ids["a"], "workflow_id": wf}, 1),
        ("bob", "cancel workflow", {"workflow_id": wf}, 3),
    ]
    # Finished, it has nothing to cancel: no button, and a cancel says so.
    assert "Cancel workflow" not in page
    request(armed, "POST", f"/console/workflows/{wf}/cancel", {"csrf": csrf}, session)
    page = request(armed, "GET", f"/console/workflows/{wf}", headers=session)[2]
    assert "nothing to cancel, every step has finished" in page
    # Unknown workflows and steps.
    assert request(armed, "GET", "/console/workflows/999999")[0] == 404
    assert request(armed, "GET", f"/console/workflows/{2**64}")[0] == 404


@pytest.fixture
def big(schema: str, conn: psycopg.Connection) -> dict[str, int]:
    """A workflow of 100,000 steps: 99,999 in parallel (done, failed or queued: finished by an
    UPDATE after their edges were written, so no worker settled them yet), and a join that
    waits for all of them."""
    (wf,) = conn.execute(
        f"INSERT INTO {schema}.workflows (name) VALUES ('big') RETURNING id"
    ).fetchone()
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, workflow_id)"
        " SELECT 'wf.part', 'flows', %s FROM generate_series(1, %s)",
        (wf, BIG - 1),
    )
    (join,) = conn.execute(
        f"INSERT INTO {schema}.tasks (task, queue, workflow_id) VALUES ('wf.join', 'flows', %s)"
        " RETURNING id",
        (wf,),
    ).fetchone()
    conn.execute(
        f"INSERT INTO {schema}.task_deps (task_id, depends_on, position)"
        f" SELECT %s, t.id, row_number() OVER (ORDER BY t.id) FROM {schema}.tasks AS t"
        " WHERE t.workflow_id = %s AND t.id <> %s",
        (join, wf, join),
    )
    conn.execute(
        f"UPDATE {schema}.tasks AS t SET state = x.s, attempts = 1,"
        " started_at = now() - interval '2 s', finished_at = now(),"
        " last_error = CASE WHEN x.s = 'failed' THEN 'IOError: part ' || x.g || ' could not be"
        " read' END"
        f" FROM (SELECT id, row_number() OVER (ORDER BY id) AS g FROM {schema}.tasks"
        "        WHERE workflow_id = %s AND id <> %s) AS p,"
        " LATERAL (SELECT p.g, (CASE WHEN p.g %% 1000 = 0 THEN 'failed' ELSE 'done' END)"
        f"::{schema}.task_state AS s) AS x"
        " WHERE t.id = p.id AND (p.g %% 1000 = 0 OR p.g <= 60000)",
        (wf, join),
    )
    conn.execute(f"ANALYZE {schema}.tasks")
    conn.execute(f"ANALYZE {schema}.task_deps")
    return {"workflow": wf, "join": join}


def _rows_read(plan: dict[str, Any], relation: str) -> int:
    """The most rows any one scan of ``relation`` returned in the plan (loops counted)."""
    most = 0
    if plan.get("Relation Name") == relation:
        most = int(plan["Actual Rows"]) * int(plan.get("Actual Loops", 1))
    for child in plan.get("Plans", []):
        most = max(most, _rows_read(child, relation))
    return most


def test_a_workflow_of_100000_steps_reads_a_page_at_a_time(
    armed: MetricsServer, schema: str, conn: psycopg.Connection, big: dict[str, int]
) -> None:
    wf, join = big["workflow"], big["join"]
    began = time.monotonic()
    status, _, page = request(armed, "GET", f"/console/workflows/{wf}")
    took = time.monotonic() - began
    assert status == 200, re.sub(r"<[^>]+>", " ", page)[-600:]
    print(f"the first page of a workflow of {BIG:,} steps: {took * 1000:.0f} ms")
    # The counts per state, all of them, from the aggregate.
    counts = dict(re.findall(r'data-count="(\w+)"><b><a[^>]*>([\d,]+)</a>', page))
    assert counts == {
        "waiting": "1",
        "scheduled": "0",
        "queued": "39,960",
        "in_progress": "0",
        "done": "59,940",
        "failed": "99",
        "cancelled": "0",
    }
    assert re.search(r'id="wf-total">100,000<', page)
    steps = [int(s) for s in re.findall(r'<tr id="step-\d+" data-step="(\d+)">', page)]
    assert len(steps) == console_data.WORKFLOW_STEPS == 200
    assert steps == sorted(steps)  # dependency order
    nxt = re.search(r'<a rel="next" href="([^"]+)">', page)
    assert nxt is not None and f"after={steps[-1]}" in nxt.group(1)
    # The last page: the join, its first ten inputs listed with how each ended, the rest counted.
    status, _, last = request(armed, "GET", f"/console/workflows/{wf}?after={join - 1}")
    assert status == 200
    assert re.findall(r'data-step="(\d+)"', last) == [str(join)]
    assert "and 99,989 more" in last
    assert len(re.findall(r'href="#step-\d+"', last)) == 10
    # Only the failed steps: a page of them, all failed.
    failed = request(armed, "GET", f"/console/workflows/{wf}?state=failed")[2]
    rows = re.findall(r'<td data-col="state"><span class="state state-(\w+)">', failed)
    assert rows == ["failed"] * 99
    assert "IOError: part 1000 could not be read" in failed

    # Each read is bounded: the page of steps reads its 201 task rows and, for each, at most
    # ten edges and the capped count; only the counts read the whole workflow, once.
    q = queries(schema, SQL_DIR)
    conn.execute("SET max_parallel_workers_per_gather = 0")  # as the console's reads run
    params = {
        "id": wf,
        "after": join - 1,
        "state": None,
        "limit": console_data.WORKFLOW_STEPS,
        "deps": console_data.STEP_DEPS,
        "deps_cap": console_data.STEP_DEPS_CAP,
        "name_chars": console_data.ROW_NAME_CHARS,
        "chars": console_data.ROW_CHARS,
        "stored": console_data.STORED_BYTES,
    }
    for after in (0, join - 1):
        (plan,) = conn.execute(
            b"EXPLAIN (ANALYZE, FORMAT JSON) " + q["console_workflow_steps"].as_bytes(conn),
            {**params, "after": after},
        ).fetchone()[0]
        assert _rows_read(plan["Plan"], "tasks") <= console_data.WORKFLOW_STEPS + 1, after
        if not after:  # steps without dependencies: no edge read at all
            assert _rows_read(plan["Plan"], "task_deps") == 0, plan
        else:  # the join: ten edges listed, and its own edges counted (up to the cap)
            scans = sorted(int(s["Actual Rows"]) for s in _scans(plan["Plan"], "task_deps"))
            assert scans == [console_data.STEP_DEPS, BIG - 1], plan
    (plan,) = conn.execute(
        b"EXPLAIN (ANALYZE, FORMAT JSON) " + q["console_workflow_counts"].as_bytes(conn),
        {"id": wf},
    ).fetchone()[0]
    assert _rows_read(plan["Plan"], "tasks") == BIG  # one aggregate over the workflow's steps


def _scans(plan: dict[str, Any], relation: str) -> list[dict[str, Any]]:
    found = [plan] if plan.get("Relation Name") == relation else []
    for child in plan.get("Plans", []):
        found += _scans(child, relation)
    return found


def test_a_joins_row_lists_its_inputs_in_order(
    armed: MetricsServer, schema: str, conn: psycopg.Connection
) -> None:
    """A workflow enqueued by the Python API: its page lists the steps with the names of their
    tasks and their dependencies, the join's in the order of its inputs' ids."""
    flow = worker.group(
        [worker.step("wf.part", {"n": n}, queue="flows") for n in range(3)],
        then=worker.step("wf.join", queue="flows"),
    )
    ids = worker.enqueue_workflow(conn, flow, schema=schema)
    page = request(armed, "GET", f"/console/workflows/{ids.id}")[2]
    parts = [ids[s] for s in flow.steps[:3]]
    join = ids[flow.steps[-1]]
    row = re.search(rf'<tr id="step-{join}".*?</tr>', page)
    assert row is not None
    assert re.findall(r'href="#step-(\d+)"', row.group(0)) == [str(p) for p in parts]
    assert "pending" in row.group(0) and "for 3" in row.group(0)
    assert page.count('data-col="task">wf.part<') == 3
