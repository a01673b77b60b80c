"""Operator actions on task rows: the one retry (``requeue``), cancel (of tasks, or of a
workflow's unfinished steps), delete, and one batch of a bulk action by filter (``bulk_step``).

The logic of each lives in SQL functions (schema/0008, 0010, 0016), so ``psql`` users, the CLI,
the console and the Python API act alike; this module runs them. Every statement re-checks the
state of each row it touches: ids listed a moment ago that have moved on since are left alone.

Every statement is in ``operator.sql`` beside this module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from ..db.arrays import int_array
from .statements import statements


@dataclass(slots=True)
class Requeued:
    """What a retry did: the ids back in the queue, and those left as they were because a live
    task holds their dedupe key (tasks in another state, or missing, are in neither)."""

    requeued: list[int]
    skipped: list[int]


def requeue(
    conn: psycopg.Connection, schema: str, ids: Sequence[int], *, dry_run: bool = False
) -> Requeued:
    """failed or cancelled -> queued, due now, with fresh attempts, for each of ``ids`` whose
    dedupe key is free (schema/0016, requeue); wakes idle workers. One statement, inside the
    caller's transaction if one is open."""
    row = conn.execute(
        statements(schema)["requeue"], {"ids": int_array(ids), "dry_run": dry_run}
    ).fetchone()
    assert row is not None
    return Requeued(list(row[0]), list(row[1]))


def cancel_tasks(
    conn: psycopg.Connection, schema: str, ids: Sequence[int], *, by: str | None
) -> list[tuple[int, str, str | None]]:
    """Cancel each of ``ids`` for ``by`` (None: the database role): (id, outcome, state) per id,
    in order (schema/0010, cancel_tasks)."""
    rows = conn.execute(statements(schema)["cancel_tasks"], {"ids": list(ids), "by": by})
    return [(int(i), outcome, state) for i, outcome, state in rows.fetchall()]


def cancel_workflow(
    conn: psycopg.Connection, schema: str, workflow_id: int, *, by: str | None
) -> int:
    """Cancel every step of ``workflow_id`` that has not finished, for ``by`` (None: the database
    role): returns how many were cancelled or asked to stop (schema/0022, cancel_workflow)."""
    row = conn.execute(
        statements(schema)["cancel_workflow"], {"id": workflow_id, "by": by}
    ).fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def delete_tasks(conn: psycopg.Connection, schema: str, ids: Sequence[int]) -> int:
    """Delete the tasks among ``ids`` that no worker is running; returns how many went."""
    row = conn.execute(statements(schema)["delete_tasks"], {"ids": list(ids)}).fetchone()
    return int(row[0]) if row else 0


@dataclass(slots=True)
class BulkStep:
    """Rows read (at most the batch), matched by the filter, changed; ids skipped (retry: dedupe
    key taken); a few matched ids; where the state's next batch starts (None: it is done)."""

    examined: int
    matched: int
    changed: int
    skipped: list[int]
    sample: list[int]
    cursor: Any


def bulk_step(
    conn: psycopg.Connection,
    schema: str,
    *,
    action: str,
    states: Sequence[str],
    filter: Mapping[str, Any],
    cursor: Any,
    batch: int,
    dry_run: bool,
) -> BulkStep:
    """One batch of a bulk retry (-> queued), cancel (-> cancelled) or delete over the rows of
    one walk (one state, or done and cancelled), in a transaction of its own (schema/0008);
    never a running row. ``dry_run`` only counts."""
    with conn.transaction():
        row = conn.execute(
            statements(schema)["bulk_step"],
            {
                "action": action,
                "states": list(states),
                "filter": Jsonb(dict(filter)),
                "batch": batch,
                "cursor": None if cursor is None else Jsonb(cursor),
                "dry_run": dry_run,
            },
        ).fetchone()
    assert row is not None
    return BulkStep(row[0], row[1], row[2], list(row[3]), list(row[4]), row[5])


__all__ = [
    "BulkStep",
    "Requeued",
    "bulk_step",
    "cancel_tasks",
    "cancel_workflow",
    "delete_tasks",
    "requeue",
]
