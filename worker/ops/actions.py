"""The operator console's actions on tasks (retry, cancel, delete; one task or many by id) and the
record of every action taken (``record``, into schema/0009's ``console_audit``).

State changes go through ``_transitions`` (cancelling: ``_cancel``) like every other; deleting a
row is not a change of state, so its statement is here. Each statement re-checks the state of
every row it touches, so ids listed a moment ago that have moved on since are left alone (and not
counted).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import psycopg

from ..coord import cancel as _cancel
from ..db.sql import notify_channel, queries
from ..store import transitions as tr

MAX_IDS = 10_000  # ids per action: the console acts on at most this many rows per request
ACTOR_CHARS = 200
ADDRESS_CHARS = 100


@dataclass(frozen=True)
class Outcome:
    changed: int  # rows the action changed
    skipped: int = 0  # retry only: rows left failed because a live task holds their dedupe key
    requested: int = 0  # cancel only: running tasks (among ``changed``) their workers will stop


def _ids(ids: list[int]) -> list[int]:
    if len(ids) > MAX_IDS:
        raise ValueError(f"at most {MAX_IDS:,} tasks per action")
    return [int(i) for i in ids]


def retry(conn: psycopg.Connection, schema: str, ids: list[int]) -> Outcome:
    """Failed or cancelled tasks among ``ids`` back to queued with fresh attempts; those whose
    dedupe key a live task holds stay failed (``skipped``)."""
    q = queries(schema)
    for attempt in range(3):
        try:
            with conn.transaction():  # a savepoint when the caller has a transaction open
                requeued, skipped = tr.retry_tasks(
                    conn, q, ids=_ids(ids), channel=notify_channel(schema)
                )
            return Outcome(requeued, skipped)
        except psycopg.errors.UniqueViolation:
            # A producer took a key between the check and the update: the statement runs again
            # and then sees that task.
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def cancel(conn: psycopg.Connection, schema: str, ids: list[int], *, by: str) -> Outcome:
    """Tasks among ``ids`` that have not started (scheduled or queued) to cancelled, and running
    ones marked for their workers to stop (``requested``; they end cancelled), for ``by``."""
    done = _cancel.cancel_tasks(conn, queries(schema), ids=_ids(ids), by=by[:ACTOR_CHARS])
    requested = sum(1 for c in done if c.outcome == "requested")
    # A task asked to stop before (its first request stands) is counted again here: the console
    # says "requested" for it all the same.
    return Outcome(requested + sum(1 for c in done if c.outcome == "cancelled"), 0, requested)


def delete(conn: psycopg.Connection, schema: str, ids: list[int]) -> Outcome:
    """Delete the tasks among ``ids`` that no worker is running."""
    row = conn.execute(queries(schema)["delete_tasks"], {"ids": _ids(ids)}).fetchone()
    return Outcome(int(row[0]) if row else 0)


def record(
    conn: psycopg.Connection,
    schema: str,
    *,
    actor: str,
    address: str,
    action: str,
    target: Mapping[str, Any],
    affected: int,
) -> None:
    """Write one console action to the audit table. The one place the console's audit is written:
    to move it to another table, change this function."""
    conn.execute(
        queries(schema)["console_audit_insert"],
        {
            "actor": actor[:ACTOR_CHARS],
            "address": address[:ADDRESS_CHARS],
            "action": action,
            "target": json.dumps(dict(target), default=str),
            "affected": affected,
        },
    )


def recent(conn: psycopg.Connection, schema: str, *, limit: int = 20) -> list[tuple[Any, ...]]:
    """The newest actions: (id, at, actor, address, action, target, affected)."""
    return conn.execute(queries(schema)["console_audit_recent"], {"limit": limit}).fetchall()


__all__ = ["MAX_IDS", "Outcome", "cancel", "delete", "recent", "record", "retry"]
