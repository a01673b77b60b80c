"""Where the database is, and how to talk about it without leaking its password."""

from __future__ import annotations

import logging
import os
import re
from urllib.parse import urlsplit, urlunsplit

from psycopg.conninfo import conninfo_to_dict

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
