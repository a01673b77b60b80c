"""Apply ``schema/NNNN_*.sql`` in order, once each, from any number of processes at once.

A file is applied in one transaction, except what follows its ``-- worker:online`` line: index
builds on tables that may hold millions of rows (``CREATE INDEX CONCURRENTLY IF NOT EXISTS``),
and drops of the indexes they replace. Those run after that transaction commits, one at a time,
and take no lock that stops the workers reading or writing the table: a database upgrades while
its workers drain. The version is recorded with the transaction, incomplete until its online
statements are done, and any ``migrate`` finishes an incomplete version before it applies the
next (an interrupted build leaves an invalid index, dropped and built again).

The transaction waits at most ``LOCK_TIMEOUT`` for each lock: a transaction left open on a table
it alters (a report in psql) would otherwise queue every worker's statement behind the
migration's lock for as long as it stays open. It gives up, lets them through, and tries again.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import psycopg
from psycopg import sql

from ..errors import SchemaMissing
from .sql import render, validate_schema_name

log = logging.getLogger("worker")

_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
ONLINE_MARK = "-- worker:online"
_ONLINE = re.compile(
    r"^(?:CREATE (?:UNIQUE )?INDEX CONCURRENTLY IF NOT EXISTS (?P<built>\w+) ON "
    r"|DROP INDEX CONCURRENTLY IF EXISTS \{schema\}\.\w+$)"
)
# Longest the migration's transaction waits for one lock, and how often it tries again.
LOCK_TIMEOUT = 2.0
LOCK_TRIES = 60
# Two-key advisory lock namespace: (this application, this schema). See locks for the hashing.
MIGRATE_LOCK_CLASS = 0x776B7201 - 2**31  # fits in int4
DEFAULT_SCHEMA = "worker"


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    text: str  # the part applied in one transaction
    online: tuple[str, ...] = ()  # run after it commits, outside any transaction

    @property
    def built(self) -> list[str]:
        """The indexes the online statements build."""
        return [m["built"] for s in self.online if (m := _ONLINE.match(s)) and m["built"]]


def parse(version: int, name: str, text: str) -> Migration:
    """A migration file: its transaction, and the statements after ``-- worker:online`` (each
    ends with ``;`` at the end of a line; only idempotent index builds and drops)."""
    head, mark, tail = text.partition(f"\n{ONLINE_MARK}\n")
    if not mark:
        return Migration(version, name, text)
    online = []
    for chunk in re.split(r";[ \t]*\n", tail):
        statement = _statements(chunk)
        if not statement:
            continue
        if not _ONLINE.match(statement):
            raise RuntimeError(f"migration {version:04d}: not an online statement: {statement}")
        online.append(statement)
    return Migration(version, name, head, tuple(online))


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
            found.append(parse(int(match.group(1)), match.group(2), path.read_text()))
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise RuntimeError(f"duplicate migration versions in {schema_dir().name}/")
    return found


def latest_version() -> int:
    return max((m.version for m in migrations()), default=0)


def _lock_key(schema: str) -> int:
    return zlib.crc32(schema.encode()) - 2**31


def migrate(conn: psycopg.Connection, schema: str, *, up_to: int | None = None) -> list[str]:
    """Apply pending migrations, each in a transaction of its own followed by its online
    statements, and return their names; ``up_to`` stops at that version (Django's migrations
    apply the schema one version each).

    A transaction-level advisory lock serializes concurrent migrators (they wait, then find
    nothing to do), works behind a transaction-pooling PgBouncer, and is released even if the
    migrating process dies. Each file's transaction is all-or-nothing: a failing migration leaves
    the schema at the previous version. One transaction per file because PostgreSQL cannot use an
    enum value in the transaction that added it (0005 adds one, 0006 uses it).
    """
    validate_schema_name(schema)
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        raise RuntimeError("migrate() needs a connection outside any transaction")
    applied: list[str] = []
    _begin(conn, schema)
    while True:
        step = _with_locks_retried(lambda: _apply_next(conn, schema, up_to))
        if step is None:
            return applied
        m, new = step
        if m.online:
            _finish_online(conn, schema, m)
        if new:
            applied.append(f"{m.version:04d}_{m.name}")


def _begin(conn: psycopg.Connection, schema: str) -> None:
    """Create the schema and its record of migrations if need be."""
    ident = sql.Identifier(schema)
    with conn.transaction():
        _lock(conn, schema)
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(ident))
        conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {}.schema_migrations ("
                " version integer PRIMARY KEY, name text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now(),"
                " complete boolean NOT NULL DEFAULT true)"
            ).format(ident)
        )
        # Recorded before online statements existed: every version was complete. Looked up
        # first, so that a migrate with nothing to do takes no lock on the table.
        known = conn.execute(
            "SELECT 1 FROM pg_attribute"
            " WHERE attrelid = to_regclass(%s) AND attname = 'complete' AND NOT attisdropped",
            (f"{sql.Identifier(schema).as_string(conn)}.schema_migrations",),
        ).fetchone()
        if not known:
            conn.execute(
                sql.SQL(
                    "ALTER TABLE {}.schema_migrations"
                    " ADD COLUMN complete boolean NOT NULL DEFAULT true"
                ).format(ident)
            )


def _lock(conn: psycopg.Connection, schema: str) -> None:
    conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", (MIGRATE_LOCK_CLASS, _lock_key(schema)))


def _apply_next(
    conn: psycopg.Connection, schema: str, up_to: int | None
) -> tuple[Migration, bool] | None:
    """Apply the transaction of the first pending migration (up to ``up_to``): (it, True). Or,
    while a version's online statements have not all run (another migrator runs them now, or
    one stopped in the middle of them), that version and False: it is finished before anything
    else is applied. None when nothing is pending."""
    ident = sql.Identifier(schema)
    with conn.transaction():
        _lock(conn, schema)
        done = dict(
            conn.execute(
                sql.SQL("SELECT version, complete FROM {}.schema_migrations").format(ident)
            ).fetchall()
        )
        for m in migrations():
            if done.get(m.version) is False:
                return m, False
            if m.version in done:
                continue
            if up_to is not None and m.version > up_to:
                return None
            # After the advisory lock: another migrator may hold that one for long.
            conn.execute("SELECT set_config('lock_timeout', %s, true)", (f"{LOCK_TIMEOUT}s",))
            if _statements(m.text):
                conn.execute(render(m.text, schema))
            conn.execute(
                sql.SQL(
                    "INSERT INTO {}.schema_migrations (version, name, complete) VALUES (%s, %s, %s)"
                ).format(ident),
                (m.version, m.name, not m.online),
            )
            return m, True
    return None


def _with_locks_retried(
    apply: Callable[[], tuple[Migration, bool] | None],
) -> tuple[Migration, bool] | None:
    """``apply`` again while a lock it needs stays taken past ``LOCK_TIMEOUT``; in between, the
    statements that queued behind its lock run."""
    for attempt in range(1, LOCK_TRIES + 1):
        try:
            return apply()
        except psycopg.errors.LockNotAvailable as exc:
            if attempt == LOCK_TRIES:
                # A database error, as the CLI reports them (exit 5).
                raise psycopg.errors.LockNotAvailable(
                    f"migration gave up after {LOCK_TRIES} tries: another transaction kept a "
                    f"lock it needs ({_first_line(exc)}); end that transaction and run it again"
                ) from None
            log.warning(
                "migration waits for a lock another transaction holds (%s); trying again",
                _first_line(exc),
            )
            time.sleep(min(0.5 * attempt, 5.0))
    return None


def _finish_online(conn: psycopg.Connection, schema: str, m: Migration) -> None:
    """Run the online statements of ``m`` (its transaction committed), then mark it complete."""
    autocommit = conn.autocommit
    conn.autocommit = True
    try:
        for statement in m.online:
            _run_online(conn, schema, statement)
    finally:
        conn.autocommit = autocommit
    with conn.transaction():
        _lock(conn, schema)
        bad = [name for name in m.built if _invalid(conn, schema, name)]
        if bad:
            raise psycopg.errors.ObjectNotInPrerequisiteState(
                f"migration {m.version:04d} left index {bad[0]} invalid; run it again"
            )
        conn.execute(
            sql.SQL("UPDATE {}.schema_migrations SET complete = true WHERE version = %s").format(
                sql.Identifier(schema)
            ),
            (m.version,),
        )


def _run_online(conn: psycopg.Connection, schema: str, statement: str) -> None:
    """One online statement, once no other session builds an index in the schema.

    Two concurrent builds on one table can deadlock: each waits for the other's transaction to
    end. So a migrator waits for another's build by polling from here, where it holds no
    transaction (nor a session-level lock, which a transaction-pooling PgBouncer would strand on
    one of its connections), and tries again if the database broke a deadlock all the same. An
    index left invalid by an interrupted build is dropped and built again; one already there is
    left alone (IF NOT EXISTS)."""
    built = _ONLINE.match(statement)
    for attempt in range(1, LOCK_TRIES + 1):
        while _building_elsewhere(conn, schema):
            time.sleep(0.2)
        try:
            if built and built["built"] and _invalid(conn, schema, built["built"]):
                conn.execute(
                    sql.SQL("DROP INDEX CONCURRENTLY IF EXISTS {}.{}").format(
                        sql.Identifier(schema), sql.Identifier(built["built"])
                    )
                )
            conn.execute(render(statement, schema))
            return
        except psycopg.errors.DeadlockDetected:
            if attempt == LOCK_TRIES:
                raise
            time.sleep(0.1 * attempt)


def _building_elsewhere(conn: psycopg.Connection, schema: str) -> bool:
    """Whether another session builds an index on a table of ``schema`` now."""
    row = conn.execute(
        "SELECT EXISTS (SELECT 1 FROM pg_stat_progress_create_index AS p"
        "  JOIN pg_class AS c ON c.oid = p.relid JOIN pg_namespace AS n ON n.oid = c.relnamespace"
        " WHERE p.pid <> pg_backend_pid() AND n.nspname = %s)",
        (schema,),
    ).fetchone()
    return bool(row and row[0])


def _invalid(conn: psycopg.Connection, schema: str, index: str) -> bool:
    """Whether ``index`` exists and is invalid (a build failed or is under way)."""
    row = conn.execute(
        "SELECT NOT i.indisvalid"
        "  FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid"
        "  JOIN pg_namespace AS n ON n.oid = c.relnamespace"
        " WHERE n.nspname = %s AND c.relname = %s",
        (schema, index),
    ).fetchone()
    return bool(row and row[0])


def _statements(text: str) -> str:
    """``text`` without its comment lines and blank lines."""
    return "\n".join(
        line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("--")
    ).strip()


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip() or type(exc).__name__).splitlines()[0]


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
