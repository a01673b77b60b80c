"""Handlers for the composition tests (tests/ is on the PYTHONPATH of `worker run` processes).

Every run writes a row to the schema's `runs` table: when it started and ended by the database
clock (clock_timestamp()) and when it started by the handler's own clock (time.time(), what the
service a rate limit protects would see). The tests create the table and set the limits.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import psycopg

import worker

_local = threading.local()


def _conn() -> psycopg.Connection:
    conn = getattr(_local, "conn", None)
    if conn is None or conn.closed:
        conn = psycopg.connect(os.environ["WORKER_DSN"], autocommit=True, connect_timeout=5)
        _local.conn = conn
    return conn


def _run(payload: dict[str, Any], ctx: worker.Context) -> None:
    schema = os.environ["WORKER_SCHEMA"]
    wall = time.time()
    row = (
        _conn()
        .execute(
            f"INSERT INTO {schema}.runs (task_id, attempt, queue, pid, started, wall)"
            " VALUES (%s, %s, %s, %s, clock_timestamp(), %s) RETURNING id",
            (ctx.task_id, ctx.attempt, ctx.queue, os.getpid(), wall),
        )
        .fetchone()
    )
    assert row is not None
    deadline = time.monotonic() + float(payload.get("sleep", 0))
    while time.monotonic() < deadline and not ctx.cancelled:
        time.sleep(0.01)
    _conn().execute(f"UPDATE {schema}.runs SET finished = clock_timestamp() WHERE id = %s", row)


@worker.task("lim.run", queue="lim")
def lim_run(payload: dict[str, Any], ctx: worker.Context) -> None:
    _run(payload, ctx)


@worker.task("plain.run", queue="plain")
def plain_run(payload: dict[str, Any], ctx: worker.Context) -> None:
    _run(payload, ctx)


@worker.task("rated.run", queue="rated")
def rated_run(payload: dict[str, Any], ctx: worker.Context) -> None:
    _run(payload, ctx)


# -- workflow steps (tests/test_composition.py): each returns what its dependents receive ------


def _step(payload: dict[str, Any], ctx: worker.Context) -> dict[str, Any]:
    """Record the run, work ``sleep`` seconds (stopping on a cancel or a graceful stop: the row
    goes back to the queue, or ends cancelled), and return which attempt of which step this was,
    with the inputs it was given."""
    schema = os.environ["WORKER_SCHEMA"]
    wall = time.time()
    row = (
        _conn()
        .execute(
            f"INSERT INTO {schema}.runs (task_id, attempt, queue, pid, started, wall)"
            " VALUES (%s, %s, %s, %s, clock_timestamp(), %s) RETURNING id",
            (ctx.task_id, ctx.attempt, ctx.queue, os.getpid(), wall),
        )
        .fetchone()
    )
    assert row is not None
    try:
        deadline = time.monotonic() + float(payload.get("sleep", 0))
        while time.monotonic() < deadline:
            ctx.check()
            time.sleep(0.01)
        if ctx.attempt <= int(payload.get("fail_attempts", 0)):
            raise RuntimeError(f"attempt {ctx.attempt} of step {payload['n']} failed")
    finally:
        _conn().execute(f"UPDATE {schema}.runs SET finished = clock_timestamp() WHERE id = %s", row)
    return {"n": payload["n"], "attempt": ctx.attempt, "inputs": ctx.inputs}


@worker.task("flow.plain", queue="plain", max_attempts=3, retry_backoff=0.1)
def flow_plain(payload: dict[str, Any], ctx: worker.Context) -> dict[str, Any]:
    return _step(payload, ctx)


@worker.task("flow.lim", queue="lim", max_attempts=3, retry_backoff=0.1)
def flow_lim(payload: dict[str, Any], ctx: worker.Context) -> dict[str, Any]:
    return _step(payload, ctx)
