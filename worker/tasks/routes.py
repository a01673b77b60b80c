"""Routes: the queue each task's rows land in when their producer names none (schema/0006).

Workers record the routes of their handlers when they start; ``worker migrate --module`` records
them ahead of any worker, so that the first enqueue after a deploy cannot race the workers'
start and land in ``default``.
"""

from __future__ import annotations

import psycopg

from ..db.sql import queries
from .registry import Registry


def of(registry: Registry) -> dict[str, str]:
    """The queue of each task of ``registry``."""
    return {name: d.queue for name in registry.names() if (d := registry.get(name))}


def record(conn: psycopg.Connection, schema: str, routes: dict[str, str]) -> None:
    """Write ``routes`` (task -> queue) to the schema's route table."""
    if routes:
        conn.execute(
            queries(schema)["record_routes"],
            {"tasks": list(routes), "queues": list(routes.values())},
        )


def routed(conn: psycopg.Connection, schema: str, task: str) -> bool:
    """Whether any worker has declared ``task`` (a producer's typo never is)."""
    row = conn.execute(queries(schema)["task_routed"], {"task": task}).fetchone()
    return bool(row and row[0])


__all__ = ["of", "record", "routed"]
