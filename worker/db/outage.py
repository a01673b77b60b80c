"""One process's account of a database outage, for its log: one line when a duty loses the
database, one a minute while it stays away (with how long), and one when it is back. Every duty
of the process (the claim, the lease keeper, maintenance, the listener, the supervisor) reports
to the same account, so that an outage costs a few lines however many duties retry how often.

Only failures that mean the database cannot be reached count (see ``unreachable``); a statement
the database refuses is the caller's to log, as it would be at any other time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import psycopg

from .dsn import scrub

log = logging.getLogger("worker.database")

REMIND_SECONDS = 60.0

# Server states that mean it is going away or not taking connections (shutdowns, start-up).
_GONE = frozenset({"57P01", "57P02", "57P03"})


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` means a connection failed or was lost, rather than a statement refused:
    an error of libpq itself (no SQLSTATE), a connection exception (class 08), or a server that
    is shutting down or starting up."""
    if not isinstance(exc, psycopg.Error):
        return False
    state = exc.sqlstate
    if state is None:
        return isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError)
    return state.startswith("08") or state in _GONE


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return scrub(text.splitlines()[0]) if text else type(exc).__name__


class Outage:
    """Whether this process has the database, by what its duties last saw."""

    def __init__(
        self, remind: float = REMIND_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.remind = remind
        self._clock = clock
        self._lock = threading.Lock()
        self.since: float | None = None  # when the first duty lost it; None: connected
        self._said = 0.0
        self._lost: set[str] = set()  # the duties that lost it in this outage

    def lost(self, duty: str, exc: BaseException) -> None:
        """``duty`` could not reach the database (``exc``)."""
        with self._lock:
            now = self._clock()
            self._lost.add(duty)
            if self.since is None:
                self.since = self._said = now
                log.warning(
                    "database unreachable (%s: %s); retrying, with a line a minute until it is "
                    "back",
                    duty,
                    _first_line(exc),
                )
            elif now - self._said >= self.remind:
                self._said = now
                log.warning(
                    "database still unreachable after %.0f s (%s: %s)",
                    now - self.since,
                    duty,
                    _first_line(exc),
                )

    def back(self, duty: str) -> None:
        """``duty`` reached the database. The outage ends when a duty that lost the database has
        it again: one that kept an old connection working for a moment (while the server shuts
        down, say) proves nothing. Cheap when nothing was lost: one attribute read."""
        if self.since is None:
            return
        with self._lock:
            if self.since is None or duty not in self._lost:
                return
            log.warning("database back after %.1f s", self._clock() - self.since)
            self.since = None
            self._lost.clear()

    @property
    def down(self) -> bool:
        return self.since is not None


# The process's account: every duty reports here.
OUTAGE = Outage()
