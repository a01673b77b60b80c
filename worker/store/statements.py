"""The store's own statements: the ``.sql`` files of this room, loaded apart from the core's set
(``worker.db.sql.queries``), so that no other room can run a statement that changes a task row
by name. Only the modules of this room use it."""

from __future__ import annotations

from pathlib import Path

from ..db.sql import Queries
from ..db.sql import statements as _load

HERE = Path(__file__).resolve().parent


def statements(schema: str) -> Queries:
    """The store's statements rendered for ``schema`` (cached by the loader)."""
    return _load(schema, HERE)


__all__ = ["statements"]
