"""Handlers for tests/test_cancel_running.py, run by real `worker run` processes.

Each handler records its run in ``runs`` on its own autocommit connection (so the test sees it
while the handler still runs): when it started, when it ended and how (``how``), and whether
``ctx.cancelled`` was true at the end. Transactional ones also write ``side_effects`` through
``ctx.conn``, which must roll back when the task is cancelled.

Environment: WORKER_DSN, WORKER_SCHEMA.
"""

from __future__ import annotations

import asyncio
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


def _end(run: int, how: str, ctx: worker.Context) -> None:
    schema = os.environ["WORKER_SCHEMA"]
    _conn().execute(
        f"UPDATE {schema}.runs SET ended = clock_timestamp(), how = %s, saw_cancel = %s"
        " WHERE run = %s",
        (how, ctx.cancelled, run),
    )


@worker.task("cx.async_sleep", max_attempts=3)
async def async_sleep(payload: dict[str, Any], ctx: worker.Context) -> None:
    run = _start(ctx)
    try:
        await asyncio.sleep(float(payload.get("s", 60)))
    except asyncio.CancelledError:
        _end(run, "cancelled", ctx)
        raise
    _end(run, "finished", ctx)


@worker.task("cx.sync_check", max_attempts=3)
def sync_check(payload: dict[str, Any], ctx: worker.Context) -> None:
    """A long loop that asks between steps whether to stop."""
    run = _start(ctx)
    deadline = time.monotonic() + float(payload.get("s", 60))
    try:
        while time.monotonic() < deadline:
            ctx.check()
            time.sleep(0.02)
    except worker.Cancelled:
        _end(run, "stopped", ctx)
        raise
    _end(run, "finished", ctx)


@worker.task("cx.sync_ignore", max_attempts=3)
def sync_ignore(payload: dict[str, Any], ctx: worker.Context) -> str:
    """Never asks: it runs to the end and returns a result, which must not count."""
    run = _start(ctx)
    time.sleep(float(payload.get("s", 3)))
    _end(run, "finished", ctx)
    return "result"


@worker.task("cx.txn_check", transactional=True, max_attempts=3)
def txn_check(payload: dict[str, Any], ctx: worker.Context) -> None:
    assert ctx.conn is not None
    schema = os.environ["WORKER_SCHEMA"]
    run = _start(ctx)
    ctx.conn.execute(f"INSERT INTO {schema}.side_effects (task_id) VALUES (%s)", (ctx.task_id,))
    deadline = time.monotonic() + float(payload.get("s", 60))
    try:
        while time.monotonic() < deadline:
            ctx.check()
            time.sleep(0.02)
    except worker.Cancelled:
        _end(run, "stopped", ctx)
        raise
    _end(run, "finished", ctx)


@worker.task("cx.txn_ignore", transactional=True, max_attempts=3)
def txn_ignore(payload: dict[str, Any], ctx: worker.Context) -> None:
    """Writes, then runs to the end without asking: its write must still roll back."""
    assert ctx.conn is not None
    schema = os.environ["WORKER_SCHEMA"]
    run = _start(ctx)
    ctx.conn.execute(f"INSERT INTO {schema}.side_effects (task_id) VALUES (%s)", (ctx.task_id,))
    time.sleep(float(payload.get("s", 3)))
    _end(run, "finished", ctx)


@worker.task("cx.quick", max_attempts=3)
def quick(payload: dict[str, Any], ctx: worker.Context) -> None:
    _end(_start(ctx), "finished", ctx)
