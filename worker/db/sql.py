"""Named SQL: every statement lives in a ``.sql`` file beside the module that runs it, and the
migrations in ``schema/``.

A ``.sql`` file is a list of statements, each after a ``-- name: NAME`` line, so a reader (or a
DBA) reviews every statement a room runs in one place. The only thing substituted into the text
is the schema name, and only as a validated identifier quoted by psycopg; every value is bound as
a parameter.

``queries(schema)`` is the core's set: the statements of the rooms ``db``, ``tasks``, ``coord``,
``engine`` and ``ops``. The store's statements (every one that changes a task row) are not in it:
the store loads its own (``worker.store.statements``), so no other room can run one by name. The
monitor, the developer tools and the integrations add their own folders
(``queries(schema, folder)``); a worker process never loads theirs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from ..errors import ConfigError

PACKAGE_DIR = Path(__file__).resolve().parent.parent
# The rooms whose statements make the core's set (see the module's docstring).
CORE_ROOMS = ("db", "tasks", "coord", "engine", "ops")

_NAME_LINE = re.compile(r"^--\s*name:\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)
_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")  # fullmatch: "$" would allow a "\n"


def validate_schema_name(name: str) -> str:
    """Refuse anything but a plain lowercase identifier: the name never needs odd quoting."""
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise ConfigError(
            f"invalid schema name {name!r}: use 1-63 lowercase letters, digits or _, "
            "starting with a letter or _"
        )
    return name


def render(text: str, schema: str) -> sql.SQL:
    """Turn SQL text with ``{schema}`` markers into a statement for that schema.

    The name is validated, then quoted by ``sql.Identifier`` once, here: a composed statement
    would be composed again on every execution, which the claim and acknowledgement pay per
    batch. Braces elsewhere in the text (JSON literals, for instance) are left as they are.
    """
    escaped = text.replace("{", "{{").replace("}", "}}").replace("{{schema}}", "{schema}")
    composed = sql.SQL(escaped).format(schema=sql.Identifier(validate_schema_name(schema)))
    return sql.SQL(composed.as_string())


def strip_comment_lines(text: str) -> str:
    """The statement without its whole-line comments and its lines' indentation (the .sql files
    are where they are read). psycopg caches how it converts a statement's placeholders only for
    statements under 4 kB: the claim, with its comments and indentation, was over that and was
    parsed again on every execution (a sixth of a chain's hop). No statement breaks a string
    literal across lines, so the indentation is never part of a value."""
    lines = (line.strip() for line in text.splitlines())
    return "\n".join(line for line in lines if not line.startswith("--"))


def parse_named(text: str) -> dict[str, str]:
    """Split a queries file into ``{name: statement}`` at each ``-- name:`` line."""
    parts = _NAME_LINE.split(text)
    out: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        statement = strip_comment_lines(body).strip().rstrip(";").strip()
        if name in out:
            raise ValueError(f"query {name!r} is defined twice")
        out[name] = statement
    return out


@cache
def _statements(folders: tuple[Path, ...]) -> dict[str, str]:
    """The named statements of every ``.sql`` file directly in ``folders``; a name may be
    defined once across them all."""
    merged: dict[str, str] = {}
    for folder in folders:
        for path in sorted(folder.glob("*.sql")):
            for name, statement in parse_named(path.read_text()).items():
                if name in merged:
                    raise ValueError(f"query {name!r} is defined in two files")
                merged[name] = statement
    return merged


class Queries:
    """The named statements of some folders, rendered for one schema; build once and reuse."""

    def __init__(self, schema: str, folders: tuple[Path, ...]) -> None:
        self.schema = validate_schema_name(schema)
        raw = _statements(folders)
        self._rendered = {name: render(text, schema) for name, text in raw.items()}

    def __getitem__(self, name: str) -> sql.SQL:
        return self._rendered[name]

    def __contains__(self, name: object) -> bool:
        return name in self._rendered


@cache
def statements(schema: str, *folders: Path) -> Queries:
    """The statements of exactly these folders, for ``schema`` (cached)."""
    return Queries(schema, tuple(folders))


@cache
def queries(schema: str, *more: Path) -> Queries:
    """The core's statements for ``schema``, and those of the ``more`` folders (cached)."""
    return statements(schema, *(PACKAGE_DIR / room for room in CORE_ROOMS), *more)


def notify_channel(schema: str) -> str:
    """The channel the insert trigger notifies (see schema/0001_tasks.sql)."""
    return f"{validate_schema_name(schema)}.tasks"


def cancel_channel(schema: str) -> str:
    """The channel cancel requests for running tasks are sent on (see schema/0010): apart from
    ``notify_channel``, whose payload is a list of queue names."""
    return f"{notify_channel(schema)}_cancel"


def execute(conn: psycopg.Connection, query: Any, params: Mapping[str, Any]) -> list[Any]:
    """One statement in a transaction of its own, whatever the caller's connection: as is on an
    autocommit connection; otherwise in a transaction, or a savepoint inside the caller's open
    transaction (then others see its effect only when the caller commits). Lock and cron
    statements use it so that a tick or an acquire never leaves a transaction open."""
    if conn.autocommit:
        return conn.execute(query, params).fetchall()
    with conn.transaction():
        return conn.execute(query, params).fetchall()
