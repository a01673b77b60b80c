"""Handlers for the fault-tolerance tests (tests/ is on the PYTHONPATH of `worker run` processes).

Like tasks_module, but each execution row also names the worker id (``ctx.worker_id``), so a test
can tie every run of a task to the process that claimed it. The tests create the table
(test_pool.create_tables); this module is imported only by worker processes.

Environment read at import:
- WORKER_DSN, WORKER_SCHEMA: where the handlers record their executions.
- FAULTS_CHILD_DIES=1: a supervised child process (WORKER_CHILD_SLOT is set) exits with status 1
  while importing this module, so the import succeeds in the supervisor and every child it
  starts dies before reaching its loop: a crash loop the supervisor must give up on.
- FAULTS_CHILD_IMPORT_SECONDS: a supervised child sleeps this long while importing this module.
"""

from __future__ import annotations

import os
import re
import threading
import time
from typing import Any

import psycopg

import worker

if os.environ.get("FAULTS_CHILD_DIES") == "1" and "WORKER_CHILD_SLOT" in os.environ:
    os._exit(1)
if "WORKER_CHILD_SLOT" in os.environ:
    # A slow application import (a big framework, say), in supervised children only.
    time.sleep(float(os.environ.get("FAULTS_CHILD_IMPORT_SECONDS", "0")))

_local = threading.local()


def _conn() -> psycopg.Connection:
    conn = getattr(_local, "conn", None)
    if conn is None or conn.closed:
        conn = psycopg.connect(os.environ["WORKER_DSN"], autocommit=True, connect_timeout=5)
        _local.conn = conn
    return conn


def _record(ctx: worker.Context, started: float) -> None:
    schema = os.environ["WORKER_SCHEMA"]
    query = (
        f"INSERT INTO {schema}.executions (task_id, attempt, pid, worker_id, started, finished)"
        " VALUES (%s, %s, %s, %s, to_timestamp(%s), clock_timestamp())"
    )
    args = (ctx.task_id, ctx.attempt, os.getpid(), ctx.worker_id, started)
    try:
        _conn().execute(query, args)
    except psycopg.OperationalError:
        # The recording connection was cut (server restart, pg_terminate_backend): this is the
        # test's instrument, not the code under test, so reconnect once. A row may then appear
        # twice for one run; tests only rely on "at least one row per run".
        _local.conn = None
        _conn().execute(query, args)


@worker.task("record", max_attempts=20, retry_backoff=0.2)
def record(payload: dict[str, Any], ctx: worker.Context) -> None:
    started = time.time()
    sleep = float(payload.get("sleep", 0))
    if sleep:
        time.sleep(sleep)
    _record(ctx, started)


@worker.task("slow", retry_backoff=0.2)
def slow(payload: dict[str, Any], ctx: worker.Context) -> None:
    started = time.time()
    time.sleep(float(payload.get("sleep", 5)))
    _record(ctx, started)


@worker.task("hog", max_attempts=2)
def hog(payload: dict[str, Any]) -> None:
    """Hangs its whole process: a catastrophically backtracking regex runs in C holding the GIL
    (for hours), so no other thread of the process runs, heartbeats and liveness included."""
    re.match(r"(a+)+$", "a" * int(payload.get("n", 34)) + "b")
