"""``@worker.exclusive``: a function that runs only when its call wins a lock row, with the lock
extended while it runs (``current_lock().check()`` between steps stops it as soon as the lock is
lost), and the operator's side of lock rows: list them, force one free, purge expired ones.
The lock rows themselves are ``coord.locks``'.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import os
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import psycopg
from psycopg.rows import dict_row

from ..db.connect import Target, borrow
from ..db.dsn import dsn_from_env
from ..db.sql import execute, queries, validate_schema_name
from ..errors import ConfigError
from .locks import ExclusiveLock, LockLost, check_positive, validate_lock_name

log = logging.getLogger("worker.locks")

P = ParamSpec("P")
R = TypeVar("R")


_current: contextvars.ContextVar[ExclusiveLock | None] = contextvars.ContextVar(
    "worker_current_lock", default=None
)


def current_lock() -> ExclusiveLock:
    """The lock held by the enclosing ``@exclusive`` function, for ``current_lock().check()``."""
    lock = _current.get()
    if lock is None:
        raise RuntimeError("current_lock() is only available inside an @exclusive function")
    return lock


def exclusive(
    name: str,
    *,
    target: Target | None = None,
    ttl: float = 300.0,
    schema: str | None = None,
    extend_every: float | None = None,
    jitter: float = 0.0,
    release: bool = False,
    holder: str | None = None,
    on_lost: Callable[[LockLost], None] | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    """Run the decorated function only if this call wins lock ``name``; otherwise return None.

    While it runs, the lock is extended in the background; the function calls
    ``worker.current_lock().check()`` between steps to stop as soon as the lock is lost.
    ``target`` defaults to $WORKER_DSN / $DATABASE_URL, ``schema`` to $WORKER_SCHEMA or
    "worker". Each call is a new holder, so two overlapping calls in one process exclude each
    other too. Stacks under ``@worker.task``/``@worker.cron`` (the handler's signature is kept).
    """
    validate_lock_name(name)
    check_positive(ttl, "ttl")
    if schema is not None:
        validate_schema_name(schema)

    def decorate(fn: Callable[P, R]) -> Callable[P, R | None]:
        if inspect.iscoroutinefunction(fn):
            # The wrapper would return the coroutine and drop the lock before it ever ran.
            raise ConfigError(
                f"@exclusive({name!r}) supports plain functions, not async def "
                f"{fn.__qualname__}; use ExclusiveLock.hold() in a thread instead"
            )

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
            where = target if target is not None else dsn_from_env()
            if where is None:
                raise ConfigError(
                    f"@exclusive({name!r}) has no database: pass target= (a DSN, pool or "
                    "connection) or set WORKER_DSN or DATABASE_URL"
                )
            lock = ExclusiveLock(
                where,
                name,
                ttl=ttl,
                holder=holder,
                schema=schema or os.environ.get("WORKER_SCHEMA") or "worker",
            )
            with lock.hold(
                jitter=jitter, extend_every=extend_every, release=release, on_lost=on_lost
            ):
                if not lock.acquired:
                    log.debug("%s skipped: lock %r is held elsewhere", fn.__qualname__, name)
                    return None
                token = _current.set(lock)
                try:
                    return fn(*args, **kwargs)
                finally:
                    _current.reset(token)

        return wrapper

    return decorate


def purge_expired_locks(
    target: Target, *, older_than: float = 86400.0, schema: str = "worker"
) -> int:
    """Delete lock rows that expired more than ``older_than`` seconds ago; returns how many."""
    q = queries(schema)
    with borrow(target) as conn:
        return len(execute(conn, q["lock_purge_expired"], {"older_than_seconds": older_than}))


# -- inspection ------------------------------------------------------------------------------


def force_release(conn: psycopg.Connection, schema: str, name: str) -> tuple[str, str] | None:
    """Delete lock row ``name`` whoever holds it (an operator's action, e.g. for a mutex whose
    holder died); returns (holder, kind) of the row that was deleted, or None."""
    rows = execute(conn, queries(schema)["lock_force_release"], {"name": name})
    if not rows:
        return None
    _, holder, kind = rows[0]
    return holder, kind


def list_locks(conn: psycopg.Connection, schema: str) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(queries(schema)["lock_list"]).fetchall()


__all__ = ["current_lock", "exclusive", "force_release", "list_locks", "purge_expired_locks"]
