"""Locks for jobs that must not run twice at once: lock rows with an expiry, and advisory locks.

Two tools, because they fail differently:

* A lock row (``ExclusiveLock``, ``Mutex``, ``TimeoutLock``) lives in ``{schema}.locks``. It is
  taken by one atomic upsert, expires by the database clock, survives connection poolers and
  needs no connection held open while the job runs. A holder that dies keeps the lock until the
  expiry, so a long job extends it while working, and must stop when an extension fails.
* An advisory lock (``advisory_lock``) lives in the server's memory and, by default, in one
  transaction: it is released by COMMIT, ROLLBACK or the death of the client, the moment it
  happens. The job's writes can share that transaction, so they commit with the release or not
  at all. The price is a connection held in a transaction for the whole job.

Both work outside a worker: give them a psycopg connection, a pool or a DSN.
See docs/cron-and-locks.md for the trade-offs and the warnings.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from typing import Any, ParamSpec, TypeVar

import psycopg
from psycopg_pool import ConnectionPool

from ..db.connect import CLIENT, Target, borrow, connect
from ..db.sql import execute, queries, validate_schema_name
from ..errors import ConfigError, WorkerError
from ..hooks import emit

log = logging.getLogger("worker.locks")

P = ParamSpec("P")
R = TypeVar("R")

DEFAULT_NAMESPACE = "worker"
MAX_NAME_LENGTH = 255


class LockLost(WorkerError):
    """The lock was taken over (or could not be renewed before it expired): stop the work now."""


def validate_lock_name(name: str, what: str = "lock name") -> str:
    """1-255 printable characters: the name is a primary key and shows up in `worker locks`."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"invalid {what} {name!r}: it must be a non-empty string")
    if len(name) > MAX_NAME_LENGTH:
        raise ConfigError(
            f"invalid {what} {name[:40]!r}...: longer than {MAX_NAME_LENGTH} characters"
        )
    if any(ch < " " or ch == "\x7f" for ch in name):
        raise ConfigError(f"invalid {what} {name!r}: control characters are not allowed")
    return name


def check_positive(value: float | None, what: str) -> float | None:
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} must be a number of seconds, got {value!r}") from None
    if not number > 0:
        raise ConfigError(f"{what} must be positive, got {value!r}")
    return number


def default_holder() -> str:
    """A fresh holder id: readable in `worker locks` (host and pid), unique per lock object."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


def check_target(target: Any) -> Target:
    """Refuse at construction what would fail obscurely at the first statement."""
    if not isinstance(target, str | psycopg.Connection | ConnectionPool):
        raise ConfigError(
            "a lock needs a psycopg Connection, a psycopg_pool ConnectionPool or a DSN string, "
            f"got {type(target).__name__}"
        )
    return target


class ExclusiveLock:
    """Permission for one holder at a time to run a job, as a row with an expiry.

    ``acquire()`` wins only if the lock is free, expired, or (when ``reentrant``) already held by
    this holder. ``extend()`` renews it for the holder and raises ``LockLost`` when someone else
    has it. ``hold()`` does both: it acquires, extends in a background thread and sets ``lost``
    (an Event) when an extension fails, so the job can call ``check()`` between steps.

    ``target`` is a psycopg connection (autocommit, ideally), a pool, or a DSN (a connection of
    the lock's own is opened on first use and closed by ``close()`` or at the end of ``hold()``).
    ``ttl`` is in seconds; ``None`` means the lock never expires (see ``Mutex``). Each object has
    its own holder id unless one is given: two objects never share a lock by accident.
    """

    kind = "exclusive"

    def __init__(
        self,
        target: Target,
        name: str,
        *,
        ttl: float | None = 300.0,
        holder: str | None = None,
        schema: str = "worker",
        reentrant: bool = True,
    ) -> None:
        self.name = validate_lock_name(name)
        self.ttl = check_positive(ttl, "ttl")
        self.holder = (
            validate_lock_name(holder, "holder") if holder is not None else default_holder()
        )
        self.schema = validate_schema_name(schema)
        self.reentrant = reentrant
        self.q = queries(schema)
        self.lost = threading.Event()
        self.lost_reason: LockLost | None = None
        self.acquired = False
        self.expires_at: datetime | None = None
        self._target = check_target(target)
        self._own_conn: psycopg.Connection | None = None
        self._conn_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} holder={self.holder!r} ttl={self.ttl}>"

    # -- connections --

    @contextlib.contextmanager
    def _connection(self) -> Iterator[psycopg.Connection]:
        target = self._target
        if isinstance(target, str):
            with self._conn_lock:
                if self._own_conn is None or self._own_conn.closed:
                    self._own_conn = connect(target, CLIENT)
                conn = self._own_conn
            yield conn
        else:
            with borrow(target) as conn:
                yield conn

    def close(self) -> None:
        """Close the connection this lock opened for a DSN target (nothing else is closed)."""
        with self._conn_lock:
            if self._own_conn is not None:
                self._own_conn.close()
                self._own_conn = None

    def _run(self, query_name: str, params: Mapping[str, Any]) -> list[Any]:
        with self._connection() as conn:
            return execute(conn, self.q[query_name], params)

    # -- operations --

    def acquire(self, *, jitter: float = 0.0) -> bool:
        """Compete for the lock; True if this holder has it now.

        ``jitter`` sleeps a random 0..jitter seconds first, which spreads wins across instances
        that are triggered at the same moment (otherwise the fastest, or the one whose clock runs
        ahead, would win every time).
        """
        if jitter and jitter > 0:
            time.sleep(random.uniform(0, jitter))
        rows = self._run(
            "lock_acquire",
            {
                "name": self.name,
                "holder": self.holder,
                "kind": self.kind,
                "ttl": self.ttl,
                "reentrant": self.reentrant,
            },
        )
        won = bool(rows)
        self.acquired = won
        self.expires_at = rows[0][0] if rows else None
        if won:
            self.lost.clear()
            self.lost_reason = None
        emit("lock", kind=self.kind, name=self.name, won=won)
        return won

    def extend(self, ttl: float | None = None) -> datetime:
        """Push the expiry to now + ttl (default: the lock's ttl) by the database clock.

        Raises ``LockLost`` when the row is no longer this holder's: another instance took over
        after the lock expired, or an operator removed it. The job must stop at once.
        """
        seconds = check_positive(ttl, "ttl") if ttl is not None else self.ttl
        rows = self._run("lock_extend", {"name": self.name, "holder": self.holder, "ttl": seconds})
        if not rows:
            exc = LockLost(
                f"lock {self.name!r} is no longer held by {self.holder}: it expired and was taken "
                "over, or was released; stop the work"
            )
            self._mark_lost(exc)
            raise exc
        self.expires_at = rows[0][0]
        return rows[0][0]

    def release(self) -> bool:
        """Delete the lock row if this holder still has it; True if it did.

        Releasing an exclusive job's lock early is unsafe when other instances may still compete
        for the same trigger: one arriving a moment late would win and run the job again. Letting
        the lock expire is the safe default (see docs/cron-and-locks.md).
        """
        rows = self._run("lock_release", {"name": self.name, "holder": self.holder})
        self.acquired = False
        return bool(rows)

    def check(self) -> None:
        """Raise ``LockLost`` if the lock was lost; call it between units of work."""
        if self.lost.is_set():
            raise self.lost_reason or LockLost(f"lock {self.name!r} was lost")

    def _mark_lost(self, exc: LockLost) -> None:
        if not self.lost.is_set():
            self.lost_reason = exc
            self.lost.set()
            self.acquired = False
            log.warning("%s", exc)

    # -- holding while working --

    @contextlib.contextmanager
    def hold(
        self,
        *,
        jitter: float = 0.0,
        extend_every: float | None = None,
        release: bool = False,
        on_lost: Callable[[LockLost], None] | None = None,
    ) -> Iterator[ExclusiveLock]:
        """Acquire, keep extending in a background thread while the block runs, then stop.

        Yields this lock; ``lock.acquired`` says whether the block may do the work. The extender
        renews every ``extend_every`` seconds (default ttl/3). When a renewal finds the lock
        taken, or cannot reach the database before the lock would expire, it sets ``lock.lost``
        and calls ``on_lost``; the job sees it through ``check()``. The lock is left to expire
        on exit unless ``release=True``.
        """
        every = check_positive(extend_every, "extend_every")
        try:
            if not self.acquire(jitter=jitter):
                yield self
                return
            stop = threading.Event()
            extender: threading.Thread | None = None
            if self.ttl is not None:
                extender = threading.Thread(
                    target=self._extend_loop,
                    args=(every or self.ttl / 3, stop, on_lost),
                    name=f"lock-extend-{self.name}"[:60],
                    daemon=True,
                )
                extender.start()
            try:
                yield self
            finally:
                stop.set()
                if extender is not None:
                    extender.join()
                if self.lost.is_set():
                    log.warning(
                        "lock %r was lost while its job ran; the job may have overlapped with "
                        "another holder's",
                        self.name,
                    )
                elif release:
                    self.release()
        finally:
            self.close()

    def _extend_loop(
        self, every: float, stop: threading.Event, on_lost: Callable[[LockLost], None] | None
    ) -> None:
        """Renew until told to stop. Fail fast: a lost lock, or a lock that may have expired
        because the database could not be reached, marks it lost and ends the loop."""
        assert self.ttl is not None
        # The lock cannot expire before this moment: the database computed the expiry after we
        # sent the statement, so measuring from the send is conservative.
        safe_until = time.monotonic() + self.ttl
        wait = every
        while not stop.wait(wait):
            sent = time.monotonic()
            try:
                self.extend()
                safe_until = sent + self.ttl
                wait = every
            except LockLost as exc:
                if on_lost is not None:
                    with contextlib.suppress(Exception):
                        on_lost(exc)
                return
            except psycopg.Error as exc:
                if time.monotonic() >= safe_until - min(every, 1.0):
                    lost = LockLost(
                        f"could not renew lock {self.name!r} before it could expire "
                        f"({type(exc).__name__}); stop the work"
                    )
                    self._mark_lost(lost)
                    if on_lost is not None:
                        with contextlib.suppress(Exception):
                            on_lost(lost)
                    return
                log.warning("could not renew lock %r (%s); retrying", self.name, type(exc).__name__)
                wait = min(every, 1.0)


class Mutex(ExclusiveLock):
    """A lock row that never expires: held until released (acquire/release).

    Suits "do not start the next run while the previous one has not finished or has failed":
    a holder that dies keeps it, on purpose, until someone looks (``worker locks --release``).
    """

    kind = "mutex"

    def __init__(
        self, target: Target, name: str, *, holder: str | None = None, schema: str = "worker"
    ) -> None:
        super().__init__(target, name, ttl=None, holder=holder, schema=schema, reentrant=True)


class TimeoutLock(ExclusiveLock):
    """Acquire-only: the lock is free again ``ttl`` seconds after it was taken, whoever asks.

    Not re-entrant, so it limits a job to once per ``ttl`` across the fleet ("at most one
    reminder per hour"); nothing needs to release it.
    """

    kind = "timeout"

    def __init__(
        self,
        target: Target,
        name: str,
        ttl: float,
        *,
        holder: str | None = None,
        schema: str = "worker",
    ) -> None:
        if ttl is None:
            raise ConfigError("a TimeoutLock needs a ttl in seconds")
        super().__init__(target, name, ttl=ttl, holder=holder, schema=schema, reentrant=False)


__all__ = [
    "DEFAULT_NAMESPACE",
    "ExclusiveLock",
    "LockLost",
    "Mutex",
    "TimeoutLock",
    "check_target",
    "default_holder",
    "validate_lock_name",
]
