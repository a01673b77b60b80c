"""Producing tasks from Python: one at a time in the caller's transaction, or in bulk by COPY."""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from ._conn import Target, borrow
from ._registry import DEFAULT_QUEUE, TaskDef, registry
from ._sql import queries


def _check_payload(payload: Any) -> Any:
    try:
        json.dumps(payload)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"payload is not JSON-serialisable: {exc}") from None
    return payload


def _run_at(run_at: datetime | None, delay: float | timedelta | None) -> datetime | None:
    if run_at is not None and delay is not None:
        raise ValueError("give run_at or delay, not both")
    if delay is not None:
        seconds = delay.total_seconds() if isinstance(delay, timedelta) else float(delay)
        return datetime.now(UTC) + timedelta(seconds=seconds)
    if run_at is not None and run_at.tzinfo is None:
        raise ValueError("run_at must be timezone-aware (naive datetimes are ambiguous)")
    return run_at


def _default_queue(name: str) -> str:
    """A task registered in this process goes to its handler's queue unless told otherwise.

    max_attempts has no such default here: left out, it is NULL and the worker that claims the row
    applies its handler's setting (schema/0003), so a deploy that changes a handler's
    max_attempts also applies to the tasks already queued.
    """
    definition: TaskDef | None = registry.get(name)
    return DEFAULT_QUEUE if definition is None else definition.queue


def _check_max_attempts(max_attempts: int | None) -> int | None:
    if max_attempts is not None and max_attempts < 1:
        raise ValueError(f"max_attempts must be at least 1, not {max_attempts}")
    return max_attempts


def _enqueue_params(
    task: str,
    payload: Any,
    queue: str | None,
    run_at: datetime | None,
    delay: float | timedelta | None,
    priority: int,
    max_attempts: int | None,
    dedupe_key: str | None,
) -> dict[str, Any]:
    return {
        "task": task,
        "payload": Jsonb(_check_payload({} if payload is None else payload)),
        "queue": queue or _default_queue(task),
        "run_at": _run_at(run_at, delay),
        "priority": priority,
        "max_attempts": _check_max_attempts(max_attempts),
        "dedupe_key": dedupe_key,
    }


def enqueue(
    target: Target,
    task: str,
    payload: Any = None,
    *,
    queue: str | None = None,
    run_at: datetime | None = None,
    delay: float | timedelta | None = None,
    priority: int = 0,
    max_attempts: int | None = None,
    dedupe_key: str | None = None,
    schema: str = "worker",
) -> int:
    """Enqueue one task and return its id (the existing task's id when ``dedupe_key`` matches)."""
    params = _enqueue_params(
        task, payload, queue, run_at, delay, priority, max_attempts, dedupe_key
    )
    with borrow(target) as conn:
        row = conn.execute(queries(schema)["enqueue"], params).fetchone()
    assert row is not None
    return int(row[0])


async def enqueue_async(
    target: psycopg.AsyncConnection | AsyncConnectionPool,
    task: str,
    payload: Any = None,
    *,
    queue: str | None = None,
    run_at: datetime | None = None,
    delay: float | timedelta | None = None,
    priority: int = 0,
    max_attempts: int | None = None,
    dedupe_key: str | None = None,
    schema: str = "worker",
) -> int:
    """``enqueue`` for asyncio applications: same statement, same transaction rules."""
    params = _enqueue_params(
        task, payload, queue, run_at, delay, priority, max_attempts, dedupe_key
    )
    if isinstance(target, AsyncConnectionPool):
        async with target.connection() as conn:
            cur = await conn.execute(queries(schema)["enqueue"], params)
            row = await cur.fetchone()
    else:
        cur = await target.execute(queries(schema)["enqueue"], params)
        row = await cur.fetchone()
    assert row is not None
    return int(row[0])


def enqueue_many(
    target: Target,
    task: str,
    payloads: Iterable[Any],
    *,
    queue: str | None = None,
    run_at: datetime | None = None,
    delay: float | timedelta | None = None,
    priority: int = 0,
    max_attempts: int | None = None,
    schema: str = "worker",
) -> int:
    """Enqueue many tasks of one kind with COPY and return how many were written.

    COPY is several times faster than INSERT for bulk loads and sends one NOTIFY in all. It cannot
    return ids or honour dedupe keys; use ``enqueue`` for those.
    """
    when = _run_at(run_at, delay) or datetime.now(UTC)
    row_tail = (queue or _default_queue(task), priority, when, _check_max_attempts(max_attempts))
    count = 0
    dumps = json.dumps
    with (
        borrow(target) as conn,
        conn.cursor() as cur,
        cur.copy(queries(schema)["enqueue_copy"]) as copy,
    ):
        for payload in payloads:
            try:
                text = dumps({} if payload is None else payload)
            except (TypeError, ValueError) as exc:
                raise TypeError(f"payload #{count} is not JSON-serialisable: {exc}") from None
            copy.write_row((task, text, *row_tail))
            count += 1
    return count
