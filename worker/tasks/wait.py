"""Waiting for tasks to finish: ``wait``, ``wait_async``, and ``Waiter`` for many at once.

A wait reads the task's row (``task_outcomes``) and returns its stored result when it is done, or
raises ``TaskFailed``, ``TaskCancelled`` or ``TaskNotFound``; ``WaitTimeout`` when the timeout
passes first. Between two reads it listens on ``<schema>.done``, where the transaction that
finishes a task storing a result announces it (see tasks.results), so it wakes as that transaction
commits; it also reads again every ``poll_interval`` seconds, which is how it learns of tasks
that send no notification (those that store no result, cancellations, rescues that fail a row).
Behind PgBouncer in transaction mode LISTEN hears nothing: pass ``listen=False`` (poll only), or
give the waiter a direct connection.

``wait`` holds one connection for the whole wait; ``Waiter`` (``tasks.waiter``) serves any number of
waits with one connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import psycopg
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from ..db.arrays import int_array
from ..db.connect import WAIT, Target, borrow, connect, connect_async
from ..db.sql import queries
from ..errors import TaskCancelled, TaskFailed, TaskNotFound, WaitTimeout
from .results import done_channel

log = logging.getLogger("worker")


AsyncTarget = psycopg.AsyncConnection | AsyncConnectionPool | str


def settle(task_id: int, row: Sequence[Any] | None) -> tuple[bool, Any]:
    """(finished, result) from a row of ``task_outcomes`` (None: no such row); raises for a task
    that ended without a result to give."""
    if row is None:
        raise TaskNotFound(task_id)
    state = row[1]
    if state == "done":
        return True, row[2]
    if state == "failed":
        raise TaskFailed(task_id, row[3])
    if state == "cancelled":
        raise TaskCancelled(task_id)
    return False, None


def check_args(timeout: float | None, poll_interval: float) -> None:
    if timeout is not None and not (math.isfinite(timeout) and timeout >= 0):
        raise ValueError(f"timeout must be a finite number of seconds >= 0, not {timeout!r}")
    if not (math.isfinite(poll_interval) and poll_interval > 0):
        raise ValueError(f"poll_interval must be a positive number of seconds, not {poll_interval}")


def listen_statement(channel: str, on: bool = True) -> sql.Composed:
    # LISTEN takes no parameters; the channel is a validated schema name plus ".done", quoted.
    return sql.SQL("LISTEN {}" if on else "UNLISTEN {}").format(sql.Identifier(channel))


def _run(
    conn: psycopg.Connection, query: Any, params: Mapping[str, Any] | None = None
) -> list[Any]:
    """One statement committed at once: the caller's connection must not be in a transaction
    (see _idle), so a non-autocommit one gets a transaction of its own per statement."""
    ctx = contextlib.nullcontext() if conn.autocommit else conn.transaction()
    with ctx:
        cur = conn.execute(query, params)
        return cur.fetchall() if cur.description else []


def _idle(status: psycopg.pq.TransactionStatus) -> None:
    if status != psycopg.pq.TransactionStatus.IDLE:
        raise ValueError(
            "wait needs a connection outside any transaction: inside one it would not see the "
            "task finish (and a task enqueued in that transaction cannot even start)"
        )


def _mentions(payload: str, task_id: int) -> bool:
    return str(task_id) in payload.split(",")


def _left(deadline: float | None) -> float:
    return math.inf if deadline is None else deadline - time.monotonic()


def wait(
    target: Target,
    task_id: int,
    *,
    timeout: float | None = None,
    schema: str = "worker",
    poll_interval: float = 1.0,
    listen: bool = True,
) -> Any:
    """Block until task ``task_id`` finishes; return its stored result (None when it stores
    none). ``target``: a connection (autocommit, or at least not inside a transaction), a pool,
    or a DSN. Raises TaskFailed, TaskCancelled, TaskNotFound, or WaitTimeout after ``timeout``
    seconds (None: no limit)."""
    check_args(timeout, poll_interval)
    q, channel = queries(schema), done_channel(schema)
    deadline = None if timeout is None else time.monotonic() + timeout
    with _borrow(target) as conn:
        _idle(conn.info.transaction_status)
        if listen:
            _run(
                conn, listen_statement(channel)
            )  # before the first read: no notification slips past
        try:
            while True:
                rows = _run(conn, q["task_outcomes"], {"ids": int_array([task_id])})
                finished, result = settle(task_id, rows[0] if rows else None)
                if finished:
                    return result
                left = _left(deadline)
                if left <= 0:
                    raise WaitTimeout(task_id, timeout or 0.0)
                pause = min(poll_interval, left)
                if not listen:
                    time.sleep(pause)
                    continue
                for note in conn.notifies(timeout=pause):
                    if _mentions(note.payload, task_id):
                        break
        finally:
            if listen and not conn.closed:
                with contextlib.suppress(psycopg.Error):
                    _run(conn, listen_statement(channel, on=False))


@contextlib.contextmanager
def _borrow(target: Target) -> Iterator[psycopg.Connection]:
    """As ``db.connect.borrow``, but a DSN's connection prepares nothing: a wait polls one statement
    over and over, and behind PgBouncer in transaction mode a prepared statement breaks."""
    if isinstance(target, str):
        with connect(target, WAIT, session=False) as conn:
            yield conn
    else:
        with borrow(target) as conn:
            yield conn


@contextlib.asynccontextmanager
async def _borrow_async(target: AsyncTarget) -> AsyncIterator[psycopg.AsyncConnection]:
    if isinstance(target, str):
        conn = await connect_async(target, WAIT, session=False)
        async with conn:
            yield conn
    elif isinstance(target, AsyncConnectionPool):
        async with target.connection() as conn:
            yield conn
    else:
        yield target


async def _run_async(
    conn: psycopg.AsyncConnection, query: Any, params: Mapping[str, Any] | None = None
) -> list[Any]:
    ctx = contextlib.nullcontext() if conn.autocommit else conn.transaction()
    async with ctx:  # type: ignore[attr-defined]
        cur = await conn.execute(query, params)
        return await cur.fetchall() if cur.description else []


async def wait_async(
    target: AsyncTarget,
    task_id: int,
    *,
    timeout: float | None = None,
    schema: str = "worker",
    poll_interval: float = 1.0,
    listen: bool = True,
) -> Any:
    """``wait`` for asyncio: an AsyncConnection, an AsyncConnectionPool or a DSN."""
    check_args(timeout, poll_interval)
    q, channel = queries(schema), done_channel(schema)
    deadline = None if timeout is None else time.monotonic() + timeout
    async with _borrow_async(target) as conn:
        _idle(conn.info.transaction_status)
        if listen:
            await _run_async(conn, listen_statement(channel))
        try:
            while True:
                rows = await _run_async(conn, q["task_outcomes"], {"ids": int_array([task_id])})
                finished, result = settle(task_id, rows[0] if rows else None)
                if finished:
                    return result
                left = _left(deadline)
                if left <= 0:
                    raise WaitTimeout(task_id, timeout or 0.0)
                pause = min(poll_interval, left)
                if not listen:
                    await asyncio.sleep(pause)
                    continue
                async for note in conn.notifies(timeout=pause):
                    if _mentions(note.payload, task_id):
                        break
        finally:
            if listen and not conn.closed:
                with contextlib.suppress(psycopg.Error):
                    await _run_async(conn, listen_statement(channel, on=False))


__all__ = ["check_args", "listen_statement", "settle", "wait", "wait_async"]
