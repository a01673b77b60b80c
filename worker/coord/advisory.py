"""Advisory locks: held in the server's memory, released by COMMIT, ROLLBACK or the client's death.

The job's writes can share the lock's transaction, so they commit with the release or not at
all; the price is a connection held in a transaction for the whole job. Lock rows with an expiry
are in ``coord.locks``; docs/cron-and-locks.md compares the two.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import dict_row

from ..db.connect import Target, borrow
from ..db.sql import queries
from ..hooks import emit
from .locks import DEFAULT_NAMESPACE, check_target, validate_lock_name

# The advisory statements name no table, but the query loader renders every statement for a
# schema; any valid name will do.
_ANY_SCHEMA = "worker"


def _int4(text: str) -> int:
    """A stable signed int4 from text: blake2b's 64-bit digest folded (high xor low) into 32 bits.

    Python's hash() is salted per process, so it cannot name a lock shared between processes.
    """
    digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
    folded = (digest >> 32) ^ (digest & 0xFFFFFFFF)
    return folded - 0x100000000 if folded >= 0x80000000 else folded


def advisory_keys(name: str, namespace: str = DEFAULT_NAMESPACE) -> tuple[int, int]:
    """The (application key, job key) pair for ``pg_try_advisory_xact_lock(int4, int4)``.

    The first key keeps this application's locks apart from other users of advisory locks in the
    same database; the second names the job. Two names of one namespace collide with probability
    2^-32 per pair.
    """
    validate_lock_name(namespace, "advisory namespace")
    validate_lock_name(name)
    return _int4(namespace), _int4(name)


@dataclass
class AdvisoryLock:
    """What ``advisory_lock`` yields: whether it won, the keys, and the connection to write with
    (in transaction mode, its open transaction holds the lock)."""

    name: str
    keys: tuple[int, int]
    conn: psycopg.Connection
    acquired: bool
    session: bool


@contextlib.contextmanager
def advisory_lock(
    target: Target,
    name: str,
    *,
    namespace: str = DEFAULT_NAMESPACE,
    session: bool = False,
) -> Iterator[AdvisoryLock]:
    """Try an advisory lock without waiting; yields an ``AdvisoryLock`` (check ``.acquired``).

    Default, transaction-scoped: the block runs inside a transaction on ``lock.conn`` that took
    ``pg_try_advisory_xact_lock``. Write through ``lock.conn`` and the writes commit together
    with the release when the block ends, or roll back with it when the block raises or the
    process dies. Given a connection already inside a transaction (a transactional handler's
    ``ctx.conn``), the lock joins that transaction and is held until it ends.

    ``session=True`` takes a session lock instead, released at the end of the block: the
    connection stays checked out meanwhile. Not behind PgBouncer in transaction mode, where the
    next transaction may run on another server connection (see docs/cron-and-locks.md).
    """
    keys = advisory_keys(name, namespace)
    check_target(target)
    params = {"key1": keys[0], "key2": keys[1]}
    q = queries(_ANY_SCHEMA)
    with borrow(target) as conn:
        if session:
            row = conn.execute(q["advisory_try_session"], params).fetchone()
            won = bool(row and row[0])
            emit("lock", kind="advisory", name=name, won=won)
            try:
                yield AdvisoryLock(name, keys, conn, won, True)
            finally:
                if won and not conn.closed:
                    with contextlib.suppress(psycopg.Error):
                        conn.execute(q["advisory_unlock_session"], params)
            return
        with conn.transaction():
            row = conn.execute(q["advisory_try_xact"], params).fetchone()
            won = bool(row and row[0])
            emit("lock", kind="advisory", name=name, won=won)
            yield AdvisoryLock(name, keys, conn, won, False)


def list_advisory_locks(
    conn: psycopg.Connection, *, namespace: str = DEFAULT_NAMESPACE
) -> list[dict[str, Any]]:
    """Advisory locks of this database from pg_locks, with the holder's session; locks of
    ``namespace`` are marked (their first key is the namespace's)."""
    ns_key = _int4(namespace)
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(queries(_ANY_SCHEMA)["advisory_list"]).fetchall()
    for r in rows:
        r["namespace"] = namespace if r["two_keys"] and r["key1"] == ns_key else None
    return rows


__all__ = ["AdvisoryLock", "advisory_keys", "advisory_lock", "list_advisory_locks"]
