"""worker.testing: run due tasks inside the test's own transaction, and check what was enqueued.

Each test works on a connection with a transaction open, as a user's test would, and checks from
a second connection that a rollback leaves nothing behind."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest

import worker
from worker import testing
from worker.tasks.registry import Registry


@pytest.fixture
def tx(pg_dsn: str, schema: str) -> Iterator[psycopg.Connection]:
    """A connection whose transaction the test rolls back, as the README's fixture does (it
    ends before the schema is dropped, which would wait for its locks)."""
    with psycopg.connect(pg_dsn) as conn:  # not autocommit: the first statement opens it
        yield conn
        conn.rollback()


def count_rows(conn: psycopg.Connection, schema: str) -> int:
    row = conn.execute(f"SELECT count(*) FROM {schema}.tasks").fetchone()
    assert row is not None
    return int(row[0])


def test_runs_what_the_same_transaction_enqueued_and_rolls_back(
    tx: psycopg.Connection, conn: psycopg.Connection, schema: str
) -> None:
    reg = Registry()
    seen: list[dict] = []

    @reg.task("send_email", queue="mail")
    def send_email(payload: dict) -> None:
        seen.append(payload)

    worker.enqueue(tx, "send_email", {"to": "a@b.c"}, queue="mail", schema=schema)
    summary = testing.run_due(tx, reg, schema=schema)

    assert seen == [{"to": "a@b.c"}]
    assert (summary.ran, len(summary.succeeded), summary.failed) == (1, 1, [])
    [row] = testing.enqueued(tx, "send_email", schema=schema)
    assert (row.state, row.attempts, row.queue) == ("done", 1, "mail")
    # Nothing was committed: another session sees no row, and none after the rollback.
    assert count_rows(conn, schema) == 0
    tx.rollback()
    assert count_rows(conn, schema) == 0
    assert testing.run_due(tx, reg, schema=schema).ran == 0


def test_a_failure_is_retried_with_backoff_and_does_not_loop(
    tx: psycopg.Connection, schema: str
) -> None:
    reg = Registry()
    calls = []

    @reg.task("flaky", max_attempts=3, retry_backoff=10)
    def flaky(payload: dict) -> None:
        calls.append(payload)
        raise RuntimeError("smtp is down")

    task_id = worker.enqueue(tx, "flaky", {"n": 1}, schema=schema)
    summary = testing.run_due(tx, reg, schema=schema)
    # One attempt: the retry is scheduled after its backoff, which never comes in a transaction.
    assert len(calls) == 1
    [run] = summary.failed
    assert (run.id, run.attempt, run.state) == (task_id, 1, "scheduled")
    assert run.error is not None and run.error.startswith("RuntimeError: smtp is down")
    [row] = testing.enqueued(tx, "flaky", schema=schema)
    assert (row.state, row.attempts, row.max_attempts) == ("scheduled", 1, 3)
    assert row.last_error is not None and "smtp is down" in row.last_error
    with pytest.raises(AssertionError, match=r"#\d+ flaky attempt 1 -> scheduled: RuntimeError"):
        summary.check()

    # "As of" a day later every retry is due at once: it runs until its attempts are used up.
    later = testing.run_due(tx, reg, schema=schema, now=timedelta(days=1))
    assert [r.state for r in later.runs] == ["scheduled", "failed"]
    [row] = testing.enqueued(tx, "flaky", schema=schema)
    assert (row.state, row.attempts) == ("failed", 3)


def test_do_not_retry_fails_at_once(tx: psycopg.Connection, schema: str) -> None:
    reg = Registry()

    @reg.task("check")
    def check(payload: dict) -> None:
        raise worker.DoNotRetry("not an email address")

    worker.enqueue(tx, "check", schema=schema)
    [run] = testing.run_due(tx, reg, schema=schema).failed
    assert run.state == "failed"
    assert testing.enqueued(tx, schema=schema)[0].state == "failed"


def test_delayed_tasks_wait_until_now_says_they_are_due(
    tx: psycopg.Connection, schema: str
) -> None:
    reg = Registry()
    ran = []
    reg.task("later")(lambda payload: ran.append(payload))
    worker.enqueue(tx, "later", {"x": 1}, delay=600, schema=schema)

    assert testing.run_due(tx, reg, schema=schema).ran == 0
    assert testing.run_due(tx, reg, schema=schema, now=timedelta(minutes=5)).ran == 0
    assert testing.run_due(tx, reg, schema=schema, now=timedelta(minutes=11)).ran == 1
    assert ran == [{"x": 1}]


def test_async_context_and_transactional_handlers(
    tx: psycopg.Connection, conn: psycopg.Connection, schema: str
) -> None:
    reg = Registry()
    tx.execute(f"CREATE TABLE {schema}.notes (body text)")
    got: list[tuple[str, int]] = []

    @reg.task("async_one")
    async def async_one(payload: dict, ctx: worker.Context) -> None:
        got.append((ctx.task, ctx.attempt))

    @reg.task("write", transactional=True)
    def write(payload: dict, ctx: worker.Context) -> None:
        assert ctx.conn is not None
        ctx.conn.execute(f"INSERT INTO {schema}.notes VALUES (%s)", [payload["body"]])
        # A follow-up enqueued on the same connection runs in the same run_due.
        worker.enqueue(ctx.conn, "async_one", schema=schema)
        if payload["body"] == "bad":
            raise ValueError("rejected")

    worker.enqueue(tx, "write", {"body": "good"}, schema=schema)
    worker.enqueue(tx, "write", {"body": "bad"}, schema=schema)
    summary = testing.run_due(tx, reg, schema=schema)

    assert got == [("async_one", 1)]
    assert [(r.task, r.state) for r in summary.runs] == [
        ("write", "done"),
        ("write", "scheduled"),
        ("async_one", "done"),
    ]
    # The failing handler's writes (its note, its follow-up) rolled back with its savepoint.
    notes = tx.execute(f"SELECT body FROM {schema}.notes").fetchall()
    assert notes == [("good",)]
    assert len(testing.enqueued(tx, "async_one", schema=schema)) == 1


def test_unknown_tasks_are_handed_back_and_reported(tx: psycopg.Connection, schema: str) -> None:
    worker.enqueue(tx, "typo_task", schema=schema)
    summary = testing.run_due(tx, Registry(), schema=schema)
    [run] = summary.handed_back
    assert (summary.ran, run.state) == (0, "scheduled")
    assert "UnknownTask: no handler named 'typo_task'" in (run.error or "")
    with pytest.raises(AssertionError, match="typo_task"):
        summary.check()
    [row] = testing.enqueued(tx, schema=schema)
    assert row.attempts == 0  # not counted, as a worker would hand it back


def test_limit_stops_a_task_that_enqueues_itself(tx: psycopg.Connection, schema: str) -> None:
    reg = Registry()

    @reg.task("again", transactional=True)
    def again(payload: dict, ctx: worker.Context) -> None:
        worker.enqueue(ctx.conn, "again", schema=schema)

    worker.enqueue(tx, "again", schema=schema)
    assert testing.run_due(tx, reg, schema=schema, limit=7).ran == 7


def test_only_the_given_queues_run(tx: psycopg.Connection, schema: str) -> None:
    reg = Registry()
    reg.task("a", queue="one")(lambda p: None)
    reg.task("b", queue="two")(lambda p: None)
    worker.enqueue(tx, "a", queue="one", schema=schema)
    worker.enqueue(tx, "b", queue="two", schema=schema)
    assert [r.task for r in testing.run_due(tx, reg, schema=schema, queues=["two"]).runs] == ["b"]


def test_assert_enqueued_matches_and_says_what_was_there(
    tx: psycopg.Connection, schema: str
) -> None:
    worker.enqueue(tx, "send_email", {"to": "a@b.c"}, queue="mail", priority=5, schema=schema)
    worker.enqueue(tx, "resize", {"w": 10}, schema=schema)

    [row] = testing.assert_enqueued(tx, "send_email", {"to": "a@b.c"}, schema=schema)
    assert (row.queue, row.priority, row.state) == ("mail", 5, "queued")
    testing.assert_enqueued(tx, "resize", schema=schema, count=1)
    testing.assert_enqueued(tx, "nothing", schema=schema, count=0)

    with pytest.raises(AssertionError) as failure:
        testing.assert_enqueued(tx, "send_email", {"to": "x@y.z"}, schema=schema)
    message = str(failure.value)
    assert message.startswith(
        'expected at least 1 task(s) \'send_email\' with payload {"to": "x@y.z"}, found 0'
    )
    assert 'send_email queue=mail state=queued priority=5 payload={"to": "a@b.c"}' in message
    assert 'resize queue=default state=queued priority=0 payload={"w": 10}' in message

    with pytest.raises(AssertionError, match=r"expected 1 task\(s\) 'send_email' in queue 'x'"):
        testing.assert_enqueued(tx, "send_email", queue="x", count=1, schema=schema)


def test_a_transactional_step_hands_its_result_to_the_next_in_run_due(
    tx: psycopg.Connection, schema: str
) -> None:
    """A chain whose first step is transactional: run_due completes it with its result and
    releases the second step, as a worker does, and the second reads that result."""
    reg = Registry()
    seen: list[list] = []

    @reg.task("first", transactional=True)
    def first(payload: dict, ctx: worker.Context) -> int:
        assert ctx.conn is not None
        return 41

    @reg.task("second")
    def second(payload: dict, ctx: worker.Context) -> None:
        seen.append(list(ctx.inputs))

    flow = worker.chain(worker.step(first), worker.step(second))
    worker.enqueue_workflow(tx, flow, schema=schema)
    summary = testing.run_due(tx, reg, schema=schema)
    assert [(r.task, r.state) for r in summary.runs] == [("first", "done"), ("second", "done")]
    assert seen == [[41]]
