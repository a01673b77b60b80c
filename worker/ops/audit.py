"""The record of operator actions: one table (``actions``, schema/0008, 0016 and 0019) for every
action an operator takes, whatever it came through (the CLI, the console, psql, the Python API):
who, what, on which tasks, how many, from where, and how it ended (finished, or interrupted
between two batches and by what).

Passwords are scrubbed from every string before it is written, so a DSN pasted into a filter or
a name stays out of the record.
"""

from __future__ import annotations

import getpass
import socket
from typing import Any

from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from ..db.connect import Target, borrow
from ..db.dsn import scrub
from ..db.sql import execute, queries

ACTOR_CHARS = 200
ADDRESS_CHARS = 100


def clean(value: Any) -> Any:
    """Strings without passwords (a DSN pasted into a filter or an actor stays out of the
    record), however deep in a filter they sit."""
    if isinstance(value, str):
        return scrub(value)
    if isinstance(value, dict):
        return {clean(k): clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean(v) for v in value]
    return value


def default_actor() -> str:
    """Who runs this process, as the record of actions names a person at a terminal:
    ``user@host`` (the OS user, never a database credential)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname() or 'unknown'}"[:ACTOR_CHARS]


def record_action(
    target: Target,
    schema: str,
    *,
    actor: str,
    action: str,
    filter: dict[str, Any] | None = None,
    counts: dict[str, Any] | None = None,
    source: str = "",
    address: str = "",
    finished: bool = True,
) -> int:
    """Add a row to the record of operator actions (``<schema>.actions``) and return its id: who
    (``actor``, cut to 200 characters), what (``action``), on which tasks (``filter``: any JSON
    object, e.g. ``{"ids": [42]}`` or ``{"queue": "mail"}``), how many (``counts``, e.g.
    ``{"changed": 1}``), through what (``source``: "cli", "console", "sql", "python", ...) and
    from where (``address``: the console's client). Passwords are scrubbed from every string.
    ``finished=False`` for an action that reports its counts later (``finish_action``)."""
    with borrow(target) as conn:
        rows = execute(
            conn,
            queries(schema)["action_record"],
            {
                "actor": clean(actor)[:ACTOR_CHARS] or "unknown",
                "action": clean(action)[:100],
                "filter": Jsonb(clean(filter or {})),
                "counts": Jsonb(clean(counts or {})),
                "source": clean(source)[:200],
                "address": clean(address)[:ADDRESS_CHARS],
                "finished": finished,
            },
        )
    return int(rows[0][0])


def finish_action(
    target: Target,
    schema: str,
    action_id: int,
    counts: dict[str, Any] | None,
    *,
    finished: bool = True,
    interrupted: str | None = None,
) -> None:
    """Set the counts of a recorded action (None: keep those recorded) and how it ended:
    finished (``finished_at`` now), interrupted between two batches by ``interrupted`` (a
    signal's name; ``finished_at`` now too), or neither (``finished=False``: still running, its
    counts so far)."""
    with borrow(target) as conn:
        execute(
            conn,
            queries(schema)["action_finish"],
            {
                "id": action_id,
                "counts": None if counts is None else Jsonb(clean(counts)),
                "finished": finished,
                "interrupted": None if interrupted is None else clean(interrupted)[:100],
            },
        )


def recent_actions(target: Target, schema: str, limit: int = 50) -> list[dict[str, Any]]:
    """The newest recorded actions, newest first."""
    with borrow(target) as conn, conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(queries(schema)["actions_recent"], {"limit": limit}).fetchall()


__all__ = [
    "ACTOR_CHARS",
    "clean",
    "default_actor",
    "finish_action",
    "recent_actions",
    "record_action",
]
