"""Features tried together, as an operator uses them, with real `worker run` processes: a pause
holds on a limited queue; a worker frozen inside its claim (SIGSTOP) holds only what it claimed
and never stalls the others; a rate limit holds where the protected service sees the starts, by
the handlers' own clock. Handlers are in tests/compose_module.py; each run is recorded with
clock_timestamp() in the schema's `runs` table."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import psutil
import psycopg
from conftest import run_cli, spawn_cli, wait_until
from test_pool import kill_tree

import worker


def _tables(conn: psycopg.Connection, schema: str) -> None:
    conn.execute(
        f"CREATE TABLE {schema}.runs (id bigint GENERATED ALWAYS AS IDENTITY, task_id bigint,"
        " attempt int, queue text, pid int, started timestamptz, finished timestamptz,"
        " wall double precision)"
    )


@contextlib.contextmanager
def worker_process(dsn: str, schema: str, *extra: str) -> Iterator[Any]:
    """One `worker run compose_module` process (no supervisor), killed afterwards."""
    args = [
        "run", "compose_module", "--dsn", dsn, "--schema", schema, "--processes", "1",
        "--poll-interval", "0.2", "--log-level", "WARNING", *extra,
    ]  # fmt: skip
    proc = spawn_cli(*args, env={"WORKER_DSN": dsn, "WORKER_SCHEMA": schema})
    try:
        yield proc
    finally:
        with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        kill_tree(proc)


def _enqueue(conn: psycopg.Connection, schema: str, task: str, n: int, sleep: float) -> None:
    queue = task.split(".")[0]  # as compose_module routes them
    worker.enqueue_many(conn, task, [{"sleep": sleep}] * n, queue=queue, schema=schema)


def _max_overlap(conn: psycopg.Connection, schema: str, queue: str) -> int:
    """The most runs of ``queue`` that overlapped in time, by the database clock."""
    row = conn.execute(
        f"""SELECT coalesce(max(n), 0) FROM (
                SELECT sum(d) OVER (ORDER BY t, d) AS n FROM (
                    SELECT started AS t, 1 AS d FROM {schema}.runs WHERE queue = %(q)s
                    UNION ALL
                    SELECT coalesce(finished, 'infinity'), -1 FROM {schema}.runs
                     WHERE queue = %(q)s) AS ev) AS o""",
        {"q": queue},
    ).fetchone()
    assert row is not None
    return int(row[0])


def _count(conn: psycopg.Connection, schema: str, queue: str) -> int:
    row = conn.execute(
        f"SELECT count(*) FROM {schema}.runs WHERE queue = %s AND finished IS NOT NULL", (queue,)
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_pause_holds_on_a_limited_queue(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """`worker limits set lim --concurrency 2; worker pause lim`: of 4 limited tasks none starts
    while the queue is paused (an unlimited queue served by the same worker runs); after
    `worker resume lim` all 4 run, never more than 2 at once."""
    _tables(conn, schema)
    common = ("--dsn", pg_dsn, "--schema", schema)
    assert run_cli("limits", "set", "lim", "--concurrency", "2", *common).returncode == 0
    assert run_cli("pause", "lim", *common).returncode == 0
    _enqueue(conn, schema, "lim.run", 4, 0.3)
    _enqueue(conn, schema, "plain.run", 2, 0.0)
    with worker_process(pg_dsn, schema, "--queues", "lim,plain"):
        wait_until(lambda: _count(conn, schema, "plain") == 2, timeout=20)
        time.sleep(2.0)  # polls and notifications come and go: still nothing from lim
        assert _count(conn, schema, "lim") == 0
        assert run_cli("resume", "lim", *common).returncode == 0
        wait_until(lambda: _count(conn, schema, "lim") == 4, timeout=20)
    assert _max_overlap(conn, schema, "lim") == 2


def _freeze_claims(conn: psycopg.Connection, schema: str) -> None:
    """While a row of `freeze` says so, a claim of a `lim` row takes 2 s inside its transaction:
    long enough to catch the worker there and stop it."""
    conn.execute(f"CREATE TABLE {schema}.freeze (on_ boolean)")
    conn.execute(f"INSERT INTO {schema}.freeze VALUES (true)")
    conn.execute(
        f"""CREATE FUNCTION {schema}.slow_claim() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF (SELECT on_ FROM {schema}.freeze) THEN PERFORM pg_sleep(2); END IF;
                RETURN NEW;
            END $$"""
    )
    conn.execute(
        f"CREATE TRIGGER slow_claim BEFORE UPDATE ON {schema}.tasks FOR EACH ROW"
        " WHEN (OLD.state = 'queued' AND NEW.state = 'in_progress' AND NEW.queue = 'lim')"
        f" EXECUTE FUNCTION {schema}.slow_claim()"
    )


def test_a_worker_frozen_in_its_limited_claim_stalls_nobody(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """Worker A claims a task of `lim` (limit 3 running) and is SIGSTOPped inside that claim's
    transaction (a paused VM, a long GC, a partition). Worker B, serving `lim` and the unlimited
    `plain`, starts each plain task within 1 s of its enqueue, and runs limited ones up to the
    limit less what A holds (2), never more than 3 together with A's, while A stays frozen."""
    _tables(conn, schema)
    _freeze_claims(conn, schema)
    conn.execute(f"SELECT {schema}.set_queue_limit('lim', concurrency => 3)")
    _enqueue(conn, schema, "lim.run", 1, 0.0)
    with worker_process(pg_dsn, schema, "--queues", "lim", "--concurrency", "1") as a:
        # A's claim is inside its transaction, asleep in the trigger: stop A there.
        backend = wait_until(
            lambda: conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE wait_event = 'PgSleep'"
                " AND application_name = 'worker'"
            ).fetchone(),
            timeout=20,
        )[0]
        os.kill(a.pid, signal.SIGSTOP)
        conn.execute(f"UPDATE {schema}.freeze SET on_ = false")
        wait_until(  # A's statement is done; its transaction stays open, A cannot go on
            lambda: (
                conn.execute(
                    "SELECT state = 'idle in transaction' FROM pg_stat_activity WHERE pid = %s",
                    (backend,),
                ).fetchone()
                == (True,)
            ),
            timeout=10,
        )
        with worker_process(pg_dsn, schema, "--queues", "lim,plain", "--concurrency", "10") as b:
            # B is up (registered, so claiming) before the clock of the promise starts: on a
            # busy machine a new process may take more than a second to get there.
            wait_until(
                lambda: conn.execute(
                    f"SELECT 1 FROM {schema}.workers WHERE pid = %s AND stopped_at IS NULL",
                    (b.pid,),
                ).fetchone(),
                timeout=30,
            )
            time.sleep(0.3)  # its first claim and LISTEN are done
            _enqueue(conn, schema, "lim.run", 4, 1.5)
            _enqueue(conn, schema, "plain.run", 3, 0.0)
            wait_until(lambda: _count(conn, schema, "plain") == 3, timeout=10)
            late = conn.execute(
                f"SELECT max(r.started - t.created_at) FROM {schema}.runs AS r"
                f" JOIN {schema}.tasks AS t ON t.id = r.task_id WHERE r.queue = 'plain'"
            ).fetchone()
            assert late is not None and late[0].total_seconds() < 1.0, late
            wait_until(lambda: _max_overlap(conn, schema, "lim") >= 2, timeout=10)
            # ... and all of this while A is still frozen inside its transaction.
            still = conn.execute(
                "SELECT state FROM pg_stat_activity WHERE pid = %s", (backend,)
            ).fetchone()
            assert still == ("idle in transaction",)
            assert psutil.Process(a.pid).status() == psutil.STATUS_STOPPED
            assert _max_overlap(conn, schema, "lim") == 2  # 3 less the one A holds


def test_a_rate_limit_holds_by_the_handlers_clock(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """`rate="40/s"` over two worker processes with 50 slots each: no one-second window of
    handler starts, by the handlers' own clock (what the service behind the limit sees), holds
    more than 40, and the fleet keeps up with the limit (at least 90% of it over 4 s)."""
    _tables(conn, schema)
    conn.execute(f"SELECT {schema}.set_queue_limit('rated', rate => 40, rate_seconds => 1)")
    n = 240
    _enqueue(conn, schema, "rated.run", n, 0.0)
    with (
        worker_process(pg_dsn, schema, "--queues", "rated", "--concurrency", "50"),
        worker_process(pg_dsn, schema, "--queues", "rated", "--concurrency", "50"),
    ):
        wait_until(lambda: _count(conn, schema, "rated") == n, timeout=60)
    walls = sorted(r[0] for r in conn.execute(f"SELECT wall FROM {schema}.runs").fetchall())
    busiest, j = 0, 0
    for i, start in enumerate(walls):
        while walls[j] <= start - 1.0:
            j += 1
        busiest = max(busiest, i - j + 1)  # starts in the window (start - 1 s, start]
    assert busiest <= 40, busiest
    first = walls[0]
    early = sum(1 for w in walls if w < first + 4.0)
    assert early >= 0.9 * 40 * 4, early
    pids = conn.execute(f"SELECT count(DISTINCT pid) FROM {schema}.runs").fetchone()
    assert pids is not None and pids[0] == 2


# -- workflow steps with the rest ------------------------------------------------------------------
#
# Cancelling a workflow while a step runs is in tests/test_workflows.py (and, from the console,
# with real processes, tests/test_console_ui.py); a graceful stop in the middle of a fan-in,
# resumed by the next fleet, in tests/test_workflows.py too. Here: a pause, a concurrency limit,
# retries and a graceful stop, each with real `worker run` processes (compose_module's flow.*).


def _step_row(conn: psycopg.Connection, schema: str, task_id: int) -> tuple[Any, ...]:
    row = conn.execute(
        f"SELECT state::text, attempts, inputs FROM {schema}.tasks WHERE id = %s", (task_id,)
    ).fetchone()
    assert row is not None
    return row


def _step_runs(conn: psycopg.Connection, schema: str, task_id: int) -> list[tuple[Any, ...]]:
    """(attempt, started, finished) of each run of the step, first first."""
    return conn.execute(
        f"SELECT attempt, started, finished FROM {schema}.runs WHERE task_id = %s ORDER BY id",
        (task_id,),
    ).fetchall()


def _step(n: int, queue: str = "plain", **more: Any) -> worker.Step:
    return worker.step(f"flow.{queue}", {"n": n, **more}, queue=queue)


def test_a_paused_queue_holds_a_ready_step_until_it_is_resumed(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """A chain plain -> lim -> plain with `lim` paused: the first step runs and the second
    becomes ready (queued), but does not start while the queue is paused; once resumed it runs,
    after the resume committed by the database clock, and the third gets its result."""
    _tables(conn, schema)
    common = ("--dsn", pg_dsn, "--schema", schema)
    assert run_cli("pause", "lim", *common).returncode == 0
    flow = worker.chain(_step(1), _step(2, "lim"), _step(3))
    wf = worker.enqueue_workflow(conn, flow, schema=schema)
    a, b, c = (wf[s] for s in flow.steps)
    with worker_process(pg_dsn, schema, "--queues", "lim,plain"):
        wait_until(lambda: _step_row(conn, schema, b)[0] == "queued", timeout=20)
        assert _step_row(conn, schema, a)[0] == "done"
        time.sleep(2.0)  # polls and notifications come and go: the ready step stays put
        assert _step_row(conn, schema, b)[0] == "queued" and _step_runs(conn, schema, b) == []
        assert _step_row(conn, schema, c)[0] == "waiting"
        (before_resume,) = conn.execute("SELECT clock_timestamp()").fetchone()
        assert run_cli("resume", "lim", *common).returncode == 0
        wait_until(lambda: _step_row(conn, schema, c)[0] == "done", timeout=20)
    ((attempt, started, _),) = _step_runs(conn, schema, b)
    assert attempt == 1 and started > before_resume
    first = {"n": 1, "attempt": 1, "inputs": []}
    assert _step_row(conn, schema, c)[2] == [{"n": 2, "attempt": 1, "inputs": [first]}]


def test_a_concurrency_limit_holds_for_a_workflows_steps(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """Six steps of a group on `lim` (concurrency 2), their join on `plain`, one worker with 10
    slots: never more than 2 of the six at once by the database clock, and the join runs once,
    with the six results in order."""
    _tables(conn, schema)
    common = ("--dsn", pg_dsn, "--schema", schema)
    assert run_cli("limits", "set", "lim", "--concurrency", "2", *common).returncode == 0
    flow = worker.group([_step(i, "lim", sleep=0.4) for i in range(6)], then=_step(99))
    wf = worker.enqueue_workflow(conn, flow, schema=schema)
    join = wf[flow.steps[-1]]
    with worker_process(pg_dsn, schema, "--queues", "lim,plain", "--concurrency", "10"):
        wait_until(lambda: _step_row(conn, schema, join)[0] == "done", timeout=30)
    assert _max_overlap(conn, schema, "lim") == 2
    assert len(_step_runs(conn, schema, join)) == 1
    assert [i["n"] for i in _step_row(conn, schema, join)[2]] == list(range(6))


def test_a_retried_step_passes_on_the_result_of_its_successful_attempt(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """A step that fails its first two attempts and succeeds at its third: the step after it
    runs once, after that attempt, and receives that attempt's result."""
    _tables(conn, schema)
    flow = worker.chain(_step(1, fail_attempts=2), _step(2))
    wf = worker.enqueue_workflow(conn, flow, schema=schema)
    first, second = (wf[s] for s in flow.steps)
    with worker_process(pg_dsn, schema, "--queues", "plain"):
        wait_until(lambda: _step_row(conn, schema, second)[0] == "done", timeout=30)
    assert _step_row(conn, schema, first)[:2] == ("done", 3)
    runs = _step_runs(conn, schema, first)
    assert [r[0] for r in runs] == [1, 2, 3]
    ((_, started, _),) = _step_runs(conn, schema, second)
    assert started > runs[-1][2]
    assert _step_row(conn, schema, second)[2] == [{"n": 1, "attempt": 3, "inputs": []}]


def test_a_graceful_stop_in_the_middle_of_a_chain_leaves_it_to_the_next_worker(
    pg_dsn: str, schema: str, conn: psycopg.Connection
) -> None:
    """SIGTERM while the second step of a chain of three runs, past a short grace: the worker
    exits 0, the step is back in the queue and the third still waits; the next worker runs the
    step again, never two of its runs at once, and the third gets the result of that run."""
    _tables(conn, schema)
    flow = worker.chain(_step(1), _step(2, sleep=30), _step(3))
    wf = worker.enqueue_workflow(conn, flow, schema=schema)
    a, b, c = (wf[s] for s in flow.steps)
    with worker_process(pg_dsn, schema, "--queues", "plain", "--grace", "0.3") as proc:
        wait_until(lambda: _step_runs(conn, schema, b), timeout=20)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert [_step_row(conn, schema, x)[0] for x in (a, b, c)] == ["done", "queued", "waiting"]
    conn.execute(
        f"UPDATE {schema}.tasks SET payload = payload || '{{\"sleep\": 0.2}}' WHERE id = %s", (b,)
    )
    with worker_process(pg_dsn, schema, "--queues", "plain"):
        wait_until(lambda: _step_row(conn, schema, c)[0] == "done", timeout=30)
    runs = _step_runs(conn, schema, b)
    assert len(runs) == 2 and runs[0][2] is not None and runs[0][2] <= runs[1][1]
    first = {"n": 1, "attempt": 1, "inputs": []}
    assert _step_row(conn, schema, c)[2] == [{"n": 2, "attempt": runs[1][0], "inputs": [first]}]
