"""Who is attached to the embedded server: worker processes connected to it, per database, so
that stopping it can first say what it leaves retrying."""

from __future__ import annotations

from pathlib import Path

from ...db.connect import CLI, connect
from ...db.sql import queries

SQL_DIR = Path(__file__).resolve().parent


def attached_workers(dsn: str) -> list[tuple[str, int]]:
    """(database, worker processes) for each database with workers connected; raises
    psycopg.Error when the server cannot be asked."""
    with connect(dsn, CLI) as conn:
        rows = conn.execute(queries("worker", SQL_DIR)["embedded_attached_workers"]).fetchall()
    return [(str(db), int(n)) for db, n in rows]


__all__ = ["attached_workers"]
