"""Paused queues: an operator's pause is a row in ``paused_queues`` (schema/0009), so it holds for
every worker of the fleet and survives their restarts. Resuming deletes the row.

This module only records pauses; the claim honours them (tasks.sql, claim and due_queues): a
worker claims nothing from a paused queue from the moment the pause commits, and tasks already
running finish. Resuming wakes the queue's workers with a notification.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from datetime import datetime

import psycopg

from ..db.connect import Target, borrow
from ..db.sql import execute, queries

MAX_QUEUE_CHARS = 255  # as for the task table's queue column (schema/0004)
MAX_BY_CHARS = 200
MAX_LISTED = 10_000
KNOWN_NAMES = 200  # queue names read for a warning's list of known queues
KNOWN_RECENT = 1_000  # latest finished tasks and operator actions looked through for a name
KNOWN_SHOWN = 10  # queue names a warning lists


@dataclass(frozen=True)
class PausedQueue:
    queue: str
    paused_at: datetime
    paused_by: str


def _checked(queue: str) -> str:
    if not isinstance(queue, str) or not queue or len(queue) > MAX_QUEUE_CHARS:
        raise ValueError(f"a queue name is 1 to {MAX_QUEUE_CHARS} characters")
    return queue


def pause(
    conn: psycopg.Connection, schema: str, queue: str, by: str, *, warn: list[str] | None = None
) -> bool:
    """Pause ``queue`` (``by``: who, cut to 200 characters). False when it was paused already,
    in which case its first pause stands. ``warn``: gets the warning of ``never_named`` when
    nothing has named the queue before (read first, on ``conn``: the pause names it)."""
    if warn is not None and (unknown := never_named(conn, schema, queue)) is not None:
        warn.append(unknown)
    rows = execute(
        conn, queries(schema)["pause_queue"], {"queue": _checked(queue), "by": by[:MAX_BY_CHARS]}
    )
    return bool(rows[0][0])


def never_named(conn: psycopg.Connection, schema: str, queue: str) -> str | None:
    """None when something has named ``queue`` (a task waiting, running, failed or finished
    lately, a worker's route or queue list, a limit, a pause, a recent operator action);
    otherwise the warning to give whoever pauses it (they may pause ahead of a deploy, so the
    pause is made all the same): the queue, and the known queues, the likeliest first. Bounded
    reads (the ``queue_known`` statement)."""
    rows = execute(
        conn,
        queries(schema)["queue_known"],
        {"queue": _checked(queue), "names": KNOWN_NAMES, "recent": KNOWN_RECENT},
    )
    known, names = rows[0][0], list(rows[0][1] or [])
    if known:
        return None
    close = difflib.get_close_matches(queue, names, n=3, cutoff=0.6)
    shown = [*close, *(n for n in names if n not in close)][:KNOWN_SHOWN]
    listed = ", ".join(repr(n) for n in shown) + (", ..." if len(names) > len(shown) else "")
    guess = f"did you mean {close[0]!r}? " if close else ""
    return (
        f"no task, worker, limit, pause or recent action has named queue {queue!r}: paused it all "
        f"the same (for tasks still to come); {guess}"
        + (f"known queues: {listed}" if names else "no queue is known yet")
    )


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
    "never_named",
    "pause",
    "pause_queue",
    "paused",
    "paused_queues",
    "resume",
    "resume_queue",
]
