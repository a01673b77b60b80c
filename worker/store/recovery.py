"""Rescue and retention: the running rows of a dead worker process go back at once
(``worker_died``), rows whose lease lapsed go back on the next pass (``rescue``), and finished
rows past their retention are deleted (``purge``).

Every statement is in ``recovery.sql`` beside this module.
"""

from __future__ import annotations

from datetime import datetime

import psycopg

from .acks import HISTORY
from .statements import statements


def worker_died(
    conn: psycopg.Connection, schema: str, *, worker_id: str, error: str
) -> list[tuple[int, str, str, str]]:
    """A dead worker process's running rows go back now (see recovery.sql, worker_died)."""
    params = {"worker_id": worker_id, "error": error, **HISTORY}
    rows = conn.execute(statements(schema)["worker_died"], params).fetchall()
    return [tuple(r) for r in rows]  # type: ignore[misc]


def first_expired(
    conn: psycopg.Connection, schema: str, *, since: datetime | None
) -> datetime | None:
    """The earliest lease that ran out at ``since`` or later (None: all) among rows still in
    progress, or None when no lease ran out: a rescue from there takes them all. Holds no lock."""
    row = conn.execute(statements(schema)["first_expired"], {"since": since}).fetchone()
    return row[0] if row else None


def rescue(
    conn: psycopg.Connection, schema: str, *, limit: int = 1000, since: datetime | None = None
) -> list[tuple[int, str, str, str]]:
    """Expired in_progress -> queued or failed, of the rows whose lease ran out at ``since`` or
    later (None: all). Returns (id, queue, task, new state) per row."""
    rows = conn.execute(
        statements(schema)["rescue"], {"limit": limit, "since": since, **HISTORY}
    ).fetchall()
    return [tuple(r) for r in rows]  # type: ignore[misc]


def purge(
    conn: psycopg.Connection,
    schema: str,
    *,
    done_seconds: float,
    failed_seconds: float,
    cron_keep_seconds: float,
    limit: int = 5000,
) -> int:
    """Delete one batch of finished rows past retention (with the edges of the workflow steps
    among them, and the workflows left without steps); returns how many rows went."""
    cur = conn.execute(
        statements(schema)["purge"],
        {
            "done_seconds": done_seconds,
            "failed_seconds": failed_seconds,
            "cron_keep_seconds": cron_keep_seconds,
            "limit": limit,
        },
    )
    row = cur.fetchone()
    return int(row[0]) if row else 0


def rotate_history(conn: psycopg.Connection, schema: str, *, done_seconds: float) -> int:
    """Retention of the history (schema/0025): empty the slots past ``done_seconds`` and open the
    next slot when the current one is a slice old; returns how many slots were emptied."""
    row = conn.execute(
        statements(schema)["rotate_history"], {"done_seconds": done_seconds}
    ).fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def settle_missed(conn: psycopg.Connection, schema: str, *, limit: int = 1000) -> int:
    """Workflows: settle steps that finished without their acknowledgement doing it (a rescue,
    a dead worker's hand-back, SQL), and release waiting steps with nothing left to wait for."""
    row = conn.execute(statements(schema)["settle_missed"], {"limit": limit}).fetchone()
    return int(row[0]) if row and row[0] is not None else 0
