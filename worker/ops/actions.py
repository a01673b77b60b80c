"""Operator actions on tasks named by id: retry, cancel and delete, one task (the CLI's
``worker retry ID``) or many (the console's selections), the steps of a workflow (cancel), and the
console's entry in the record of actions.

Every change goes through the store: a retry through its one retry (``requeue``, whose dedupe
check leaves a task alone while a live task holds its key; a workflow's failed step resumes the
workflow from there), a cancel through ``cancel_tasks`` (a workflow's through
``cancel_workflow``), a delete through ``delete_tasks``. Each statement re-checks the state of
every row it touches, so ids listed a moment ago that have moved on since are left alone (and not
counted).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import psycopg

from .. import store
from ..coord.cancel import Cancellation, cancel_many
from .audit import recent_actions, record_action

MAX_IDS = 10_000  # ids per action: the console acts on at most this many rows per request


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
    dedupe key a live task holds stay as they are (``skipped``)."""
    done = store.requeue(conn, schema, _ids(ids))
    return Outcome(len(done.requeued), len(done.skipped))


def cancel(conn: psycopg.Connection, schema: str, ids: list[int], *, by: str) -> Outcome:
    """Tasks among ``ids`` that have not started (scheduled or queued) to cancelled, and running
    ones marked for their workers to stop (``requested``; they end cancelled), for ``by``."""
    done = cancel_many(conn, schema, _ids(ids), by=by)
    requested = sum(1 for c in done if c.outcome == "requested")
    # A task asked to stop before (its first request stands) is counted again here: the console
    # says "requested" for it all the same.
    return Outcome(requested + sum(1 for c in done if c.outcome == "cancelled"), 0, requested)


def cancel_one(
    conn: psycopg.Connection, schema: str, task_id: int, *, by: str | None = None
) -> Cancellation:
    """Cancel one task whatever its state (a running one: its worker is asked to stop it)."""
    return cancel_many(conn, schema, [task_id], by=by)[0]


def cancel_workflow(conn: psycopg.Connection, schema: str, workflow_id: int, *, by: str) -> Outcome:
    """Every step of the workflow that has not finished: waiting, scheduled and queued ones to
    cancelled, running ones marked for their workers to stop (they end cancelled), for ``by``.
    ``changed`` counts both (the database's ``cancel_workflow`` says no more)."""
    return Outcome(store.cancel_workflow(conn, schema, int(workflow_id), by=by[:200]))


def delete(conn: psycopg.Connection, schema: str, ids: list[int]) -> Outcome:
    """Delete the tasks among ``ids`` that no worker is running."""
    return Outcome(store.delete_tasks(conn, schema, _ids(ids)))


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
    """Write one console action to the record of actions, on the caller's connection (so it
    commits with the action)."""
    record_action(
        conn,
        schema,
        actor=actor,
        action=action,
        filter=json.loads(json.dumps(dict(target), default=str)),
        counts={"changed": affected},
        source="console",
        address=address,
    )


def recent(conn: psycopg.Connection, schema: str, *, limit: int = 20) -> list[tuple[Any, ...]]:
    """The newest actions, from any source: (id, at, actor, address, action, target, changed,
    interrupted); ``interrupted`` names what stopped an action between two batches (a signal),
    None for one that ran to its end (or runs)."""
    return [
        (
            r["id"],
            r["at"],
            r["actor"],
            r["address"] or r["source"],
            r["action"],
            r["filter"],
            (r["counts"] or {}).get("changed", 0),
            r["interrupted"],
        )
        for r in recent_actions(conn, schema, limit)
    ]


__all__ = [
    "MAX_IDS",
    "Outcome",
    "cancel",
    "cancel_one",
    "cancel_workflow",
    "delete",
    "recent",
    "record",
    "retry",
]
