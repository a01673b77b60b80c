"""What every command shares: one-line errors, the DSN (with the embedded server as
the fallback), connecting, tables, JSON output, importing the user's module, and logging."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import os
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg

from ..db import connect as factory
from ..db.dsn import dsn_source_from_env, parse_dsn, redact, scrub
from ..db.migrate import require_schema
from ..db.outage import unreachable
from ..dev.embedded import (
    EmbeddedError,
    EmbeddedPostgres,
    EmbeddedUnavailable,
    default_data_dir,
)
from ..errors import ConfigError
from . import exits
from .text import CELL_LIMIT, SafeFormatter, bounded, safe

log = logging.getLogger("worker")


class CliError(Exception):
    """A one-line message for the user, with its exit code."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


# Commands that only read: without a DSN they use the embedded server if it is running, and
# say so if it is not, rather than creating or starting one to show an empty queue.
READ_ONLY_COMMANDS = frozenset({"status", "doctor", "wait", "cron", "locks"})


def connect(args: argparse.Namespace) -> psycopg.Connection:
    quiet = getattr(args, "json", False)
    return connect_dsn(resolve_dsn(args.dsn, quiet=quiet, start=starts(args)))


def starts(args: argparse.Namespace) -> bool:
    """Whether this command may start (or create) the embedded server."""
    return getattr(args, "command", None) not in READ_ONLY_COMMANDS


def require(conn: psycopg.Connection, schema: str) -> None:
    require_schema(conn, schema)


def print_json(data: Any) -> None:
    """JSON with every string bounded (64 KiB) and scrubbed of passwords; json.dumps escapes
    control characters, so the output stays valid JSON a terminal shows as text."""
    text = json.dumps(data, default=json_default)  # datetimes etc. to strings first
    print(json.dumps(bounded(json.loads(text)), indent=2))


def json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def import_tasks(module: str) -> None:
    """Import the user's module (which registers handlers), from a dotted name or a .py path."""
    sys.path.insert(0, os.getcwd())
    try:
        if module.endswith(".py") or os.sep in module:
            path = Path(module)
            if not path.is_file():
                raise CliError(f"cannot import {module!r}: no such file", 2)
            spec = importlib.util.spec_from_file_location(path.stem, path)
            assert spec and spec.loader
            mod = importlib.util.module_from_spec(spec)
            sys.modules[path.stem] = mod
            spec.loader.exec_module(mod)
        else:
            importlib.import_module(module)
    except CliError:
        raise
    except ModuleNotFoundError as exc:
        raise CliError(
            f"cannot import module {module!r}: {exc} (is it on PYTHONPATH, or in this folder?)", 2
        ) from None
    except Exception as exc:
        raise CliError(f"importing {module!r} failed: {type(exc).__name__}: {exc}", 2) from None


def connect_dsn(dsn: str) -> psycopg.Connection:
    """Connect, or fail with one line that names the database without its password. The
    driver's message is scrubbed too: libpq quotes the values it rejects."""
    try:
        return factory.connect(dsn, factory.CLI)
    except psycopg.Error as exc:
        text = str(exc).strip()
        first = scrub(text.splitlines()[0]) if text else type(exc).__name__
        # A DSN the driver cannot parse is the user's input; anything else means the server
        # could not be reached or turned the connection down.
        code = exits.UNREACHABLE if isinstance(exc, psycopg.OperationalError) else exits.USAGE
        raise CliError(
            f"cannot connect to the database at {redact(dsn)}: {first} "
            "(check --dsn, WORKER_DSN or DATABASE_URL)",
            code,
        ) from None


# The schema's CHECK constraints (schema/*.sql), as what the user typed.
CONSTRAINTS = {
    "tasks_task_not_empty": "the task name must not be empty",
    "tasks_queue_not_empty": "--queue must not be empty",
    "tasks_priority_range": "--priority must be from -1000000 to 1000000",
    "tasks_max_attempts_positive": "--max-attempts must be at least 1",
    "locks_name_length": "a lock name must be 1 to 255 characters",
    "locks_holder_not_empty": "a lock holder must not be empty",
    "cron_schedules_key_not_empty": "a cron schedule key must not be empty",
}


def database_error(exc: psycopg.Error) -> tuple[str, int]:
    """One line for a database error, and its exit code: 2 for a value the database refused (a
    constraint or a bad value names the field, not the statement), 4 for a connection lost or
    refused, 5 for the rest."""
    text = str(exc).strip()
    first = scrub(text.splitlines()[0]) if text else type(exc).__name__
    constraint = getattr(getattr(exc, "diag", None), "constraint_name", None)
    if constraint in CONSTRAINTS:
        return f"invalid input: {CONSTRAINTS[constraint]}", 2
    if isinstance(exc, psycopg.errors.IntegrityError):
        return f"invalid input: refused by the database ({constraint or first})", 2
    if isinstance(exc, psycopg.DataError):
        return f"invalid input: {first}", 2
    if unreachable(exc):
        return f"lost the database: {first}", exits.UNREACHABLE
    return f"database error: {first}", exits.DATABASE


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def table(head: list[str], rows: list[list[Any]]) -> None:
    """Columns of text; every cell made terminal-safe and cut to CELL_LIMIT characters."""
    rows = [[safe(c, CELL_LIMIT) for c in row] for row in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=False)]
    for row in [head, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=False)).rstrip())


def checked_dsn(dsn: str, source: str) -> str:
    """A DSN that parses (else one line naming ``source``, never the DSN): the driver's own parse
    errors would quote it, password included."""
    parse_dsn(dsn, source)
    return dsn


def resolve_dsn(explicit: str | None, *, quiet: bool = False, start: bool = True) -> str:
    """--dsn, then WORKER_DSN or DATABASE_URL, then the embedded server: started (created on
    first use) when ``start``, else only if it is already running. One line on stderr says which
    server and what was done to it, unless ``quiet`` (JSON output)."""
    if explicit:
        return checked_dsn(explicit, "--dsn")
    found = dsn_source_from_env()
    if found:
        return checked_dsn(*found)
    data_dir = default_data_dir()
    server = EmbeddedPostgres(data_dir)
    try:
        if not start and not server.is_running():
            raise CliError(
                f"no DSN given, and the embedded PostgreSQL in {data_dir} is not running: "
                "start it with `worker embedded start` (or `worker migrate`, `worker run`, "
                "`worker demo`), or give --dsn or WORKER_DSN",
                exits.UNREACHABLE,
            )
        dsn = server.start()
    except EmbeddedUnavailable as exc:
        raise CliError(
            f"no DSN given (--dsn, WORKER_DSN or DATABASE_URL), and {exc}", exits.USAGE
        ) from None
    except EmbeddedError as exc:
        raise ConfigError(str(exc)) from None
    if not quiet:
        done = {"created": "created it now", "started": "started it now"}.get(
            server.last_start or "", "already running"
        )
        print(
            f"worker: no DSN given; using the embedded PostgreSQL in {data_dir} ({done}), "
            f"{redact(dsn)}",
            file=sys.stderr,
        )
    return dsn


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(
        SafeFormatter("%(asctime)s %(levelname)s %(name)s[%(process)d] %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("psycopg.pool").setLevel(logging.WARNING)
