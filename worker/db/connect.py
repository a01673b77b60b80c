"""Connections a caller hands us: their own, a pool, or a DSN.

One rule everywhere: a caller's connection is used as it is, inside whatever transaction it has
open, so our statements commit or roll back with the caller's writes; a pool lends a connection
for the block; a DSN gets a short-lived autocommit connection of its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

Target = psycopg.Connection | ConnectionPool | str


@contextlib.contextmanager
def borrow(target: Target) -> Iterator[psycopg.Connection]:
    if isinstance(target, str):
        with psycopg.connect(target, autocommit=True, connect_timeout=10) as conn:
            yield conn
    elif isinstance(target, ConnectionPool):
        with target.connection() as conn:
            yield conn
    else:
        yield target


class OwnConnection:
    """The one connection a worker thread keeps for itself (the claim loop, the lease keeper,
    maintenance), made again on first use after ``close()``: each thread reconnects on its own,
    at its own pace, with no pool backoff in the way. ``timeout_ms`` bounds every statement on
    it, and ``plans_query`` keeps its cached plans on the indexes (see session_index_plans in
    tasks.sql). Neither is set behind PgBouncer in transaction mode (``prepare=False``), where a
    session setting would leak to other clients; nothing is prepared there either, so every
    statement is planned for the table as it is."""

    def __init__(
        self,
        dsn: str,
        *,
        name: str,
        prepare: bool = True,
        timeout_ms: int | None = None,
        timeout_query: Any = None,
        plans_query: Any = None,
        on_connect: Callable[[psycopg.Connection], None] | None = None,
    ) -> None:
        self.dsn = dsn
        self.on_connect = on_connect
        self.name = name
        self.prepare = prepare
        self.timeout_ms = timeout_ms
        self.timeout_query = timeout_query
        self.plans_query = plans_query
        self._conn: psycopg.Connection | None = None

    def get(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(
                self.dsn,
                autocommit=True,
                connect_timeout=5,
                prepare_threshold=5 if self.prepare else None,
                application_name=self.name,
            )
            if self.prepare and self.timeout_ms and self.timeout_query is not None:
                self._conn.execute(self.timeout_query, {"ms": str(self.timeout_ms)})
            if self.prepare and self.plans_query is not None:
                self._conn.execute(self.plans_query)
            if self.on_connect is not None:
                self.on_connect(self._conn)
        return self._conn

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()
