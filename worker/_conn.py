"""Connections a caller hands us: their own, a pool, or a DSN.

One rule everywhere: a caller's connection is used as it is, inside whatever transaction it has
open, so our statements commit or roll back with the caller's writes; a pool lends a connection
for the block; a DSN gets a short-lived autocommit connection of its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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
