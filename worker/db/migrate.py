"""Apply ``schema/NNNN_*.sql`` in order, once each, from any number of processes at once."""

from __future__ import annotations

import re
import zlib
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


def migrate(conn: psycopg.Connection, schema: str) -> list[str]:
    """Apply pending migrations, each in a transaction of its own, and return their names.

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
        name = _apply_next(conn, schema)
        if name is None:
            return applied
        applied.append(name)


def _apply_next(conn: psycopg.Connection, schema: str) -> str | None:
    """Apply the first pending migration in one transaction; None when none is pending."""
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
    want = latest_version()
    if version == 0:
        raise SchemaMissing(
            f"schema {schema!r} has no worker tables in this database: run `worker migrate` first"
        )
    if version < want:
        raise SchemaMissing(
            f"schema {schema!r} is at version {version}, this worker needs {want}: "
            "run `worker migrate`"
        )
    return version
