"""Where the database is, and how to talk about it without leaking its password.

``redact`` is the one place that turns a DSN into text fit for a message, a log line or a page;
``scrub`` cleans free text (driver errors, log lines) of DSNs and remembered passwords. A DSN
that cannot be parsed is never shown at all: nobody can tell which part of it is the password.
"""

from __future__ import annotations

import logging
import os
import re
from urllib.parse import urlsplit

from psycopg.conninfo import conninfo_to_dict

from ..errors import ConfigError

log = logging.getLogger("worker")

DSN_ENV = ("WORKER_DSN", "DATABASE_URL")
UNPARSEABLE = "(a DSN that cannot be parsed, not shown)"
# Shorter passwords are scrubbed only where they stand in a DSN, never from other words.
MIN_FREE_SECRET = 4
_SECRETS: set[str] = set()

_URL_PREFIX = re.compile(r"postgres(?:ql)?://", re.IGNORECASE)
# A URL in free text runs to the next blank or quote; key=value passwords, quoted or not.
_URL_IN_TEXT = r"postgres(?:ql)?://[^\s'\"<>]*[^\s'\"<>.,;:)\]]"
_KV_PASSWORD = re.compile(r"(\b(?:ssl)?password\s*=\s*)('(?:[^'\\]|\\.)*'?|\S+)", re.IGNORECASE)
_DSN_IN_TEXT = re.compile(f"({_URL_IN_TEXT})|{_KV_PASSWORD.pattern}", re.IGNORECASE)
_QUERY_PASSWORD = re.compile(r"((?:^|[?&])(?:ssl)?password=)[^&#]*", re.IGNORECASE)
_SECRET_KEYS = ("password", "sslpassword")


def parse_dsn(dsn: str, source: str = "--dsn") -> dict[str, str]:
    """The DSN's parameters, or a ConfigError that names where it came from and nothing of it.

    libpq's own parse errors quote the text (password included), so they are never passed on. A
    URL whose password holds an unescaped ``/`` (``postgresql://bob:pa/ss@host/db``) parses, but
    as host ``bob``, port ``pa`` and a database named after the rest: a non-numeric port or an
    ``@`` in the database name marks it as malformed too."""
    problem = ConfigError(
        f"the DSN given by {source} cannot be parsed (not shown: it may hold a password); "
        "in a URL, percent-encode special characters of the password (/ is %2F, @ is %40)"
    )
    try:
        params = {k: str(v) for k, v in conninfo_to_dict(dsn).items() if v is not None}
    except Exception:
        raise problem from None
    if _URL_PREFIX.match(dsn.lstrip()):
        ports = params.get("port", "").split(",")
        if not all(p.strip().isdigit() or not p.strip() for p in ports):
            raise problem
        if "@" in params.get("dbname", "") or "@" in params.get("host", ""):
            raise problem
    return params


def _secrets_of(dsn: str) -> set[str]:
    """The passwords in a DSN, as given and as libpq decodes them."""
    try:
        params = conninfo_to_dict(dsn)
    except Exception:
        return set()
    found = {str(params[k]) for k in _SECRET_KEYS if params.get(k)}
    if _URL_PREFIX.match(dsn.lstrip()):
        netloc = urlsplit(dsn.strip()).netloc
        if "@" in netloc and ":" in netloc.rpartition("@")[0]:
            found.add(netloc.rpartition("@")[0].partition(":")[2])  # percent-encoded, as typed
        found.update(m.group(0).partition("=")[2] for m in _QUERY_PASSWORD.finditer(dsn))
    return {s for s in found if s and s != "***"}


def remember_secret(dsn: str | None) -> None:
    """Note a DSN's password so that ``scrub`` (and so every log line) can remove it."""
    if dsn:
        _SECRETS.update(_secrets_of(dsn))


def _redact_url(dsn: str) -> str:
    scheme, sep, rest = dsn.partition("://")
    authority, slash, tail = rest.partition("/")
    if "?" in authority and not slash:  # postgresql://host?password=...
        authority, _, query = authority.partition("?")
        tail, slash = "?" + query, ""
    if "@" in authority:
        userinfo, _, hostport = authority.rpartition("@")
        if ":" in userinfo:
            userinfo = userinfo.partition(":")[0] + ":***"
        authority = f"{userinfo}@{hostport}"
    path, q, query = tail.partition("?")
    if q:
        query = _QUERY_PASSWORD.sub(r"\1***", query)
    return f"{scheme}{sep}{authority}{slash}{path}{q}{query}"


def redact(dsn: str) -> str:
    """The DSN with its password replaced by ``***``, for messages and pages; a DSN that cannot
    be parsed gives ``UNPARSEABLE`` instead, whole."""
    try:
        parse_dsn(dsn)
    except ConfigError:
        return UNPARSEABLE
    if _URL_PREFIX.match(dsn.lstrip()):
        shown = _redact_url(dsn.strip())
    else:
        shown = _KV_PASSWORD.sub(r"\1***", dsn)
    # Belt and braces: whatever the forms above missed, a password never reaches the text.
    for secret in _secrets_of(dsn):
        if len(secret) >= MIN_FREE_SECRET and secret in shown:
            return UNPARSEABLE
    return shown


def _whole(secret: str) -> re.Pattern[str]:
    """The secret where it stands alone: not preceded or followed by a word character when it
    starts or ends with one, so password ``bench`` leaves ``worker_bench_1`` alone."""
    head = r"(?<!\w)" if re.match(r"\w", secret[0]) else ""
    tail = r"(?!\w)" if re.match(r"\w", secret[-1]) else ""
    return re.compile(head + re.escape(secret) + tail)


def scrub(text: str) -> str:
    """Free text without passwords: every DSN in it redacted (a malformed one removed whole),
    every ``password=`` value masked, and each remembered password of 4 or more characters
    replaced where it stands as a whole word."""
    text = _DSN_IN_TEXT.sub(lambda m: redact(m[1]) if m[1] else m[2] + "***", text)
    for secret in sorted(_SECRETS, key=len, reverse=True):
        if len(secret) >= MIN_FREE_SECRET:
            text = _whole(secret).sub("***", text)
    return text


def dsn_from_env() -> str | None:
    found = dsn_source_from_env()
    return found[0] if found else None


def dsn_source_from_env() -> tuple[str, str] | None:
    """The DSN from the environment, and the variable it came from (for messages)."""
    for name in DSN_ENV:
        value = os.environ.get(name)
        if value:
            return value, name
    return None
