"""Apply ``schema/NNNN_*.sql`` in order, once each, from any number of processes at once."""

from __future__ import annotations

import contextlib
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import psycopg
from psycopg import sql

from ..errors import SchemaMissing
from .sql import render, validate_schema_name

_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
# Two-key advisory lock namespace: (this application, this schema). See locks for the hashing.
MIGRATE_LOCK_CLASS = 0x776B7201 - 2**31  # fits in int4
DEFAULT_SCHEMA = "worker"


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    text: str


def schema_dir() -> Path:
    """``schema/`` ships inside the wheel as ``worker/schema``; in a source checkout it sits
    beside the package."""
    packaged = Path(str(resources.files("worker"))) / "schema"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent.parent / "schema"


def migrations() -> list[Migration]:
    found: list[Migration] = []
    for path in sorted(schema_dir().glob("*.sql")):
        match = _FILE.match(path.name)
        if match:
            found.append(Migration(int(match.group(1)), match.group(2), path.read_text()))
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise RuntimeError(f"duplicate migration versions in {schema_dir().name}/")
    return found


def latest_version() -> int:
    return max((m.version for m in migrations()), default=0)


def _lock_key(schema: str) -> int:
    return zlib.crc32(schema.encode()) - 2**31


def migrate(conn: psycopg.Connection, schema: str, *, up_to: int | None = None) -> list[str]:
    """Apply pending migrations, each in a transaction of its own, and return their names;
    ``up_to`` stops at that version (Django's migrations apply the schema one version each).

    A transaction-level advisory lock serializes concurrent migrators (they wait, then find
    nothing to do), works behind a transaction-pooling PgBouncer, and is released even if the
    migrating process dies. Each file is all-or-nothing: a failing migration leaves the schema at
    the previous version. One transaction per file because PostgreSQL cannot use an enum value
    in the transaction that added it (0005 adds one, 0006 uses it).
    """
    validate_schema_name(schema)
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        raise RuntimeError("migrate() needs a connection outside any transaction")
    applied: list[str] = []
    while True:
        name = _apply_next(conn, schema, up_to)
        if name is None:
            return applied
        applied.append(name)


def _apply_next(conn: psycopg.Connection, schema: str, up_to: int | None) -> str | None:
    """Apply the first pending migration (up to ``up_to``) in one transaction; None when none is
    pending."""
    ident = sql.Identifier(schema)
    with conn.transaction():
        conn.execute(
            "SELECT pg_advisory_xact_lock(%s, %s)", (MIGRATE_LOCK_CLASS, _lock_key(schema))
        )
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(ident))
        conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {}.schema_migrations ("
                " version integer PRIMARY KEY, name text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            ).format(ident)
        )
        done = {
            row[0]
            for row in conn.execute(
                sql.SQL("SELECT version FROM {}.schema_migrations").format(ident)
            )
        }
        for m in migrations():
            if m.version in done:
                continue
            if up_to is not None and m.version > up_to:
                return None
            conn.execute(render(m.text, schema))
            conn.execute(
                sql.SQL("INSERT INTO {}.schema_migrations (version, name) VALUES (%s, %s)").format(
                    ident
                ),
                (m.version, m.name),
            )
            return f"{m.version:04d}_{m.name}"
    return None


def current_version(conn: psycopg.Connection, schema: str) -> int:
    """The highest applied migration, or 0 when the schema has never been migrated."""
    validate_schema_name(schema)
    row = conn.execute(
        "SELECT to_regclass(%s) IS NOT NULL", (f"{schema}.schema_migrations",)
    ).fetchone()
    if not row or not row[0]:
        return 0
    row = conn.execute(
        sql.SQL("SELECT coalesce(max(version), 0) FROM {}.schema_migrations").format(
            sql.Identifier(schema)
        )
    ).fetchone()
    return int(row[0]) if row else 0


def require_schema(conn: psycopg.Connection, schema: str) -> int:
    """Fail with an actionable message unless the schema is migrated to this code's version."""
    version = current_version(conn, schema)
    if version == 0 or version < latest_version():
        raise schema_missing(schema, version)
    return version


def migrate_command(schema: str) -> str:
    """The command that migrates ``schema`` (the default schema needs no flag)."""
    return "worker migrate" if schema == DEFAULT_SCHEMA else f"worker migrate --schema {schema}"


def schema_missing(
    schema: str, version: int | None, *, needed: int | None = None, fix: str | None = None
) -> SchemaMissing:
    """The error for a schema found at ``version`` (0: no worker tables; None: not known), as
    one line naming ``fix`` (default: the ``worker migrate`` command for that schema)."""
    needed = latest_version() if needed is None else needed
    run = f"run `{fix or migrate_command(schema)}`"
    if version == 0:
        text = f"schema {schema!r} has no worker tables in this database: {run}"
    elif version is None:
        text = (
            f"schema {schema!r} is not migrated to version {needed}, which this version of "
            f"worker-pg needs: {run}"
        )
    else:
        text = (
            f"schema {schema!r} is at version {version}; this version of worker-pg needs "
            f"{needed}: {run}"
        )
    return SchemaMissing(text, schema=schema, version=version, needed=needed)


# What PostgreSQL says when a statement names an object its schema lacks, and the version that
# tells: no schema (invalid_schema_name) or no table (undefined_table) is no worker tables at
# all; no function of that name and arguments (undefined_function) is none, or an older one.
_ABSENT: dict[str, int | None] = {"3F000": 0, "42P01": 0, "42883": None}


def missing_from(exc: psycopg.Error, schema: str) -> SchemaMissing | None:
    """The ``SchemaMissing`` a database error means when one of our statements named an object
    ``schema`` lacks; None for any other error. Read from the error alone, without a query (the
    caller's transaction may be aborted), so it costs nothing until a statement fails."""
    absent = _ABSENT.get(exc.sqlstate or "", -1)
    if absent == -1:
        return None
    diag = exc.diag
    # Ours fail while the statement itself is resolved: no context, and the message names the
    # schema. The same errors from inside a function or trigger (a user's trigger on our table)
    # carry a context, and are theirs to read.
    if diag.context or schema not in (diag.message_primary or ""):
        return None
    return schema_missing(schema, absent)


@contextlib.contextmanager
def schema_errors(schema: str) -> Iterator[None]:
    """Around statements on the queue's tables: a missing or older schema raises
    ``SchemaMissing`` (one line naming the fix) instead of PostgreSQL's error."""
    try:
        yield
    except psycopg.Error as exc:
        missing = missing_from(exc, schema)
        if missing is None:
            raise
        raise missing from None
