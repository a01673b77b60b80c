"""Cancelling tasks: an operator's request, and how a worker learns of it (schema/0010).

A task that has not started is cancelled at once. A running one is marked in its row and its
worker is told on ``cancel_channel`` (NOTIFY; the payload lists task ids, or is empty for "check
every task you hold"); a worker that cannot LISTEN reads the marks of the rows it holds instead
(``requests``, from the lease keeper). The request itself is the SQL function
``cancel_tasks`` of schema/0010 (run by the store), so ``psql`` users, the CLI, the console and
this API cancel alike. What ends a marked row ``cancelled`` is every statement of the store that
takes a row out of ``in_progress``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import psycopg

from .. import store
from ..db.connect import Target, borrow
from ..db.sql import Queries

OUTCOMES = ("cancelled", "requested", "finished", "missing")


@dataclass(frozen=True)
class Cancellation:
    """What a cancel did to one task.

    ``outcome``: ``cancelled`` (it had not started: it is cancelled now), ``requested`` (it is
    running: its worker will stop it, and the row will end cancelled), ``finished`` (it had
    already ended: ``state`` says how; nothing changed) or ``missing`` (no such task).
    """

    task_id: int
    outcome: str
    state: str | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def cancel_many(
    conn: psycopg.Connection, schema: str, ids: Sequence[int], *, by: str | None
) -> list[Cancellation]:
    """Cancel each of ``ids`` for ``by`` (None: the database role, cut to 200 characters); one
    result per id, in order."""
    by = None if by is None else by[:200]
    return [Cancellation(*row) for row in store.cancel_tasks(conn, schema, ids, by=by)]


def cancel(
    target: Target, task_id: int, *, by: str | None = None, schema: str = "worker"
) -> Cancellation:
    """Cancel one task, whatever its state: see ``Cancellation`` for what can happen.

    ``target`` is a connection (the request commits with its transaction), a pool or a DSN, as
    for ``enqueue``. ``by`` says who cancelled (cut to 200 characters); by default the database
    role. A running task's worker learns of it within about a second.
    """
    if isinstance(task_id, bool) or not isinstance(task_id, int) or not 0 < task_id < 2**63:
        raise ValueError(f"a task id is a positive 64-bit integer, not {task_id!r}")
    if by is not None and not isinstance(by, str):
        raise TypeError("by must be a string or None")
    with borrow(target) as conn:
        return cancel_many(conn, schema, [task_id], by=by)[0]


def requests(
    conn: psycopg.Connection, q: Queries, *, worker_id: str, ids: Sequence[int]
) -> set[int]:
    """Of the rows ``worker_id`` holds (``ids``), those someone asked to cancel. A read."""
    if not ids:
        return set()
    rows = conn.execute(q["cancel_requests"], {"ids": list(ids), "worker_id": worker_id})
    return {r[0] for r in rows.fetchall()}


def parse_payload(payload: str | None) -> list[int] | None:
    """The task ids a notification on ``cancel_channel`` names; None means "check every task
    you hold" (an empty payload, a payload this code cannot read, or a reconnection)."""
    if not payload:
        return None
    try:
        return [int(part) for part in payload.split(",")]
    except ValueError:
        return None


__all__ = ["OUTCOMES", "Cancellation", "cancel", "cancel_many", "parse_payload", "requests"]
