"""Handlers for tests/test_runtime.py (imported only by `worker run` processes).

Every handler writes a row to ``runs`` when it starts and fills in ``ended`` when it returns,
through its own autocommit connection and with the database clock, so a test can check that no
two attempts of one task ever overlapped, even across processes and machines.

Environment: WORKER_DSN, WORKER_SCHEMA (where to record); RUNTIME_IMPORT_SECONDS (a supervised
child sleeps this long while importing this module).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import psycopg

import worker

if "WORKER_CHILD_SLOT" in os.environ:
    time.sleep(float(os.environ.get("RUNTIME_IMPORT_SECONDS", "0")))

_local = threading.local()


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
            f"INSERT INTO {schema}.runs (task_id, attempt, pid, started)"
            " VALUES (%s, %s, %s, clock_timestamp()) RETURNING run",
            (ctx.task_id, ctx.attempt, os.getpid()),
        )
        .fetchone()
    )
    return row[0]


def _end(run: int) -> None:
    schema = os.environ["WORKER_SCHEMA"]
    _conn().execute(f"UPDATE {schema}.runs SET ended = clock_timestamp() WHERE run = %s", (run,))


@worker.task("rt.sleep", max_attempts=3, retry_backoff=0.1)
def sleep(payload: dict[str, Any], ctx: worker.Context) -> None:
    run = _start(ctx)
    time.sleep(float(payload.get("s", 0.002)))
    _end(run)


@worker.task("rt.sync_timeout", timeout=1.0, max_attempts=3, retry_backoff=0.1)
def sync_timeout(payload: dict[str, Any], ctx: worker.Context) -> None:
    run = _start(ctx)
    time.sleep(float(payload.get("s", 0.05)))
    _end(run)


@worker.task("rt.async_block", timeout=1.0, max_attempts=2, retry_backoff=0.1)
async def async_block(payload: dict[str, Any], ctx: worker.Context) -> None:
    """Ignores cancellation: a blocking call inside ``async def`` holds its event loop."""
    run = _start(ctx)
    time.sleep(float(payload.get("s", 3.0)))
    _end(run)


@worker.task("rt.async_quick", timeout=5.0)
async def async_quick(payload: dict[str, Any], ctx: worker.Context) -> None:
    run = _start(ctx)
    await asyncio.sleep(0.01)
    _end(run)


@worker.task("rt.txn", transactional=True, timeout=60.0)
def txn(payload: dict[str, Any], ctx: worker.Context) -> None:
    assert ctx.conn is not None
    schema = os.environ["WORKER_SCHEMA"]
    ctx.conn.execute(
        f"INSERT INTO {schema}.runs (task_id, attempt, pid, started, ended)"
        " VALUES (%s, %s, %s, clock_timestamp(), clock_timestamp())",
        (ctx.task_id, ctx.attempt, os.getpid()),
    )


@worker.task("rt.crash", max_attempts=1)
def crash(payload: dict[str, Any], ctx: worker.Context) -> None:
    """Takes its whole process down, as a segfault in a C extension would; with ``once``, only
    on its first run (the runs table remembers across processes)."""
    schema = os.environ["WORKER_SCHEMA"]
    before = (
        _conn()
        .execute(f"SELECT count(*) FROM {schema}.runs WHERE task_id = %s", (ctx.task_id,))
        .fetchone()[0]
    )
    run = _start(ctx)
    if payload.get("once") and before:
        _end(run)
        return
    time.sleep(float(payload.get("after", 0.5)))
    os._exit(1)


@worker.task("rt.neighbour", max_attempts=1)
def neighbour(payload: dict[str, Any], ctx: worker.Context) -> None:
    run = _start(ctx)
    time.sleep(float(payload.get("s", 2.0)))
    _end(run)
