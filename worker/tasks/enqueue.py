"""Producing tasks from Python: one at a time in the caller's transaction, or in bulk by COPY."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from .. import hooks as _hooks
from .. import store
from ..db.connect import Target, borrow
from ..db.migrate import schema_errors
from .limits import key_of
from .payload import to_json
from .registry import TaskDef, registry


def _resolve(task: str | TaskDef) -> tuple[str, TaskDef | None]:
    """A task named, or given as its decorated function: (name, its definition if known here)."""
    if isinstance(task, TaskDef):
        return task.name, task
    return task, registry.get(task)


def _check_payload(task: str, definition: TaskDef | None, payload: Any) -> Any:
    """The payload as the row stores it: validated and serialised when the task has a model
    (see tasks.payload), then checked to be JSON."""
    payload = to_json(task, payload, None if definition is None else definition.payload)
    try:
        json.dumps(payload)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"payload is not JSON-serialisable: {exc}") from None
    return payload


def _when(
    run_at: datetime | None, delay: float | timedelta | None
) -> tuple[datetime | None, float | None]:
    """(run_at, delay in seconds): at most one is set. A delay is added to the database's clock,
    never this process's, like every other time the queue computes."""
    if run_at is not None and delay is not None:
        raise ValueError("give run_at or delay, not both")
    if delay is not None:
        seconds = delay.total_seconds() if isinstance(delay, timedelta) else float(delay)
        if not math.isfinite(seconds):
            raise ValueError(f"delay must be a finite number of seconds, not {delay!r}")
        return None, seconds
    if run_at is not None and run_at.tzinfo is None:
        raise ValueError("run_at must be timezone-aware (naive datetimes are ambiguous)")
    return run_at, None


def _default_queue(definition: TaskDef | None) -> str | None:
    """A task registered in this process goes to its handler's queue unless told otherwise; for
    any other task the database picks the queue its workers declared (schema/0006).

    max_attempts has no such default here: left out, it is NULL and the worker that claims the row
    applies its handler's setting (schema/0003), so a deploy that changes a handler's
    max_attempts also applies to the tasks already queued.
    """
    return None if definition is None else definition.queue


def _check_max_attempts(max_attempts: int | None) -> int | None:
    if max_attempts is not None and max_attempts < 1:
        raise ValueError(f"max_attempts must be at least 1, not {max_attempts}")
    return max_attempts


def _enqueue_params(
    task: str | TaskDef,
    payload: Any,
    queue: str | None,
    run_at: datetime | None,
    delay: float | timedelta | None,
    priority: int,
    max_attempts: int | None,
    dedupe_key: str | None,
    limit_key: str | None = None,
) -> dict[str, Any]:
    when, seconds = _when(run_at, delay)
    name, definition = _resolve(task)
    stored = _check_payload(name, definition, {} if payload is None else payload)
    return {
        "task": name,
        "payload": Jsonb(stored),
        "queue": queue or _default_queue(definition),
        "run_at": when,
        "delay": seconds,
        "priority": priority,
        "max_attempts": _check_max_attempts(max_attempts),
        "dedupe_key": dedupe_key,
        "trace_context": None,  # set by a producer observer (see worker.hooks.producers)
        "limit_key": _key(definition, payload, stored, limit_key),
    }


def _carrier(send: _hooks.Send) -> Jsonb | None:
    return Jsonb(send.carrier) if send.carrier else None


def _key(definition: TaskDef | None, payload: Any, stored: Any, given: str | None) -> str | None:
    """The task's key for per-key limits (schema/0014): the producer's, else the one the task
    declares (``limit_key``: a field of the payload as stored, or a function of the payload as
    given)."""
    if given is not None:
        return key_of(lambda _: given, None)
    spec = None if definition is None else definition.limit_key
    return key_of(spec, payload if callable(spec) else stored)


def enqueue(
    target: Target,
    task: str | TaskDef,
    payload: Any = None,
    *,
    queue: str | None = None,
    run_at: datetime | None = None,
    delay: float | timedelta | None = None,
    priority: int = 0,
    max_attempts: int | None = None,
    dedupe_key: str | None = None,
    limit_key: str | None = None,
    schema: str = "worker",
) -> int:
    """Enqueue one task and return its id (the existing task's id when ``dedupe_key`` matches).
    ``limit_key``: the key per-key limits count it under (default: the task's declaration).
    ``SchemaMissing`` when ``schema`` has no worker tables, or older ones."""
    params = _enqueue_params(
        task, payload, queue, run_at, delay, priority, max_attempts, dedupe_key, limit_key
    )
    if _hooks.producers:
        with _hooks.sending(_hooks.Send(params["task"], params["queue"], False, count=1)) as send:
            params["trace_context"] = _carrier(send)
            send.task_id = _insert(target, schema, params)
            return send.task_id
    return _insert(target, schema, params)


def _insert(target: Target, schema: str, params: dict[str, Any]) -> int:
    with borrow(target) as conn, schema_errors(schema):
        return store.insert(conn, schema, params)


async def enqueue_async(
    target: psycopg.AsyncConnection | AsyncConnectionPool,
    task: str | TaskDef,
    payload: Any = None,
    *,
    queue: str | None = None,
    run_at: datetime | None = None,
    delay: float | timedelta | None = None,
    priority: int = 0,
    max_attempts: int | None = None,
    dedupe_key: str | None = None,
    limit_key: str | None = None,
    schema: str = "worker",
) -> int:
    """``enqueue`` for asyncio applications: same statement, same transaction rules."""
    params = _enqueue_params(
        task, payload, queue, run_at, delay, priority, max_attempts, dedupe_key, limit_key
    )
    if _hooks.producers:
        with _hooks.sending(_hooks.Send(params["task"], params["queue"], False, count=1)) as send:
            params["trace_context"] = _carrier(send)
            send.task_id = await _insert_async(target, schema, params)
            return send.task_id
    return await _insert_async(target, schema, params)


async def _insert_async(
    target: psycopg.AsyncConnection | AsyncConnectionPool, schema: str, params: dict[str, Any]
) -> int:
    with schema_errors(schema):
        if isinstance(target, AsyncConnectionPool):
            async with target.connection() as conn:
                return await store.insert_async(conn, schema, params)
        return await store.insert_async(target, schema, params)


def enqueue_many(
    target: Target,
    task: str | TaskDef,
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
    name, definition = _resolve(task)
    queue = queue or _default_queue(definition)
    args = (
        target,
        name,
        definition,
        payloads,
        queue,
        run_at,
        delay,
        priority,
        max_attempts,
        schema,
    )
    if _hooks.producers:
        with _hooks.sending(_hooks.Send(name, queue, True)) as send:
            send.count = _copy(*args, send.carrier)
            return send.count
    return _copy(*args, None)


def _copy(
    target: Target,
    name: str,
    definition: TaskDef | None,
    payloads: Iterable[Any],
    queue: str | None,
    run_at: datetime | None,
    delay: float | timedelta | None,
    priority: int,
    max_attempts: int | None,
    schema: str,
    carrier: dict[str, str] | None,
) -> int:
    when, seconds = _when(run_at, delay)
    row_tail: tuple[Any, ...] = (queue, priority, _check_max_attempts(max_attempts))
    # One transaction: the delay counts from the same now() as the rows' created_at.
    with schema_errors(schema), borrow(target) as conn, conn.transaction(), conn.cursor() as cur:
        if seconds is not None:
            when = store.delayed_until(cur, schema, seconds)
        # Without run_at the column's default applies: the database's now(), not this clock.
        if when is not None:
            row_tail += (when,)
        keyed = definition is not None and definition.limit_key is not None
        if keyed:  # a key per row (schema/0014), after the trace context (NULL when none)
            row_tail += (json.dumps(carrier) if carrier else None,)
        elif carrier:  # every row carries the context of the one batch send (schema/0013)
            row_tail += (json.dumps(carrier),)
        opened = store.copy(cur, schema, at=when is not None, traced=bool(carrier), keyed=keyed)
        with opened as copy:
            count = _copy_rows(copy, name, definition, payloads, row_tail, keyed=keyed)
    return count


def _copy_rows(
    copy: Any,
    task: str,
    definition: TaskDef | None,
    payloads: Iterable[Any],
    tail: tuple[Any, ...],
    *,
    keyed: bool = False,
) -> int:
    count = 0
    dumps = json.dumps
    model = None if definition is None else definition.payload
    for payload in payloads:
        original = payload
        if model is not None or type(payload) is not dict:
            payload = to_json(task, payload, model)
        try:
            text = dumps({} if payload is None else payload)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"payload #{count} is not JSON-serialisable: {exc}") from None
        if keyed:
            assert definition is not None
            copy.write_row((task, text, *tail, _key(definition, original, payload, None)))
        else:
            copy.write_row((task, text, *tail))
        count += 1
    return count
