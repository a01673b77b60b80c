"""What a worker does with each task: run it, retry it, fail it, order it, and give it back."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from conftest import states, wait_until

import worker
from worker import store


def _row(conn: psycopg.Connection, schema: str, task_id: int) -> dict[str, Any]:
    cur = conn.execute(
        f"SELECT state::text, attempts, last_error, run_at, finished_at FROM {schema}.tasks"
        " WHERE id = %s",
        (task_id,),
    )
    state, attempts, error, run_at, finished = cur.fetchone()
    return {
        "state": state,
        "attempts": attempts,
        "error": error,
        "run_at": run_at,
        "finished": finished,
    }


def test_sync_and_async_handlers_get_payload_and_context(
    conn: psycopg.Connection, schema: str, thread_worker
) -> None:
    seen: dict[str, Any] = {}
    reg = worker.Registry()

    @reg.task("plain")
    def plain(payload: dict) -> None:
        seen["plain"] = payload

    @reg.task("with_ctx")
    def with_ctx(payload: dict, ctx: worker.Context) -> None:
        seen["ctx"] = (ctx.task_id, ctx.attempt, ctx.task, ctx.queue)

    @reg.task("coro")
    async def coro(payload: dict) -> None:
        await asyncio.sleep(0.01)
        seen["coro"] = payload

    a = worker.enqueue(conn, "plain", {"a": 1}, schema=schema)
    b = worker.enqueue(conn, "with_ctx", {}, schema=schema)
    worker.enqueue(conn, "coro", [1, 2], schema=schema)
    with thread_worker(reg):
        wait_until(lambda: states(conn, schema) == {"done": 3})
    assert seen == {"plain": {"a": 1}, "ctx": (b, 1, "with_ctx", "default"), "coro": [1, 2]}
    assert a != b


def test_failing_handler_is_retried_with_backoff_then_failed(
    conn: psycopg.Connection, schema: str, thread_worker
) -> None:
    attempts: list[float] = []
    reg = worker.Registry()

    @reg.task("flaky", retry_backoff=0.4)
    def flaky(payload: dict) -> None:
        attempts.append(time.monotonic())
        raise ValueError("remote said no")

    task_id = worker.enqueue(conn, "flaky", {}, max_attempts=3, schema=schema)
    with thread_worker(reg, poll_interval=0.05):
        wait_until(lambda: _row(conn, schema, task_id)["state"] == "failed", timeout=30)
    row = _row(conn, schema, task_id)
    assert row["attempts"] == 3 and len(attempts) == 3
    assert row["error"].startswith("ValueError: remote said no")
    assert "raise ValueError" in row["error"]  # the traceback tail points at the line
    assert row["finished"] is not None
    # Exponential backoff with jitter in [d/2, d]: d = 0.4 s then 0.8 s.
    gaps = [b - a for a, b in itertools.pairwise(attempts)]
    assert gaps[0] >= 0.2 and gaps[1] >= 0.4, gaps


def test_sql_producers_get_the_handlers_max_attempts_unless_they_set_one(
    conn: psycopg.Connection, schema: str, thread_worker
) -> None:
    """A plain INSERT leaves max_attempts to the handler: registered with max_attempts=2, the task
    fails after two attempts, not the table's five. A number the producer wrote wins. A task no
    handler of this worker knows is handed back uncounted, its max_attempts still the handler's
    to decide (see test_routing.py for the rest of that story)."""
    reg = worker.Registry()
    runs: list[int] = []

    @reg.task("twice", max_attempts=2, retry_backoff=0)
    def twice(payload: dict) -> None:
        runs.append(payload["n"])
        raise ValueError("no")

    conn.execute(f"INSERT INTO {schema}.tasks (task, payload) VALUES ('twice', '{{\"n\": 1}}')")
    conn.execute(
        f"INSERT INTO {schema}.tasks (task, payload, max_attempts)"
        " VALUES ('twice', '{\"n\": 2}', 4)"
    )
    unknown = worker.enqueue(conn, "nobody_handles_this", schema=schema)
    with thread_worker(reg, poll_interval=0.05):
        wait_until(lambda: states(conn, schema) == {"failed": 2, "scheduled": 1}, timeout=30)
    rows = conn.execute(
        f"SELECT payload->>'n', attempts, max_attempts FROM {schema}.tasks"
        " WHERE task = 'twice' ORDER BY id"
    ).fetchall()
    assert rows == [("1", 2, 2), ("2", 4, 4)]
    assert sorted(runs) == [1, 1, 2, 2, 2, 2]
    row = conn.execute(
        f"SELECT state::text, attempts, max_attempts, handed_back, last_error FROM {schema}.tasks"
        " WHERE id = %s",
        (unknown,),
    ).fetchone()
    assert row is not None and row[:4] == ("scheduled", 0, None, 1), row
    assert row[4].startswith("UnknownTask: no handler named 'nobody_handles_this'")


def test_retry_moves_run_at_into_the_future(
    conn: psycopg.Connection, schema: str, thread_worker
) -> None:
    reg = worker.Registry()
    reg.task("fails_once", retry_backoff=60)(lambda p: (_ for _ in ()).throw(KeyError("k")))
    task_id = worker.enqueue(conn, "fails_once", {}, schema=schema)
    with thread_worker(reg):
        wait_until(
            lambda: (
                _row(conn, schema, task_id)["attempts"] == 1
                and _row(conn, schema, task_id)["state"] == "scheduled"
            )
        )
    row = _row(conn, schema, task_id)
    delay = (row["run_at"] - datetime.now(UTC)).total_seconds()
    assert 25 < delay <= 60, delay
    assert row["error"].startswith("KeyError")


def test_do_not_retry_fails_at_once(conn: psycopg.Connection, schema: str, thread_worker) -> None:
    reg = worker.Registry()

    @reg.task("validate")
    def validate(payload: dict) -> None:
        if "email" not in payload:
            raise worker.DoNotRetry("payload has no 'email'")

    bad = worker.enqueue(conn, "validate", {"name": "x"}, schema=schema)
    good = worker.enqueue(conn, "validate", {"email": "a@b"}, schema=schema)
    with thread_worker(reg):
        wait_until(lambda: states(conn, schema) == {"failed": 1, "done": 1})
    row = _row(conn, schema, bad)
    assert row["attempts"] == 1
    assert row["error"].startswith("DoNotRetry: payload has no 'email'")
    assert _row(conn, schema, good)["state"] == "done"


def test_unknown_task_is_handed_back_uncounted_until_a_worker_with_its_handler_comes(
    conn: psycopg.Connection, schema: str, thread_worker
) -> None:
    """A rolling deploy: an old worker without the handler claims a new task. It must not burn
    the task's attempts (max_attempts=1 here: one counted attempt would fail it for good). The
    row goes back as scheduled, uncounted, later each time, with an error that says why; the
    moment a worker that has the handler starts, it takes the row without waiting out the
    delay."""
    old = worker.Registry()
    old.task("known")(lambda p: None)
    task_id = worker.enqueue(conn, "new_task", {}, max_attempts=1, schema=schema)
    with thread_worker(old):
        wait_until(lambda: _row(conn, schema, task_id)["state"] == "scheduled")
    row = _row(conn, schema, task_id)
    assert row["attempts"] == 0
    assert "no handler named 'new_task'" in row["error"] and "known" in row["error"]
    delay = conn.execute(
        f"SELECT extract(epoch FROM run_at - now()), handed_back FROM {schema}.tasks WHERE id = %s",
        (task_id,),
    ).fetchone()
    assert delay is not None and 3 < delay[0] <= 5 and delay[1] == 1, delay
    # Handed back again (the clock moved on): the delay doubles, still uncounted.
    conn.execute(f"UPDATE {schema}.tasks SET run_at = now() WHERE id = %s", (task_id,))
    with thread_worker(old):
        wait_until(
            lambda: (
                conn.execute(
                    f"SELECT handed_back FROM {schema}.tasks WHERE id = %s", (task_id,)
                ).fetchone()
                == (2,)
            )
        )
    delay = conn.execute(
        f"SELECT extract(epoch FROM run_at - now()), attempts, state::text FROM {schema}.tasks"
        " WHERE id = %s",
        (task_id,),
    ).fetchone()
    assert delay is not None and 8 < delay[0] <= 10 and delay[1:] == (0, "scheduled"), delay

    new = worker.Registry()
    ran: list[int] = []
    new.task("new_task")(lambda p: ran.append(1))
    started = time.monotonic()
    with thread_worker(new):
        wait_until(lambda: _row(conn, schema, task_id)["state"] == "done", timeout=5)
    assert time.monotonic() - started < 5 and ran == [1]
    assert _row(conn, schema, task_id)["attempts"] == 1


def test_handler_past_its_timeout_keeps_its_row_until_it_returns_then_is_retried(
    conn: psycopg.Connection, schema: str, thread_worker
) -> None:
    """An async handler is cancelled at its timeout and retried. A sync handler cannot be
    stopped: its row stays in_progress and leased while its thread still runs (no worker may
    start it again), and once it returns the attempt is recorded as timed out and retried."""
    release = threading.Event()
    reg = worker.Registry()

    @reg.task("hangs", timeout=0.3, retry_backoff=0)
    def hangs(payload: dict, ctx: worker.Context) -> None:
        if ctx.attempt == 1:
            release.wait(30)

    @reg.task("async_hangs", timeout=0.3, retry_backoff=0)
    async def async_hangs(payload: dict) -> None:
        await asyncio.sleep(10)

    a = worker.enqueue(conn, "hangs", {}, max_attempts=2, schema=schema)
    b = worker.enqueue(conn, "async_hangs", {}, max_attempts=2, schema=schema)
    try:
        with thread_worker(reg, concurrency=4, lease_seconds=1.0):
            wait_until(lambda: _row(conn, schema, b)["state"] == "failed", timeout=20)
            time.sleep(1.5)  # a is well past its timeout, and past its first lease
            row = _row(conn, schema, a)
            assert (row["state"], row["attempts"]) == ("in_progress", 1)
            release.set()
            wait_until(lambda: _row(conn, schema, a)["state"] == "done", timeout=20)
    finally:
        release.set()
    row = _row(conn, schema, a)
    assert row["attempts"] == 2
    assert row["error"].startswith("TimeoutError: handler ran"), row["error"]
    assert "past its timeout of 0.3s" in row["error"]
    row = _row(conn, schema, b)
    assert row["attempts"] == 2
    assert "TimeoutError" in row["error"] and "0.3s" in row["error"]


def test_handler_exceptions_never_kill_the_worker(
    conn: psycopg.Connection, schema: str, thread_worker
) -> None:
    reg = worker.Registry()

    @reg.task("exits")
    def exits(payload: dict) -> None:
        raise SystemExit(3)

    @reg.task("wrong_shape")
    def wrong_shape(payload: dict) -> None:
        payload["needed"]  # the payload is a list: TypeError

    @reg.task("fine")
    def fine(payload: dict) -> None:
        pass

    worker.enqueue(conn, "exits", {}, max_attempts=1, schema=schema)
    worker.enqueue(conn, "wrong_shape", [1], max_attempts=1, schema=schema)
    with thread_worker(reg) as tw:
        wait_until(lambda: states(conn, schema) == {"failed": 2})
        worker.enqueue(conn, "fine", {}, schema=schema)
        wait_until(lambda: states(conn, schema).get("done") == 1)
        assert tw.thread.is_alive()
    errors = [
        r[0]
        for r in conn.execute(
            f"SELECT last_error FROM {schema}.tasks WHERE state = 'failed' ORDER BY id"
        )
    ]
    assert errors[0].startswith("SystemExit: 3")
    assert errors[1].startswith("TypeError")


def test_priority_then_run_at_order(conn: psycopg.Connection, schema: str, thread_worker) -> None:
    order: list[str] = []
    reg = worker.Registry()
    reg.task("o")(lambda p: order.append(p["name"]))
    now = datetime.now(UTC)
    # Enqueued out of order on purpose.
    for name, priority, age in [
        ("low-old", 0, 30),
        ("high-new", 5, 1),
        ("mid", 2, 10),
        ("high-old", 5, 20),
        ("low-new", 0, 2),
        ("neg", -3, 100),
    ]:
        worker.enqueue(
            conn,
            "o",
            {"name": name},
            priority=priority,
            run_at=now - timedelta(seconds=age),
            schema=schema,
        )
    with thread_worker(reg, concurrency=1, batch_size=1):
        wait_until(lambda: len(order) == 6)
    assert order == ["high-old", "high-new", "mid", "low-old", "low-new", "neg"]


def test_delayed_task_waits_for_run_at(
    conn: psycopg.Connection, schema: str, thread_worker
) -> None:
    ran: list[float] = []
    reg = worker.Registry()
    reg.task("later")(lambda p: ran.append(time.time()))
    start = time.time()
    worker.enqueue(conn, "later", {}, delay=1.5, schema=schema)
    with thread_worker(reg, poll_interval=0.1):
        wait_until(lambda: ran, timeout=15)
    assert ran[0] - start >= 1.4


def test_idle_worker_wakes_on_notify_not_on_poll(
    conn: psycopg.Connection, schema: str, thread_worker
) -> None:
    """With a 60 s poll interval only LISTEN/NOTIFY can explain a prompt start."""
    ran = threading.Event()
    reg = worker.Registry()
    reg.task("ping")(lambda p: ran.set())
    with thread_worker(reg, poll_interval=60):
        time.sleep(1.0)  # let it go idle and LISTEN
        conn.execute(f"INSERT INTO {schema}.tasks (task) VALUES ('ping')")
        assert ran.wait(10), "idle worker did not wake up on NOTIFY"


def test_an_in_process_stop_never_hands_back_a_task_whose_handler_still_runs(
    conn: psycopg.Connection, schema: str, thread_worker, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker on a thread of this process, stopped with a 1 s grace while three handlers run:
    one finishes in time (done); one checks ctx.cancelled, which turns true when the stop begins,
    and stops (its task goes back to the queue, the attempt not counted); one ignores it and runs
    on past the grace. That one is not handed back while its thread runs: its row keeps its
    lease (another worker must not start it meanwhile), and the stop says so in one line."""
    started = threading.Barrier(4)
    saw_stop = threading.Event()
    reg = worker.Registry()

    @reg.task("stubborn")
    def stubborn(payload: dict) -> None:
        started.wait(10)
        time.sleep(4)

    @reg.task("polite")
    def polite(payload: dict, ctx: worker.Context) -> None:
        started.wait(10)
        while not ctx.cancelled:
            time.sleep(0.01)
        saw_stop.set()
        ctx.check()

    @reg.task("short")
    def short(payload: dict) -> None:
        started.wait(10)
        time.sleep(0.2)

    a = worker.enqueue(conn, "stubborn", {}, schema=schema)
    b = worker.enqueue(conn, "polite", {}, schema=schema)
    c = worker.enqueue(conn, "short", {}, schema=schema)
    tw = thread_worker(reg, grace_seconds=1.0)
    with caplog.at_level("WARNING", logger="worker"), tw:
        started.wait(10)
        time.sleep(0.3)  # the short one is done
        began = time.monotonic()
        tw.stop()
        assert time.monotonic() - began < 3.0
    assert saw_stop.is_set()
    assert _row(conn, schema, c)["state"] == "done"
    polite_row = _row(conn, schema, b)
    assert (polite_row["state"], polite_row["attempts"]) == ("queued", 0)
    stubborn_row = _row(conn, schema, a)
    assert (stubborn_row["state"], stubborn_row["attempts"]) == ("in_progress", 1)
    leased = conn.execute(
        f"SELECT lease_expires_at > now() FROM {schema}.tasks WHERE id = %s", (a,)
    ).fetchone()
    assert leased == (True,)
    # Another worker started now finds nothing to take until that lease lapses.
    other = store.claim(
        conn, schema, queues=["default"], limit=10, worker_id=str(uuid.uuid4()), lease_seconds=30
    )
    assert [r.id for r in other] == [b]  # the polite one, given back; not the one still running
    assert tw.worker.left_running == [a]
    said = [r.getMessage() for r in caplog.records if "still running" in r.getMessage()]
    assert len(said) == 1 and str(a) in said[0]
    workers = conn.execute(f"SELECT stopped_at IS NOT NULL FROM {schema}.workers").fetchall()
    assert workers == [(True,)]


def test_keep_done_zero_deletes_rows_on_completion(
    conn: psycopg.Connection, schema: str, thread_worker
) -> None:
    reg = worker.Registry()
    reg.task("gone")(lambda p: None)
    worker.enqueue_many(conn, "gone", [{}] * 50, schema=schema)
    with thread_worker(reg, keep_done_seconds=0):
        wait_until(lambda: states(conn, schema) == {})


def test_purge_deletes_finished_rows_past_retention(
    conn: psycopg.Connection, schema: str, thread_worker
) -> None:
    t = f"{schema}.tasks"
    conn.execute(
        f"INSERT INTO {t} (task, state, finished_at) SELECT 'x', 'done',"
        " now() - interval '2 hours' FROM generate_series(1, 7000)"
    )
    conn.execute(
        f"INSERT INTO {t} (task, state, finished_at) VALUES"
        " ('recent', 'done', now()), ('oldfail', 'failed', now() - interval '2 hours')"
    )
    reg = worker.Registry()
    with thread_worker(reg, keep_done_seconds=3600, purge_interval=0.1):
        wait_until(lambda: conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0] == 2)
    left = {r[0] for r in conn.execute(f"SELECT task FROM {t}")}
    assert left == {"recent", "oldfail"}  # failed rows are kept for keep_failed (7 days)


def test_many_tasks_each_run_exactly_once_in_one_process(
    conn: psycopg.Connection, schema: str, thread_worker
) -> None:
    counts: dict[int, int] = {}
    lock = threading.Lock()
    reg = worker.Registry()

    @reg.task("count")
    def count(payload: dict) -> None:
        with lock:
            counts[payload["i"]] = counts.get(payload["i"], 0) + 1

    worker.enqueue_many(conn, "count", ({"i": i} for i in range(5000)), schema=schema)
    with thread_worker(reg, concurrency=16, batch_size=50):
        wait_until(lambda: states(conn, schema) == {"done": 5000}, timeout=60)
    assert len(counts) == 5000 and set(counts.values()) == {1}
