"""Handlers for tests that run real `worker run` processes (tests/ is on their PYTHONPATH).

Each execution is recorded in the schema's `executions` table by the handler's own connection,
so a test can prove which process ran what, when, and how many times.
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
        conn = psycopg.connect(os.environ["WORKER_DSN"], autocommit=True)
        _local.conn = conn
    return conn


def _record(ctx: worker.Context, started: float) -> None:
    schema = os.environ["WORKER_SCHEMA"]
    _conn().execute(
        f"INSERT INTO {schema}.executions (task_id, attempt, pid, started, finished)"
        " VALUES (%s, %s, %s, to_timestamp(%s), clock_timestamp())",
        (ctx.task_id, ctx.attempt, os.getpid(), started),
    )


@worker.task("record")
def record(payload: dict[str, Any], ctx: worker.Context) -> None:
    started = time.time()
    time.sleep(float(payload.get("sleep", 0)))
    _record(ctx, started)


@worker.task("slow")
def slow(payload: dict[str, Any], ctx: worker.Context) -> None:
    started = time.time()
    time.sleep(float(payload.get("sleep", 5)))
    _record(ctx, started)


@worker.task("noop")
def noop(payload: dict[str, Any]) -> None:
    """As cheap as a task gets: the worker spends its time claiming and acknowledging."""


@worker.task("boom", max_attempts=2, retry_backoff=0.1)
def boom(payload: dict[str, Any]) -> None:
    raise ValueError(f"boom {payload}")
