"""Who may change things from the console: the operator's token, sign-in sessions, CSRF tokens
and the same-origin check.

Actions are off unless the operator configured a token (``WORKER_CONSOLE_TOKEN`` or
``worker run --console-token-file``). With one, a person signs in by typing it; the server then
keeps a session in memory (a random id in an HttpOnly, SameSite=Strict cookie) that carries the
name they gave and a CSRF token of its own, which every form of the session repeats. A POST is
accepted only from a signed-in session, with that session's CSRF token, and from a page of this
very server (its Origin header names the Host it was sent to).

Sign-ins are throttled per client address (``throttle``): after five failures in a minute the
address is locked, and even the right token is refused from it until the lock ends.

The token itself is only ever compared (``hmac.compare_digest``): it is never stored in a session,
written to a page, a log line or a cookie.
"""

from __future__ import annotations

import hmac
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.cookies import CookieError, SimpleCookie
from urllib.parse import urlsplit

from .throttle import SignInThrottle

COOKIE = "worker_console"
COOKIE_PATH = "/console"
SESSION_SECONDS = 8 * 3600  # a session ends this long after sign-in, used or not
MAX_SESSIONS = 1000  # the oldest session goes when a new one would exceed this
MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 4096
NAME_CHARS = 64
DEFAULT_NAME = "console"
_NAME = re.compile(r"[^\x00-\x1f\x7f-\x9f]{1,64}")  # printable, no control characters


class TokenError(ValueError):
    """A console token the server cannot use; the message never contains the token."""


def checked_token(token: str, source: str) -> str:
    """The token as configured, without the surrounding whitespace a file usually ends with;
    refused (``TokenError``, naming only ``source``) when it is too short to resist guessing."""
    token = token.strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise TokenError(
            f"the console token from {source} is too short: use at least {MIN_TOKEN_CHARS} "
            "characters (for instance the output of `openssl rand -hex 24`)"
        )
    if len(token) > MAX_TOKEN_CHARS or any(c in token for c in "\r\n\x00"):
        raise TokenError(
            f"the console token from {source} must be one line of at most {MAX_TOKEN_CHARS} "
            "characters"
        )
    return token


def operator_name(text: str) -> str:
    """The name a person gives at sign-in, as the audit records it: trimmed, at most 64
    printable characters; ``console`` when left empty or unusable."""
    text = (text or "").strip()[:NAME_CHARS]
    return text if _NAME.fullmatch(text) else DEFAULT_NAME


@dataclass
class SignIn:
    """What a sign-in came to: a session, or none (a wrong token), or a lock on the address
    (``retry_after`` seconds, the token not even compared)."""

    session: Session | None = None
    retry_after: float = 0.0
    checked: bool = False  # the token was compared (and, without a session, was wrong)


@dataclass
class Session:
    id: str
    name: str
    csrf: str
    started: float
    flash: list[str] = field(default_factory=list)  # messages for the next page shown

    def expired(self, now: float) -> bool:
        return now - self.started > SESSION_SECONDS


class ConsoleAuth:
    """The console's token and its signed-in sessions (in memory: a restart signs everyone out)."""

    def __init__(self, token: str | None, throttle: SignInThrottle | None = None) -> None:
        self._token = token.encode() if token else None
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._lock = threading.Lock()
        self.throttle = throttle or SignInThrottle()

    @property
    def enabled(self) -> bool:
        """Whether actions are possible at all (a token was configured)."""
        return self._token is not None

    def sign_in(self, token: str, name: str, address: str) -> SignIn:
        """A new session when ``token`` is the configured one and ``address`` is not locked."""
        if self._token is None:
            return SignIn()
        wait = self.throttle.locked(address)
        if wait > 0:
            return SignIn(retry_after=wait)
        given = token.strip().encode("utf-8", "replace")
        if not hmac.compare_digest(given, self._token):
            return SignIn(retry_after=self.throttle.failed(address), checked=True)
        self.throttle.succeeded(address)
        session = Session(
            secrets.token_urlsafe(32), operator_name(name), secrets.token_urlsafe(32), time.time()
        )
        with self._lock:
            self._sessions[session.id] = session
            while len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        return SignIn(session, checked=True)

    def session(self, headers: Mapping[str, str] | None) -> Session | None:
        """The live session named by the request's cookie, if any."""
        if self._token is None or headers is None:
            return None
        sid = cookie_value(headers.get("Cookie", ""))
        if not sid:
            return None
        with self._lock:
            found = self._sessions.get(sid)
            if found is not None and found.expired(time.time()):
                del self._sessions[sid]
                return None
            return found

    def sign_out(self, session: Session) -> None:
        with self._lock:
            self._sessions.pop(session.id, None)


def csrf_ok(session: Session, given: str) -> bool:
    return bool(given) and hmac.compare_digest(given.encode(), session.csrf.encode())


def cookie_value(header: str) -> str | None:
    try:
        jar = SimpleCookie(header)
    except CookieError:
        return None
    morsel = jar.get(COOKIE)
    return morsel.value if morsel is not None else None


def set_cookie(session: Session) -> str:
    return (
        f"{COOKIE}={session.id}; Path={COOKIE_PATH}; Max-Age={SESSION_SECONDS}; HttpOnly; "
        "SameSite=Strict"
    )


def clear_cookie() -> str:
    return f"{COOKIE}=; Path={COOKIE_PATH}; Max-Age=0; HttpOnly; SameSite=Strict"


def same_origin(headers: Mapping[str, str]) -> bool:
    """The request comes from a page of this server: its Origin (or, without one, its Referer)
    names the host and port the request was sent to (Host). Browsers send Origin with every POST;
    a request with neither is refused."""
    host = (headers.get("Host") or "").strip().lower()
    source = headers.get("Origin") or headers.get("Referer") or ""
    if not host or not source or source == "null":
        return False
    try:
        parts = urlsplit(source.strip())
        netloc = parts.netloc.lower()
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and netloc == host


__all__ = [
    "COOKIE",
    "ConsoleAuth",
    "Session",
    "SignIn",
    "TokenError",
    "checked_token",
    "clear_cookie",
    "csrf_ok",
    "operator_name",
    "same_origin",
    "set_cookie",
]
