"""Handlers for tests/test_workflows.py (imported by the test and by `worker run` processes).

Every run is recorded in ``runs`` (task id, attempt, pid, start and end by the database clock,
the inputs the handler was given), through the handler's own autocommit connection, so a test
can check that no step ran twice at once and that a join ran once with its inputs in order.

Environment: WORKER_DSN, WORKER_SCHEMA (where to record).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

import worker

_local = threading.local()


def make_runs(conn: psycopg.Connection, schema: str) -> None:
    conn.execute(
        f"CREATE TABLE {schema}.runs (run bigserial PRIMARY KEY, task_id bigint, task text,"
        " attempt int, pid int, inputs jsonb, started timestamptz, ended timestamptz)"
    )


def _conn() -> psycopg.Connection:
    conn = getattr(_local, "conn", None)
    if conn is None or conn.closed:
        conn = psycopg.connect(os.environ["WORKER_DSN"], autocommit=True, connect_timeout=5)
        _local.conn = conn
    return conn


def _start(ctx: worker.Context) -> int:
    schema = os.environ["WORKER_SCHEMA"]
    row = (
        _conn()
        .execute(
            f"INSERT INTO {schema}.runs (task_id, task, attempt, pid, inputs, started)"
            " VALUES (%s, %s, %s, %s, %s, clock_timestamp()) RETURNING run",
            (ctx.task_id, ctx.task, ctx.attempt, os.getpid(), Jsonb(ctx.inputs)),
        )
        .fetchone()
    )
    return row[0]


def _end(run: int) -> None:
    schema = os.environ["WORKER_SCHEMA"]
    _conn().execute(f"UPDATE {schema}.runs SET ended = clock_timestamp() WHERE run = %s", (run,))


@worker.task("wf.add", max_attempts=3, retry_backoff=0.1)
def add(payload: dict[str, Any], ctx: worker.Context) -> int:
    """Its payload's n plus the sum of its inputs."""
    run = _start(ctx)
    time.sleep(float(payload.get("s", 0)))
    _end(run)
    return int(payload.get("n", 0)) + sum(int(i or 0) for i in ctx.inputs)


@worker.task("wf.at", max_attempts=3, retry_backoff=0.1)
def at(payload: dict[str, Any], ctx: worker.Context) -> int:
    """Sleep until the wall-clock time ``at`` (seconds since the epoch), then return ``n``: many
    of them finish at the same instant."""
    run = _start(ctx)
    time.sleep(max(0.0, float(payload["at"]) - time.time()))
    _end(run)
    return int(payload["n"])


@worker.task("wf.collect", max_attempts=3, retry_backoff=0.1)
def collect(payload: dict[str, Any], ctx: worker.Context) -> list[Any]:
    """A join: returns its inputs as given."""
    run = _start(ctx)
    _end(run)
    return list(ctx.inputs)


@worker.task("wf.fail", max_attempts=1)
def fail(payload: dict[str, Any]) -> None:
    raise worker.DoNotRetry(payload.get("why", "this step fails"))


@worker.task("wf.noop_sum")
def noop_sum(payload: dict[str, Any], ctx: worker.Context) -> int:
    """add without a record: for worker.testing.run_workflow, which needs no database."""
    return int(payload.get("n", 0)) + sum(int(i or 0) for i in ctx.inputs)


@worker.task("wf.count_inputs")
def count_inputs(payload: dict[str, Any], ctx: worker.Context) -> int:
    return len(ctx.inputs)


@worker.task("wf.noop", max_attempts=3, retry_backoff=0.1)
def noop(payload: dict[str, Any]) -> None:
    return None


@worker.task("wf.sleep", max_attempts=3, retry_backoff=0.1)
def sleep(payload: dict[str, Any], ctx: worker.Context) -> int:
    run = _start(ctx)
    until = time.monotonic() + float(payload.get("s", 0.01))
    try:
        while (left := until - time.monotonic()) > 0:
            ctx.check()  # a cancel request (or a graceful stop) stops it
            time.sleep(min(left, 0.05))
    finally:
        _end(run)
    return int(payload.get("n", 0))


@worker.task("wf.offline", max_attempts=3, retry_backoff=0.1)
def offline(payload: dict[str, Any], ctx: worker.Context) -> int:
    """add without a record, after a pause: a step that needs no database of its own (so a
    database outage fails none of its attempts)."""
    time.sleep(float(payload.get("s", 0)))
    return int(payload.get("n", 0)) + sum(int(i or 0) for i in ctx.inputs)
