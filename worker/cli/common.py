"""What every command shares: one-line errors, flag types, the DSN (with the embedded server as
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
from psycopg.conninfo import conninfo_to_dict

from .._config import SecretFilter, dsn_from_env, redact, remember_secret, scrub
from .._errors import ConfigError
from .._migrate import require_schema
from .._sql import validate_schema_name
from ..dev.embedded import EmbeddedError, default_data_dir, ensure_embedded

log = logging.getLogger("worker")


class CliError(Exception):
    """A one-line message for the user, with its exit code."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number of at least 1, got {value}")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative number of seconds, got {value}")
    return value


def schema_name(text: str) -> str:
    try:
        return validate_schema_name(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def connect(args: argparse.Namespace) -> psycopg.Connection:
    return connect_dsn(resolve_dsn(args.dsn, quiet=getattr(args, "json", False)))


def require(conn: psycopg.Connection, schema: str) -> None:
    require_schema(conn, schema)


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=json_default))


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
    """Connect, or fail with one line that names the database without its password."""
    try:
        return psycopg.connect(dsn, autocommit=True, connect_timeout=10)
    except psycopg.OperationalError as exc:
        first = scrub(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
        raise CliError(
            f"cannot connect to the database at {redact(dsn)}: {first} "
            "(check --dsn, WORKER_DSN or DATABASE_URL)",
            2,
        ) from None


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def table(head: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=False)]
    for row in [head, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=False)).rstrip())


def resolve_dsn(explicit: str | None, *, quiet: bool = False) -> str:
    """--dsn, then WORKER_DSN or DATABASE_URL, then the embedded server (started on demand)."""
    dsn = explicit or dsn_from_env()
    if dsn:
        try:
            conninfo_to_dict(dsn)
        except Exception as exc:
            raise ConfigError(f"invalid DSN {redact(dsn)!r}: {str(exc).splitlines()[0]}") from None
        remember_secret(dsn)
        return dsn
    data_dir = default_data_dir()
    try:
        dsn = ensure_embedded(data_dir)
    except EmbeddedError as exc:
        raise ConfigError(str(exc)) from None
    if not quiet:
        print(
            f"worker: no DSN given; using the embedded PostgreSQL in {data_dir} ({dsn})",
            file=sys.stderr,
        )
    return dsn


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s[%(process)d] %(message)s")
    )
    handler.addFilter(SecretFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("psycopg.pool").setLevel(logging.WARNING)
