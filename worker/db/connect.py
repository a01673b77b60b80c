"""The one place connections are made: every thread of a worker, the monitor, the console, the
CLI and the developer tools get theirs here, so each says what it is for in
``pg_stat_activity`` (its ``application_name``), notices a vanished server within seconds (TCP
keepalives), and carries the session settings of its duty.

A ``Duty`` names a connection's job and what follows from it: the application name, how long a
connect may take, whether its statements are prepared, its ``statement_timeout`` and
``lock_timeout``, and whether its plans must stay on the indexes. ``connect``, ``connect_async``,
``pool`` (psycopg-pool, for the connections of transactional handlers and of the console) and
``OwnConnection`` (a thread's own connection, made again after an error) all apply the same
settings. Behind PgBouncer in transaction mode (``session=False``) nothing is prepared and no
session setting is made: it would leak to other clients of the same server connection.

``WORKER_DB_ROLE``, when set, is taken with ``SET ROLE`` on every connection that keeps session
settings, so a login user can act as the least-privilege group role of ``deploy/sql/roles.sql``.

Connections a caller hands us follow one rule (``borrow``): a caller's connection is used as it
is, inside whatever transaction it has open, so our statements commit or roll back with the
caller's writes; a pool lends a connection for the block; a DSN gets a short-lived autocommit
connection of its own.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg_pool import ConnectionPool

from .sql import statements

ROLE_ENV = "WORKER_DB_ROLE"
# A server that vanishes without a reset (a partition, a dead VM) is noticed in about 15 s
# instead of the kernel's two hours; statement timeouts need a live server to fire.
KEEPALIVES: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 15000,
}
# The session statements (session.sql) name no schema: any valid name renders them.
_SESSION = statements("worker", Path(__file__).resolve().parent)

Target = psycopg.Connection | ConnectionPool | str


@dataclass(frozen=True)
class Duty:
    """What a connection is for, and the settings that follow from it."""

    name: str  # its application_name
    connect_timeout: int = 10  # seconds
    prepared: bool = False  # prepare statements run five times (long-lived, repetitive duties)
    statement_timeout_ms: int = 0  # 0: the server's default
    lock_timeout_ms: int = 0  # 0: the server's default
    # A session left inside a transaction this long is ended by the server (0: its default), so
    # a client frozen mid-transaction (SIGSTOP, a paused VM) cannot keep its locks.
    idle_in_transaction_ms: int = 0
    index_plans: bool = False  # keep cached plans on the indexes (session_settings, session.sql)

    def with_timeouts(self, *, statement_ms: int | None = None, lock_ms: int | None = None) -> Duty:
        statement = self.statement_timeout_ms if statement_ms is None else statement_ms
        lock = self.lock_timeout_ms if lock_ms is None else lock_ms
        return replace(self, statement_timeout_ms=statement, lock_timeout_ms=lock)


# A worker process's own threads: claim and acknowledge, renew leases, maintain. Their statements
# repeat and are meant to reach rows through indexes only. The claim's transactions last
# milliseconds and take every lock with SKIP LOCKED; what they may still wait for (a row an
# operator's transaction holds) is bounded, and a claim frozen inside its transaction is ended by
# the server within seconds.
CLAIM = Duty(
    "worker",
    connect_timeout=5,
    prepared=True,
    index_plans=True,
    lock_timeout_ms=2000,
    idle_in_transaction_ms=5000,
)
LEASE = Duty("worker-lease", connect_timeout=5, prepared=True, index_plans=True)
MAINTENANCE = Duty(
    "worker-maintenance",
    connect_timeout=5,
    prepared=True,
    statement_timeout_ms=60_000,
    index_plans=True,
)
LISTEN = Duty("worker-listen", connect_timeout=5)  # LISTEN behind PgBouncer (--listen-dsn)
HANDLERS = Duty("worker-handler", connect_timeout=5, prepared=True)  # transactional handlers
SUPERVISOR = Duty("worker-supervisor", connect_timeout=5)  # hands back a dead child's rows
# Waiting for results: one statement polled over and over; never prepared (PgBouncer).
WAIT = Duty("worker-waiter")
# The monitor: a few statements every few seconds gain nothing from being prepared.
METRICS = Duty("worker-metrics", connect_timeout=3)
READYZ = Duty("worker-readyz", connect_timeout=2)
JOURNAL = Duty("worker-journal", connect_timeout=5)
CONSOLE = Duty("worker-console", connect_timeout=3)
# Commands and producers (the CLI, a DSN handed to enqueue, cancel, locks...): not the fleet,
# whose connections are named "worker" or "worker-..." (doctor and bench count those).
CLI = Duty("worker/cli")
CLIENT = Duty("worker/client")
# The developer tools: the benchmark's bare-SQL ceiling and its helpers, the demo.
BENCH = Duty("worker/bench")
CEILING = Duty("worker-bench-ceiling")  # counted as the fleet's, for its own phase only


def _params(duty: Duty, session: bool, autocommit: bool = True) -> dict[str, Any]:
    return {
        "autocommit": autocommit,
        "connect_timeout": duty.connect_timeout,
        "application_name": duty.name,
        "prepare_threshold": 5 if duty.prepared and session else None,
        **KEEPALIVES,
    }


def configure(conn: psycopg.Connection, duty: Duty, *, session: bool = True) -> None:
    """Apply a duty's session settings (and WORKER_DB_ROLE) to a new connection."""
    if not session:
        return
    role = os.environ.get(ROLE_ENV)
    if role:
        conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(role)))
    if (
        duty.statement_timeout_ms
        or duty.lock_timeout_ms
        or duty.idle_in_transaction_ms
        or duty.index_plans
    ):
        conn.execute(
            _SESSION["session_settings"],
            {
                "statement_ms": str(duty.statement_timeout_ms),
                "lock_ms": str(duty.lock_timeout_ms),
                "idle_ms": str(duty.idle_in_transaction_ms),
                "seqscan": "off" if duty.index_plans else "on",
            },
        )


def connect(
    dsn: str, duty: Duty = CLIENT, *, session: bool = True, autocommit: bool = True
) -> psycopg.Connection:
    """A new connection for ``duty``, autocommit unless asked otherwise."""
    conn = psycopg.connect(dsn, **_params(duty, session, autocommit))
    try:
        configure(conn, duty, session=session)
    except BaseException:
        conn.close()
        raise
    return conn


async def connect_async(
    dsn: str, duty: Duty = CLIENT, *, session: bool = True
) -> psycopg.AsyncConnection:
    """``connect`` for asyncio: the same parameters (session settings are not made here: the
    duties that connect this way need none)."""
    return await psycopg.AsyncConnection.connect(dsn, **_params(duty, session))


def pool(
    dsn: str,
    duty: Duty,
    *,
    max_size: int,
    name: str,
    timeout: float = 5.0,
    reconnect_timeout: float = 300.0,
    session: bool = True,
    setup: Callable[[psycopg.Connection], None] | None = None,
) -> ConnectionPool:
    """A pool of up to ``max_size`` connections for ``duty``, opened empty (connections are made
    on demand) and checked before each loan, so a connection the server closed is replaced
    instead of failing the caller. ``setup`` runs once per new connection; ``timeout`` bounds
    the wait for a loan, ``reconnect_timeout`` how long the pool keeps trying to connect."""

    def prepare(conn: psycopg.Connection) -> None:
        configure(conn, duty, session=session)
        if setup is not None:
            setup(conn)

    made = ConnectionPool(
        dsn,
        min_size=0,
        max_size=max_size,
        kwargs=_params(duty, session),
        configure=prepare,
        open=False,
        name=name,
        timeout=timeout,
        reconnect_timeout=reconnect_timeout,
        check=ConnectionPool.check_connection,
    )
    made.open()
    return made


@contextlib.contextmanager
def borrow(target: Target, duty: Duty = CLIENT) -> Iterator[psycopg.Connection]:
    """The connection to run on: the caller's own, one lent by its pool, or one made for a DSN
    (autocommit, closed after the block)."""
    if isinstance(target, str):
        with connect(target, duty) as conn:
            yield conn
    elif isinstance(target, ConnectionPool):
        with target.connection() as conn:
            yield conn
    else:
        yield target


class OwnConnection:
    """The one connection a thread keeps for itself (the claim loop, the lease keeper,
    maintenance, the status page's reads), made again on first use after ``close()``: each
    thread reconnects on its own, at its own pace, with no pool backoff in the way.
    ``on_connect`` runs on each new connection after its settings (the claim loop LISTENs)."""

    def __init__(
        self,
        dsn: str,
        duty: Duty,
        *,
        session: bool = True,
        on_connect: Callable[[psycopg.Connection], None] | None = None,
    ) -> None:
        self.dsn = dsn
        self.duty = duty
        self.session = session
        self.on_connect = on_connect
        self._conn: psycopg.Connection | None = None

    @property
    def name(self) -> str:
        return self.duty.name

    def get(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = connect(self.dsn, self.duty, session=self.session)
            if self.on_connect is not None:
                self.on_connect(self._conn)
        return self._conn

    @property
    def current(self) -> psycopg.Connection | None:
        """The connection as it is now, without making one."""
        return self._conn

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()


class Backoff:
    """Seconds to wait before the next reconnection: ``first`` after the first failure, twice as
    long after each further one, never more than ``cap``; ``reset`` after a success."""

    def __init__(self, first: float, cap: float) -> None:
        self.first = first
        self.cap = cap
        self.current = 0.0

    def next(self) -> float:
        self.current = min(max(self.current * 2, self.first), self.cap)
        return self.current

    def reset(self) -> None:
        self.current = 0.0


__all__ = [
    "BENCH",
    "CEILING",
    "CLAIM",
    "CLI",
    "CLIENT",
    "CONSOLE",
    "HANDLERS",
    "JOURNAL",
    "KEEPALIVES",
    "LEASE",
    "LISTEN",
    "MAINTENANCE",
    "METRICS",
    "READYZ",
    "SUPERVISOR",
    "WAIT",
    "Backoff",
    "Duty",
    "OwnConnection",
    "Target",
    "borrow",
    "configure",
    "connect",
    "connect_async",
    "pool",
]
