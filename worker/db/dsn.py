"""Where the database is, and how to talk about it without leaking its password.

``redact`` is the one place that turns a DSN into text fit for a message, a log line or a page;
``scrub`` cleans free text (driver errors, log lines, JSON strings) of the passwords that a DSN
or a connection parameter carries in it. Both work on structure, never on the password's value:
a password is masked where it stands as one (a URL's userinfo, a ``password=`` value, the
fragment of a DSN that libpq quotes back in a parse error), and a word elsewhere that happens to
equal it (password ``worker`` for user ``worker`` of database ``worker``) is left alone. A DSN
that cannot be parsed is never shown at all: nobody can tell which part of it is the password.
"""

from __future__ import annotations

import logging
import os
import re
from urllib.parse import unquote

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ..errors import ConfigError

log = logging.getLogger("worker")

DSN_ENV = ("WORKER_DSN", "DATABASE_URL")
UNPARSEABLE = "(a DSN that cannot be parsed, not shown)"
MASK = "***"
_SECRET_KEYS = ("password", "sslpassword")

_URL_PREFIX = re.compile(r"postgres(?:ql)?://", re.IGNORECASE)
# A PostgreSQL URL in free text: its userinfo (which may hold quotes) up to an "@", then the rest
# up to the next blank or quote, without trailing punctuation.
_PG_URL = r"postgres(?:ql)?://(?:[^\s@/]*@)?[^\s'\"<>]*[^\s'\"<>.,;:)\]]"
# Any other URL's userinfo password: scheme://user:PASSWORD@.
_USERINFO = r"\b[a-z][a-z0-9+.-]*://[^\s:/@'\"]*:[^\s@/'\"]*@"
# A value as libpq reads it: quoted ('...' or "..." with backslash escapes, possibly cut short)
# or bare up to the next blank. An already masked value keeps the punctuation after it.
_VALUE = r"""'(?:[^'\\]|\\.)*'?|"(?:[^"\\]|\\.)*"?|\*\*\*(?=[\s:;,.)\]"']|$)|\S+"""
# password=, sslpassword=, and environment-style names ending in it (PGPASSWORD=,
# POSTGRES_PASSWORD=); password_hash= or "password authentication failed" are not keys.
_KV = rf"(?P<key>\b\w*password[ \t]*=[ \t]*)(?P<value>{_VALUE})"
# "password": "..." and 'password': '...' (JSON, Python reprs of connection parameters).
_QUOTED_KEY = (
    r"(?P<qkey>(?P<q>[\"'])\w*password(?P=q)[ \t]*[:=][ \t]*)"
    r"(?P<qvalue>\"(?:[^\"\\]|\\.)*\"?|'(?:[^'\\]|\\.)*'?)"
)
_IN_TEXT = re.compile(
    rf"(?P<url>{_PG_URL})|(?P<userinfo>{_USERINFO})|{_QUOTED_KEY}|{_KV}", re.IGNORECASE
)
_KV_PASSWORD = re.compile(_KV, re.IGNORECASE)
# libpq's parse errors quote a fragment of the DSN they could not read, which may be any part
# of it, the password included: the fragment is masked whole.
_ECHO = re.compile(
    r"""(?P<lead>(?:missing\ "="\ after
                  |percent-encoded\ (?:token|value):
                  |unexpected\ spaces\ found\ in
                  |in\ URI(?:\ \(expected\ ":"\ or\ "/"\))?:
                  |internal\ parser\ routine:
                  |URI\ query\ parameter:
                 )\ ")[^"]*(?=")""",
    re.VERBOSE,
)


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


def _redact_url(dsn: str) -> str:
    scheme, sep, rest = dsn.partition("://")
    # libpq reads the userinfo up to the first "@" before any "/" (a "?" or "#" may be in it).
    head = re.match(r"[^@/]*@", rest)
    userinfo = head[0][:-1] if head else None
    rest = rest[len(head[0]) :] if head else rest
    if userinfo is not None and userinfo.partition(":")[2]:
        userinfo = userinfo.partition(":")[0] + ":" + MASK
    hostpart, q, query = rest.partition("?")
    if q:
        query = "&".join(_redact_query_item(item) for item in query.split("&"))
    at = "" if userinfo is None else f"{userinfo}@"
    return f"{scheme}{sep}{at}{hostpart}{q}{query}"


def _redact_query_item(item: str) -> str:
    key, eq, value = item.partition("=")
    if eq and value and unquote(key) in _SECRET_KEYS:  # libpq decodes keys too: pass%77ord
        return f"{key}={MASK}"
    return item


def _masked(params: dict[str, str]) -> dict[str, str]:
    return {k: (MASK if k in _SECRET_KEYS and v else v) for k, v in params.items()}


def _faithful(shown: str, params: dict[str, str]) -> bool:
    """Whether ``shown`` reads, to libpq, as the DSN it was made from with every password
    masked: no password left, nothing else changed."""
    try:
        seen = {k: str(v) for k, v in conninfo_to_dict(shown).items() if v is not None}
    except Exception:
        return False
    return seen == _masked(params)


def redact(dsn: str) -> str:
    """The DSN with its passwords (``password``, ``sslpassword``, a URL's userinfo) replaced by
    ``***``, for messages and pages; a DSN that cannot be parsed gives ``UNPARSEABLE`` instead,
    whole. Everything else is shown as given, including a user or database name that happens to
    equal the password. The result is checked by parsing it: should the form typed defeat the
    masking (a percent-encoded ``password`` key, say), the DSN is shown rebuilt as key=value
    parameters from what libpq read."""
    try:
        params = parse_dsn(dsn)
    except ConfigError:
        return UNPARSEABLE
    if _URL_PREFIX.match(dsn.lstrip()):
        shown = _redact_url(dsn.strip())
    else:
        shown = _KV_PASSWORD.sub(rf"\g<key>{MASK}", dsn)
    if _faithful(shown, params):
        return shown
    return make_conninfo("", **_masked(params))


def _scrub_match(m: re.Match[str]) -> str:
    if m["url"]:
        return redact(m["url"])
    if m["userinfo"]:
        return m["userinfo"].rpartition(":")[0] + f":{MASK}@"
    if m["qkey"]:
        quote = m["qvalue"][:1]
        return f"{m['qkey']}{quote}{MASK}{quote}"
    return m["key"] + MASK


def scrub(text: str) -> str:
    """Free text without the passwords that DSNs and connection parameters carry in it: every
    PostgreSQL URL redacted (a malformed one removed whole), another URL's userinfo password,
    every ``password=`` value (``sslpassword=``, ``PGPASSWORD=`` too) and ``"password": "..."``
    masked, and the DSN fragments libpq quotes in its parse errors masked. Nothing else: a word
    that equals a password but stands outside these places is kept."""
    text = _ECHO.sub(rf"\g<lead>{MASK}", text)
    return _IN_TEXT.sub(_scrub_match, text)


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
