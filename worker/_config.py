"""Where the database is, and how to talk about it without leaking its password."""

from __future__ import annotations

import logging
import os
import re
import sys
from urllib.parse import urlsplit, urlunsplit

from psycopg.conninfo import conninfo_to_dict

from ._errors import ConfigError

log = logging.getLogger("worker")

DSN_ENV = ("WORKER_DSN", "DATABASE_URL")
_SECRETS: set[str] = set()


def remember_secret(dsn: str) -> None:
    """Note a DSN's password so that ``SecretFilter`` can scrub it from any log line."""
    try:
        password = conninfo_to_dict(dsn).get("password")
    except Exception:
        password = None
    if password:
        _SECRETS.add(str(password))


def redact(dsn: str) -> str:
    """The DSN with its password replaced by ``***``, for messages and pages."""
    if "://" in dsn:
        parts = urlsplit(dsn)
        if parts.password:
            netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
            return urlunsplit(parts._replace(netloc=netloc))
        return dsn
    return re.sub(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", r"\1***", dsn)


def scrub(text: str) -> str:
    for secret in _SECRETS:
        text = text.replace(secret, "***")
    return text


class SecretFilter(logging.Filter):
    """Last line of defence: no remembered password reaches a log handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _SECRETS:
            record.msg = scrub(record.getMessage())
            record.args = None
        return True


def dsn_from_env() -> str | None:
    for name in DSN_ENV:
        value = os.environ.get(name)
        if value:
            return value
    return None


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
    from ._embedded import EmbeddedError, default_data_dir, ensure_embedded

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
