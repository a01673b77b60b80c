"""Enqueue: every statement that inserts task rows. One task through the SQL function
``enqueue`` (so Python and SQL producers share its dedupe logic), many through COPY, and the due
slots of cron schedules, one statement per tick for all of them.

The callers (``worker.tasks.enqueue``, ``worker.coord.cron``) check and shape what they insert;
this module only runs the statements, in ``inserts.sql`` beside it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import psycopg

from ..db.sql import execute
from .statements import statements


def _one(schema: str, params: Mapping[str, Any]) -> Any:
    """A keyed task goes through enqueue_keyed (schema/0014), the others through enqueue."""
    return statements(schema)["enqueue" if params["limit_key"] is None else "enqueue_keyed"]


def insert(conn: psycopg.Connection, schema: str, params: Mapping[str, Any]) -> int:
    """One task, inside the caller's transaction if one is open; returns its id (the id of the
    live task holding its dedupe key, if one does)."""
    row = conn.execute(_one(schema, params), params).fetchone()
    assert row is not None
    return int(row[0])


async def insert_async(
    conn: psycopg.AsyncConnection, schema: str, params: Mapping[str, Any]
) -> int:
    """``insert`` on an asyncio connection."""
    cur = await conn.execute(_one(schema, params), params)
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


def delayed_until(
    cur: psycopg.Connection | psycopg.Cursor[Any], schema: str, seconds: float
) -> datetime:
    """The database's now() plus ``seconds``: a delay counts from its clock, never ours."""
    found = cur.execute(statements(schema)["delayed_until"], {"delay": seconds}).fetchone()
    assert found is not None
    return found[0]


def copy(
    cur: psycopg.Cursor[Any], schema: str, *, at: bool, traced: bool, keyed: bool
) -> psycopg.Copy:
    """A COPY into the task table (use it as a context manager and ``write_row`` each task).
    Every row has (task, payload, queue, priority, max_attempts), then run_at when ``at``, then
    the trace context when ``traced`` or ``keyed`` (NULL for none), then the key for per-key
    limits when ``keyed``. One NOTIFY is sent for the whole COPY."""
    if keyed:
        name = "enqueue_copy_at_keyed" if at else "enqueue_copy_keyed"
    elif traced:
        name = "enqueue_copy_at_traced" if at else "enqueue_copy_traced"
    else:
        name = "enqueue_copy_at" if at else "enqueue_copy"
    return cur.copy(statements(schema)[name])


def cron_slots(conn: psycopg.Connection, schema: str, params: Mapping[str, Any]) -> Any:
    """Offer the due slots of cron schedules (arrays, one element per slot: see cron_enqueue
    in insert.sql); one row: (the database's now(), {key: slots won}). In a transaction of its
    own, whatever the connection."""
    return execute(conn, statements(schema)["cron_enqueue"], params)[0]


def insert_workflow(
    conn: psycopg.Connection,
    schema: str,
    *,
    name: str,
    steps: Sequence[tuple[Any, ...]],
    edges: Sequence[tuple[int, int, bool, int]],
    trace_context: str | None = None,
) -> tuple[int, list[int]]:
    """A workflow in the caller's transaction: its row, its steps by COPY (each a tuple of
    task, payload JSON text, queue, priority, max_attempts, limit_key, waits; in dependency
    order), then its edges by COPY ((step, dependency, run_on_failure, position), as indexes
    into ``steps``). ``trace_context``: the producer's (JSON text), stored with every step.
    Returns (workflow id, the steps' ids)."""
    q = statements(schema)
    row = conn.execute(q["workflow_create"], {"name": name}).fetchone()
    assert row is not None
    workflow_id = int(row[0])
    ids = [r[0] for r in conn.execute(q["workflow_ids"], {"n": len(steps)})]
    awaited = {parent for _, parent, _, _ in edges}
    with conn.cursor() as cur:
        with cur.copy(q["workflow_copy_steps"]) as copy:
            for n, (i, step) in enumerate(zip(ids, steps, strict=True)):
                task, payload, queue, priority, max_attempts, limit_key, waits = step
                copy.write_row(
                    (
                        *(i, task, payload, queue, priority, max_attempts, limit_key),
                        workflow_id,
                        "waiting" if waits else "queued",
                        trace_context,
                        True if n in awaited else None,
                    )
                )
        if edges:
            with cur.copy(q["workflow_copy_edges"]) as copy:
                for child, parent, run_on_failure, position in edges:
                    copy.write_row((ids[child], ids[parent], run_on_failure, position))
    return workflow_id, ids


__all__ = ["copy", "cron_slots", "delayed_until", "insert", "insert_async", "insert_workflow"]
