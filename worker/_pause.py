"""Paused queues: an operator's pause is a row in ``paused_queues`` (schema/0009), so it holds for
every worker of the fleet and survives their restarts. Resuming deletes the row.

This module only records pauses; honouring them is the claim's business.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import psycopg

from ._sql import execute, queries

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
    return bool(rows)


def resume(conn: psycopg.Connection, schema: str, queue: str) -> bool:
    """Resume ``queue``; False when it was not paused."""
    return bool(execute(conn, queries(schema)["resume_queue"], {"queue": _checked(queue)}))


def paused(conn: psycopg.Connection, schema: str, *, limit: int = MAX_LISTED) -> list[PausedQueue]:
    """The paused queues by name (at most ``limit``)."""
    rows = execute(conn, queries(schema)["paused_queues"], {"limit": limit})
    return [PausedQueue(q, at, by) for q, at, by in rows]


__all__ = ["PausedQueue", "pause", "paused", "resume"]
