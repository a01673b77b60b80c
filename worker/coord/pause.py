"""Paused queues: an operator's pause is a row in ``paused_queues`` (schema/0009), so it holds for
every worker of the fleet and survives their restarts. Resuming deletes the row.

This module only records pauses; the claim honours them (tasks.sql, claim and due_queues): a
worker claims nothing from a paused queue from the moment the pause commits, and tasks already
running finish. Resuming wakes the queue's workers with a notification.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import psycopg

from ..db.connect import Target, borrow
from ..db.sql import execute, queries

MAX_QUEUE_CHARS = 255  # as for the task table's queue column (schema/0004)
MAX_BY_CHARS = 200
MAX_LISTED = 10_000


@dataclass(frozen=True)
class PausedQueue:
    queue: str
    paused_at: datetime
    paused_by: str


def _checked(queue: str) -> str:
    if not isinstance(queue, str) or not queue or len(queue) > MAX_QUEUE_CHARS:
        raise ValueError(f"a queue name is 1 to {MAX_QUEUE_CHARS} characters")
    return queue


def pause(conn: psycopg.Connection, schema: str, queue: str, by: str) -> bool:
    """Pause ``queue`` (``by``: who, cut to 200 characters). False when it was paused already,
    in which case its first pause stands."""
    rows = execute(
        conn, queries(schema)["pause_queue"], {"queue": _checked(queue), "by": by[:MAX_BY_CHARS]}
    )
    return bool(rows[0][0])


def resume(conn: psycopg.Connection, schema: str, queue: str) -> bool:
    """Resume ``queue``; False when it was not paused."""
    rows = execute(conn, queries(schema)["resume_queue"], {"queue": _checked(queue)})
    return bool(rows[0][0])


def paused(conn: psycopg.Connection, schema: str, *, limit: int = MAX_LISTED) -> list[PausedQueue]:
    """The paused queues by name (at most ``limit``)."""
    rows = execute(conn, queries(schema)["paused_queues"], {"limit": limit})
    return [PausedQueue(q, at, by) for q, at, by in rows]


# -- the public API (worker.pause_queue, ...): a connection, a pool or a DSN, like enqueue ------


def pause_queue(target: Target, queue: str, *, by: str = "", schema: str = "worker") -> bool:
    """Pause ``queue`` for the whole fleet; False when it was paused already."""
    with borrow(target) as conn:
        return pause(conn, schema, queue, by)


def resume_queue(target: Target, queue: str, *, schema: str = "worker") -> bool:
    """Resume ``queue`` and wake its workers; False when it was not paused."""
    with borrow(target) as conn:
        return resume(conn, schema, queue)


def paused_queues(target: Target, *, schema: str = "worker") -> list[PausedQueue]:
    with borrow(target) as conn:
        return paused(conn, schema)


__all__ = [
    "PausedQueue",
    "pause",
    "pause_queue",
    "paused",
    "paused_queues",
    "resume",
    "resume_queue",
]
