"""Cancelling running tasks (schema/0010): real worker processes stop their handlers within about
a second of the request, by NOTIFY or, when they cannot LISTEN, by polling; the row ends
`cancelled` with who and when; a handler that ignores the request is never recorded done; a
transactional handler's writes roll back; and no way out of `in_progress` (acknowledgement, retry,
graceful stop, rescue, a dead process) turns a cancel request into `done` or back into the queue.
Handlers: tests/cancel_module.py."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from conftest import every_statement, run_cli, spawn_cli, wait_until
from test_console_http import armed, request, signed_in  # noqa: F401 - armed: a fixture
from test_pgbouncer import PGBOUNCER, bouncer_dsn  # noqa: F401 - a fixture, used by name

import worker
from worker import store as tr
from worker.coord import cancel as _cancel
from worker.monitor.server import MetricsServer
from worker.ops.actions import cancel as console_cancel

# A cancel lands within this many seconds of the request, by the database's clock: from the
# request's commit (cancel_requested_at) to the acknowledgement that ends the row (finished_at).
PROMISE = 2.0


def _tables(conn: psycopg.Connection, schema: str) -> None:
    conn.execute(
        f"CREATE TABLE {schema}.runs (run bigserial PRIMARY KEY, task_id bigint, attempt int,"
        " pid int, started timestamptz, ended timestamptz, how text, saw_cancel boolean)"
    )
    conn.execute(f"CREATE TABLE {schema}.side_effects (task_id bigint)")


@pytest.fixture
def tables(conn: psycopg.Connection, schema: str) -> str:
    _tables(conn, schema)
    return schema


def row(conn: psycopg.Connection, schema: str, task_id: int) -> dict[str, Any]:
    cur = conn.execute(
        f"SELECT state::text AS state, attempts, cancel_requested_at, cancelled_by, finished_at,"
        f" last_error, lease_expires_at FROM {schema}.tasks WHERE id = %s",
        (task_id,),
    )
    names = [d.name for d in cur.description]
    found = cur.fetchone()
    assert found is not None
    return dict(zip(names, found, strict=True))


def runs(conn: psycopg.Connection, schema: str, task_id: int) -> list[dict[str, Any]]:
    cur = conn.execute(
        f"SELECT attempt, started, ended, how, saw_cancel FROM {schema}.runs"
        " WHERE task_id = %s ORDER BY run",
        (task_id,),
    )
    names = [d.name for d in cur.description]
    return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def started(conn: psycopg.Connection, schema: str, task_id: int) -> None:
    """Wait until the handler of ``task_id`` is running (it recorded its start)."""
    wait_until(lambda: runs(conn, schema, task_id), timeout=30)


def ended_cancelled(conn: psycopg.Connection, schema: str, task_id: int) -> dict[str, Any]:
    wait_until(lambda: row(conn, schema, task_id)["state"] != "in_progress", timeout=15)
    r = row(conn, schema, task_id)
    assert r["state"] == "cancelled", r
    return r


def latency(r: dict[str, Any]) -> float:
    return (r["finished_at"] - r["cancel_requested_at"]).total_seconds()


@contextlib.contextmanager
def running_worker(dsn: str, schema: str, *flags: str) -> Iterator[subprocess.Popen[str]]:
    """`worker run tests/cancel_module.py` as one process (no supervisor), stopped at the end.
    The default 30 s lease means a heartbeat every 10 s: anything faster is NOTIFY or the poll."""
    proc = spawn_cli(
        "run",
        "cancel_module",
        "--processes",
        "1",
        "--concurrency",
        "4",
        "--poll-interval",
        "0.2",
        "--schema",
        schema,
        *flags,
        env={"WORKER_DSN": dsn, "WORKER_SCHEMA": schema},
        stderr=subprocess.PIPE,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if proc.stderr is not None:
            proc.stderr.close()


def enqueue(conn: psycopg.Connection, schema: str, task: str, **payload: Any) -> int:
    return worker.enqueue(conn, task, payload, schema=schema)


# -- real workers --------------------------------------------------------------------------------


def test_an_async_handler_is_cancelled_within_a_second_of_worker_cancel(
    pg_dsn: str, conn: psycopg.Connection, tables: str
) -> None:
    schema = tables
    task_id = enqueue(conn, schema, "cx.async_sleep", s=60)
    with running_worker(pg_dsn, schema):
        started(conn, schema, task_id)
        r = run_cli("cancel", str(task_id), "--by", "alice", "--dsn", pg_dsn, "--schema", schema)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip().splitlines() == [
            f"cancel requested for task {task_id}: it is running, its worker will stop it"
        ]
        done = ended_cancelled(conn, schema, task_id)
        assert done["cancelled_by"] == "alice"
        assert 0 <= latency(done) < PROMISE, latency(done)
        assert done["attempts"] == 1 and done["lease_expires_at"] is None
        assert done["last_error"].startswith("Cancelled:")
        # The coroutine itself was cancelled (asyncio), not left to sleep out its minute.
        [run] = runs(conn, schema, task_id)
        assert run["how"] == "cancelled" and run["saw_cancel"] is True
        time.sleep(1.0)  # and it is not retried
        assert row(conn, schema, task_id)["state"] == "cancelled"
        assert len(runs(conn, schema, task_id)) == 1


def test_a_cancel_lands_while_every_slot_is_taken(
    pg_dsn: str, conn: psycopg.Connection, tables: str
) -> None:
    """All four slots run minute-long tasks, so the worker cannot claim and its loop waits on the
    runners only (see engine.inbox's busy wait). A cancel request still lands within the promise:
    the loop reads its socket when nothing else comes, though no heartbeat is due for 10 s."""
    schema = tables
    ids = [enqueue(conn, schema, "cx.async_sleep", s=60) for _ in range(4)]
    # A short grace: the stop at the end does not wait 30 s for the three tasks left running.
    with running_worker(pg_dsn, schema, "--grace", "1"):
        for task_id in ids:
            started(conn, schema, task_id)
        time.sleep(0.5)
        r = run_cli("cancel", str(ids[2]), "--dsn", pg_dsn, "--schema", schema)
        assert r.returncode == 0, r.stderr
        done = ended_cancelled(conn, schema, ids[2])
        assert 0 <= latency(done) < PROMISE, latency(done)
        assert [row(conn, schema, i)["state"] for i in ids] == [
            "in_progress",
            "in_progress",
            "cancelled",
            "in_progress",
        ]


def test_a_sync_handler_checking_ctx_stops(
    pg_dsn: str, conn: psycopg.Connection, tables: str
) -> None:
    schema = tables
    task_id = enqueue(conn, schema, "cx.sync_check", s=60)
    with running_worker(pg_dsn, schema):
        started(conn, schema, task_id)
        done = worker.cancel(conn, task_id, by="bob", schema=schema)
        assert (done.outcome, done.state) == ("requested", "in_progress")
        r = ended_cancelled(conn, schema, task_id)
        assert r["cancelled_by"] == "bob"
        assert latency(r) < PROMISE, latency(r)
        [run] = runs(conn, schema, task_id)
        assert run["how"] == "stopped" and run["saw_cancel"] is True
        assert r["last_error"].startswith("Cancelled: task")


def test_a_sync_handler_that_ignores_the_request_finishes_but_is_not_done(
    pg_dsn: str, conn: psycopg.Connection, tables: str
) -> None:
    schema = tables
    task_id = enqueue(conn, schema, "cx.sync_ignore", s=3)
    with running_worker(pg_dsn, schema):
        started(conn, schema, task_id)
        assert worker.cancel(conn, task_id, schema=schema).outcome == "requested"
        time.sleep(0.5)
        # Nothing can stop a sync thread from outside: the row waits for it, still leased.
        waiting = row(conn, schema, task_id)
        assert waiting["state"] == "in_progress" and waiting["cancel_requested_at"] is not None
        r = ended_cancelled(conn, schema, task_id)
        [run] = runs(conn, schema, task_id)
        assert run["how"] == "finished"  # it returned its result...
        assert run["saw_cancel"] is True  # ...while ctx.cancelled said it should stop
        assert r["finished_at"] >= run["ended"]  # ended when the handler did, as cancelled
        assert r["cancelled_by"] == conn.execute("SELECT current_user").fetchone()[0]
        time.sleep(1.0)
        assert row(conn, schema, task_id)["state"] == "cancelled"
        assert len(runs(conn, schema, task_id)) == 1


def test_transactional_handlers_roll_back_whether_they_check_or_not(
    pg_dsn: str, conn: psycopg.Connection, tables: str
) -> None:
    schema = tables
    checks = enqueue(conn, schema, "cx.txn_check", s=60)
    ignores = enqueue(conn, schema, "cx.txn_ignore", s=3)
    with running_worker(pg_dsn, schema):
        started(conn, schema, checks)
        started(conn, schema, ignores)
        outcomes = _cancel.cancel_many(conn, schema, [checks, ignores], by="carol")
        assert [c.outcome for c in outcomes] == ["requested", "requested"]
        stopped = ended_cancelled(conn, schema, checks)
        assert latency(stopped) < PROMISE, latency(stopped)
        ignored = ended_cancelled(conn, schema, ignores)
        assert [r["how"] for r in runs(conn, schema, checks)] == ["stopped"]
        assert [r["how"] for r in runs(conn, schema, ignores)] == ["finished"]
        assert {stopped["cancelled_by"], ignored["cancelled_by"]} == {"carol"}
        # Neither handler's write survived: both transactions rolled back.
        assert conn.execute(f"SELECT count(*) FROM {schema}.side_effects").fetchone() == (0,)


@pytest.mark.skipif(shutil.which("psql") is None, reason="psql is not installed")
def test_cancel_task_from_psql_works_the_same(
    pg_dsn: str, conn: psycopg.Connection, tables: str
) -> None:
    schema = tables
    running = enqueue(conn, schema, "cx.async_sleep", s=60)
    later = worker.enqueue(conn, "cx.quick", {}, delay=3600, schema=schema)

    def psql(statement: str) -> str:
        out = subprocess.run(
            ["psql", pg_dsn, "-X", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-c", statement],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    with running_worker(pg_dsn, schema):
        started(conn, schema, running)
        assert psql(f"SELECT {schema}.cancel_task({running}, 'dba')") == "requested"
        r = ended_cancelled(conn, schema, running)
        assert r["cancelled_by"] == "dba" and latency(r) < PROMISE, r
        # Not started: cancelled at once, by the database role when no name is given.
        assert psql(f"SELECT {schema}.cancel_task({later})") == "cancelled"
        assert psql(f"SELECT {schema}.cancel_task({later})") == "finished"
        assert psql(f"SELECT {schema}.cancel_task(999999999)") == "missing"
    r = row(conn, schema, later)
    assert r["state"] == "cancelled"
    assert r["cancelled_by"] == conn.execute("SELECT current_user").fetchone()[0]
    assert r["cancel_requested_at"] == r["finished_at"] is not None
    assert runs(conn, schema, later) == []


def test_without_listen_the_poll_lands_the_cancel_within_the_promise(
    pg_dsn: str, conn: psycopg.Connection, tables: str
) -> None:
    """--no-listen: no NOTIFY reaches the worker, and its heartbeat comes every 10 s; the lease
    keeper's once-a-second read of the rows it holds is what stops the handler."""
    schema = tables
    task_id = enqueue(conn, schema, "cx.async_sleep", s=60)
    with running_worker(pg_dsn, schema, "--no-listen"):
        started(conn, schema, task_id)
        time.sleep(0.3)
        assert worker.cancel(conn, task_id, schema=schema).outcome == "requested"
        r = ended_cancelled(conn, schema, task_id)
        assert latency(r) < PROMISE, latency(r)


@pytest.mark.skipif(PGBOUNCER is None, reason="pgbouncer is not installed")
def test_behind_pgbouncer_in_transaction_mode_the_cancel_still_lands(
    pg_dsn: str,
    bouncer_dsn: str,  # noqa: F811 - the fixture imported above
    conn: psycopg.Connection,
    tables: str,
) -> None:
    """--pgbouncer without --listen-dsn: no LISTEN (the pooler cannot keep one), no prepared
    statements; the poll goes through the pooler like every other statement."""
    schema = tables
    sync_task = enqueue(conn, schema, "cx.sync_check", s=60)
    async_task = enqueue(conn, schema, "cx.async_sleep", s=60)
    with running_worker(pg_dsn, schema, "--pgbouncer", "--dsn", bouncer_dsn) as proc:
        started(conn, schema, sync_task)
        started(conn, schema, async_task)
        for task_id in (sync_task, async_task):
            assert worker.cancel(conn, task_id, schema=schema).outcome == "requested"
        for task_id in (sync_task, async_task):
            r = ended_cancelled(conn, schema, task_id)
            assert latency(r) < PROMISE, (task_id, latency(r))
        assert proc.poll() is None
    assert [r["how"] for r in runs(conn, schema, sync_task)] == ["stopped"]
    assert [r["how"] for r in runs(conn, schema, async_task)] == ["cancelled"]


def test_a_cancel_requested_after_its_worker_was_killed_is_not_rescued_back_into_the_queue(
    pg_dsn: str, conn: psycopg.Connection, tables: str
) -> None:
    """kill -9 leaves the row in progress with nobody to stop it; the request lands on the row,
    and the rescue that comes when the lease runs out ends it cancelled instead of queued. The
    task never runs again."""
    schema = tables
    task_id = enqueue(conn, schema, "cx.sync_ignore", s=60)
    with running_worker(pg_dsn, schema, "--lease", "2") as first:
        started(conn, schema, task_id)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
    assert row(conn, schema, task_id)["state"] == "in_progress"
    assert worker.cancel(conn, task_id, by="dave", schema=schema).outcome == "requested"
    with running_worker(pg_dsn, schema, "--lease", "2"):
        r = ended_cancelled(conn, schema, task_id)
        assert r["cancelled_by"] == "dave"
        assert r["last_error"].startswith("LeaseExpired")
        time.sleep(1.5)  # the second worker does not take it
        assert row(conn, schema, task_id)["state"] == "cancelled"
    assert len(runs(conn, schema, task_id)) == 1


# -- the CLI on tasks that cannot be stopped ------------------------------------------------------


def _done_task(conn: psycopg.Connection, schema: str) -> int:
    task_id = enqueue(conn, schema, "cx.quick")
    q = every_statement(schema)
    me = str(uuid.uuid4())
    [c] = tr.claim(conn, q.schema, queues=["default"], limit=1, worker_id=me, lease_seconds=30)
    assert tr.complete(conn, q.schema, worker_id=me, done=[(c.id, c.attempt)]) == {task_id: "done"}
    return task_id


def test_cancelling_a_finished_or_missing_task_changes_nothing_and_says_so(
    pg_dsn: str, conn: psycopg.Connection, schema: str
) -> None:
    common = ["--dsn", pg_dsn, "--schema", schema]
    task_id = _done_task(conn, schema)
    before = conn.execute(f"SELECT * FROM {schema}.tasks WHERE id = %s", (task_id,)).fetchone()
    r = run_cli("cancel", str(task_id), *common)
    assert r.returncode == 1 and r.stdout == ""
    assert (
        r.stderr.strip() == f"worker: error: task {task_id} was not cancelled: it is done already"
    )
    r = run_cli("cancel", str(task_id), "--json", *common)
    assert r.returncode == 1
    assert json.loads(r.stdout) == {"task_id": task_id, "outcome": "finished", "state": "done"}
    after = conn.execute(f"SELECT * FROM {schema}.tasks WHERE id = %s", (task_id,)).fetchone()
    assert after == before
    r = run_cli("cancel", "987654321", *common)
    assert r.returncode == 1
    assert r.stderr.strip().endswith("task 987654321 was not cancelled: there is no such task")
    queued = enqueue(conn, schema, "cx.quick")
    r = run_cli("cancel", str(queued), "--by", "erin", *common)
    assert r.returncode == 0 and r.stdout.strip() == f"cancelled task {queued} (it had not started)"
    assert row(conn, schema, queued)["cancelled_by"] == "erin"
    bad = run_cli("cancel", str(queued), "--by", "", *common)
    assert bad.returncode == 2 and "--by" in bad.stderr and "Traceback" not in bad.stderr


# -- the database's side: every way out of in_progress ------------------------------------------


def _claimed(conn: psycopg.Connection, schema: str, *, lease: float = 30) -> tuple[Any, str]:
    enqueue(conn, schema, "cx.quick")
    me = str(uuid.uuid4())
    q = every_statement(schema)
    [c] = tr.claim(conn, q.schema, queues=["default"], limit=1, worker_id=me, lease_seconds=lease)
    return c, me


EXITS = {
    "complete": lambda conn, q, c, me: tr.complete(conn, q.schema, worker_id=me, done=[(c.id, 1)]),
    "complete_delete": lambda conn, q, c, me: tr.complete(
        conn, q.schema, worker_id=me, done=[(c.id, 1)], delete=True
    ),
    "retry": lambda conn, q, c, me: tr.fail(
        conn, q.schema, worker_id=me, failures=[tr.Failure(c.id, 1, 0.0, "ValueError: x", False)]
    ),
    "retry_later": lambda conn, q, c, me: tr.fail(
        conn, q.schema, worker_id=me, failures=[tr.Failure(c.id, 1, 60.0, "ValueError: x", False)]
    ),
    "release": lambda conn, q, c, me: tr.release(conn, q.schema, worker_id=me, tasks=[(c.id, 1)]),
    "hand_back": lambda conn, q, c, me: tr.hand_back(
        conn, q.schema, worker_id=me, rows=[(c.id, 1, "UnknownTask: none")]
    ),
    "worker_died": lambda conn, q, c, me: tr.worker_died(
        conn, q.schema, worker_id=me, error="WorkerDied: killed"
    ),
}


@pytest.mark.parametrize("way", sorted(EXITS))
def test_every_way_out_of_in_progress_ends_a_marked_row_cancelled(
    conn: psycopg.Connection, schema: str, way: str
) -> None:
    c, me = _claimed(conn, schema)
    q = every_statement(schema)
    assert worker.cancel(conn, c.id, by="frank", schema=schema).outcome == "requested"
    EXITS[way](conn, q, c, me)
    r = row(conn, schema, c.id)
    assert r["state"] == "cancelled", (way, r)
    assert r["finished_at"] is not None and r["lease_expires_at"] is None
    assert r["cancelled_by"] == "frank"
    # Nothing to claim: it did not go back to the queue.
    assert (
        tr.claim(conn, q.schema, queues=["default"], limit=10, worker_id=me, lease_seconds=30) == []
    )


def test_rescue_ends_a_marked_row_cancelled(conn: psycopg.Connection, schema: str) -> None:
    c, me = _claimed(conn, schema, lease=0.2)
    q = every_statement(schema)
    worker.cancel(conn, c.id, schema=schema)
    time.sleep(0.4)
    assert [(r[0], r[3]) for r in tr.rescue(conn, q.schema)] == [(c.id, "cancelled")]
    assert (
        tr.claim(conn, q.schema, queues=["default"], limit=10, worker_id=me, lease_seconds=30) == []
    )


@pytest.mark.parametrize("way", ["complete", "retry"])
def test_unmarked_rows_are_not_touched_by_the_cancel_branches(
    conn: psycopg.Connection, schema: str, way: str
) -> None:
    """The other side of the CASE: without a request, done is done and a retry is queued."""
    c, me = _claimed(conn, schema)
    EXITS[way](conn, every_statement(schema), c, me)
    assert row(conn, schema, c.id)["state"] == {"complete": "done", "retry": "queued"}[way]


def test_a_cancel_racing_an_acknowledgement_never_ends_done_after_it_was_granted(
    pg_dsn: str, conn: psycopg.Connection, schema: str
) -> None:
    """Both orders, with the first transaction held open while the second one runs: the ack
    first, so the cancel waits and then reports the task finished (done); the cancel first, so the
    ack waits and then ends the row cancelled."""
    q = every_statement(schema)
    with psycopg.connect(pg_dsn) as ack:  # not autocommit: hold the transaction
        c, me = _claimed(conn, schema)
        assert tr.complete(ack, q.schema, worker_id=me, done=[(c.id, 1)]) == {c.id: "done"}
        result: list[Any] = []

        def request() -> None:
            result.append(worker.cancel(pg_dsn, c.id, schema=schema))

        t = threading.Thread(target=request)
        t.start()
        time.sleep(0.5)
        assert t.is_alive() and not result  # waits on the ack's row lock
        ack.commit()
        t.join(10)
        assert result[0].outcome == "finished" and result[0].state == "done"
        assert row(conn, schema, c.id)["cancel_requested_at"] is None

    with psycopg.connect(pg_dsn) as canceller:
        c, me = _claimed(conn, schema)
        assert worker.cancel(canceller, c.id, schema=schema).outcome == "requested"
        acked: list[Any] = []

        def acknowledge() -> None:
            with psycopg.connect(pg_dsn, autocommit=True) as other:
                acked.append(tr.complete(other, q.schema, worker_id=me, done=[(c.id, 1)]))

        t = threading.Thread(target=acknowledge)
        t.start()
        time.sleep(0.5)
        assert t.is_alive() and not acked  # waits on the cancel's row lock
        canceller.commit()
        t.join(10)
        assert acked == [{c.id: "cancelled"}]
        assert row(conn, schema, c.id)["state"] == "cancelled"


def test_the_heartbeat_and_the_poll_report_requests_for_the_owners_rows_only(
    conn: psycopg.Connection, schema: str
) -> None:
    c, me = _claimed(conn, schema)
    other, them = _claimed(conn, schema)
    q = every_statement(schema)
    beat = tr.heartbeat(conn, q.schema, worker_id=me, tasks=[(c.id, 1)], lease_seconds=30)
    assert (beat.lost, beat.cancel) == (set(), set())
    assert _cancel.requests(conn, q, worker_id=me, ids=[c.id]) == set()
    worker.cancel(conn, c.id, schema=schema)
    beat = tr.heartbeat(conn, q.schema, worker_id=me, tasks=[(c.id, 1)], lease_seconds=30)
    assert (beat.lost, beat.cancel) == (set(), {c.id})
    assert _cancel.requests(conn, q, worker_id=me, ids=[c.id, other.id]) == {c.id}
    assert _cancel.requests(conn, q, worker_id=them, ids=[c.id, other.id]) == set()
    # The marked row keeps its lease while its handler winds down.
    assert row(conn, schema, c.id)["lease_expires_at"] is not None


def test_retrying_a_cancelled_task_clears_the_request(
    conn: psycopg.Connection, schema: str
) -> None:
    """A task cancelled while it ran, then retried by an operator, runs to done: the old request
    does not cancel the new run."""
    c, me = _claimed(conn, schema)
    q = every_statement(schema)
    worker.cancel(conn, c.id, schema=schema)
    assert tr.complete(conn, q.schema, worker_id=me, done=[(c.id, 1)]) == {c.id: "cancelled"}
    assert tr.requeue(conn, schema, [c.id]).requeued == [c.id]
    r = row(conn, schema, c.id)
    assert r["cancel_requested_at"] is None and r["cancelled_by"] is None
    [again] = tr.claim(conn, q.schema, queues=["default"], limit=1, worker_id=me, lease_seconds=30)
    assert tr.complete(conn, q.schema, worker_id=me, done=[(again.id, again.attempt)]) == {
        c.id: "done"
    }


def test_the_console_cancels_queued_and_asks_running_tasks_to_stop(
    conn: psycopg.Connection, schema: str
) -> None:
    running, _ = _claimed(conn, schema)
    finished = _done_task(conn, schema)
    queued = enqueue(conn, schema, "cx.quick")
    out = console_cancel(conn, schema, [running.id, queued, finished, 424242], by="grace")
    assert (out.changed, out.requested) == (2, 1)
    assert row(conn, schema, queued)["state"] == "cancelled"
    r = row(conn, schema, running.id)
    assert r["state"] == "in_progress" and r["cancelled_by"] == "grace"
    assert row(conn, schema, finished)["state"] == "done"


def test_a_second_request_keeps_the_first_ones_name_and_time(
    conn: psycopg.Connection, schema: str
) -> None:
    c, _ = _claimed(conn, schema)
    worker.cancel(conn, c.id, by="first", schema=schema)
    first = row(conn, schema, c.id)
    time.sleep(0.05)
    assert worker.cancel(conn, c.id, by="second", schema=schema).outcome == "requested"
    again = row(conn, schema, c.id)
    assert again["cancelled_by"] == "first"
    assert again["cancel_requested_at"] == first["cancel_requested_at"]


def test_cancel_refuses_what_is_not_a_task_id(conn: psycopg.Connection, schema: str) -> None:
    for bad in (0, -1, 2**63, True, "12"):
        with pytest.raises(ValueError, match="positive 64-bit integer"):
            worker.cancel(conn, bad, schema=schema)  # type: ignore[arg-type]


def test_the_console_page_of_a_running_task_cancels_it(
    armed: MetricsServer,  # noqa: F811 - the fixture imported above
    conn: psycopg.Connection,
    schema: str,
) -> None:
    """Over HTTP, signed in as bob: the running task's page offers Cancel, the POST asks its
    worker to stop it and says so, and the page then shows who asked and when."""
    c, _ = _claimed(conn, schema)
    session, csrf = signed_in(armed)
    _, _, page = request(armed, "GET", f"/console/jobs/{c.id}", headers=session)
    assert f'action="/console/jobs/{c.id}/cancel"' in page
    status, headers, _ = request(
        armed, "POST", f"/console/jobs/{c.id}/cancel", {"csrf": csrf}, session
    )
    assert status == 303 and headers["location"] == f"/console/jobs/{c.id}"
    _, _, page = request(armed, "GET", f"/console/jobs/{c.id}", headers=session)
    assert f"task {c.id}: cancel requested; it is running, its worker will stop it" in page
    assert "requested by bob at" in page
    r = row(conn, schema, c.id)
    assert (r["state"], r["cancelled_by"]) == ("in_progress", "bob")
    audit = conn.execute(
        f"SELECT actor, action, (counts->>'changed')::int, source FROM {schema}.actions"
    ).fetchall()
    assert audit == [("bob", "cancel", 1, "console")]


def test_a_notification_without_ids_makes_the_worker_read_the_marks(
    conn: psycopg.Connection, schema: str, thread_worker: Any
) -> None:
    """The function sends an empty payload when the ids would not fit in one notification: the
    worker then reads the marks of every row it holds. A mark alone, with LISTEN up and the next
    heartbeat 10 s away, is not seen: the notification is what makes the worker look."""
    reg = worker.Registry()
    running, stopped = threading.Event(), threading.Event()

    @reg.task("loop")
    def loop(payload: dict, ctx: worker.Context) -> None:
        running.set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if ctx.cancelled:
                stopped.set()
            ctx.check()
            time.sleep(0.02)

    task_id = worker.enqueue(conn, "loop", {}, schema=schema)
    # A long lease puts the heartbeats 100 s apart, so none reads the mark in the 1.5 s below.
    with thread_worker(reg, lease_seconds=300) as tw:
        assert running.wait(10)
        wait_until(lambda: tw.worker.listening, timeout=10)
        # Listening, the worker asked the lease keeper to read the marks once (rows may have
        # been marked while nobody listened), and a claim asks it to renew: let both be done
        # before the mark, or a busy machine makes that read see it.
        lease = tw.worker.lease
        wait_until(lambda: not lease._check_cancels, timeout=10)
        time.sleep(1.0)
        conn.execute(
            f"UPDATE {schema}.tasks SET cancel_requested_at = now(), cancelled_by = 'sql'"
            " WHERE id = %s",
            (task_id,),
        )
        time.sleep(1.5)
        assert not stopped.is_set()
        conn.execute("SELECT pg_notify(%s, '')", (f"{schema}.tasks_cancel",))
        assert stopped.wait(2.0)
        r = ended_cancelled(conn, schema, task_id)
        assert r["cancelled_by"] == "sql"
