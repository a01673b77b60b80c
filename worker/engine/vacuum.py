"""Vacuum the task table when autovacuum cannot keep up.

A queue table churns: every task is inserted and updated twice, so at a few thousand tasks a
second it gains tens of thousands of dead row versions a second. Autovacuum visits a table at
most once per ``autovacuum_naptime`` (a minute by default) whatever the table's thresholds, so
between its visits the table and its indexes grow by hundreds of thousands of dead entries that
every scan then walks. This service, run by the maintenance thread of every worker (one at a time
across the fleet, by an advisory lock), vacuums the table itself when it holds many dead rows and
nobody vacuumed it recently. A vacuum that frees little (a long transaction elsewhere holds the
xmin horizon back) makes it wait longer before the next try; a vacuum that did not run because
another (autovacuum's) had the table is no such sign, and the next check simply comes as usual.
The permits of concurrency limits, which every limited claim updates, are vacuumed the same way
(a small table: a vacuum of it takes milliseconds).
"""

from __future__ import annotations

import logging
import time
import zlib
from dataclasses import dataclass

import psycopg

from ..db.sql import Queries

log = logging.getLogger("worker")

# The SQLSTATE of VACUUM (SKIP_LOCKED)'s warning that it skipped a table another vacuum holds.
LOCK_NOT_AVAILABLE = "55P03"

# Advisory lock class for "vacuuming this schema's task table" (see db.migrate for the scheme).
VACUUM_LOCK_CLASS = 0x776B7202 - 2**31


@dataclass
class VacuumConfig:
    check_seconds: float = 10.0  # how often to look at the table's statistics
    min_dead: int = 100_000  # dead row versions worth a vacuum of our own
    min_dead_permits: int = 5_000  # the same for the permits of concurrency limits
    min_gap_seconds: float = 10.0  # since the last vacuum, by anyone
    timeout_ms: int = 300_000  # a vacuum may take this long (maintenance statements: 10 s)
    max_backoff_seconds: float = 600.0


class Vacuumer:
    def __init__(self, q: Queries, schema: str, config: VacuumConfig | None = None) -> None:
        self.q = q
        self.config = config or VacuumConfig()
        self._table = f'"{schema}".tasks'
        self._permits = f'"{schema}".limit_permits'
        self._key = zlib.crc32(schema.encode()) - 2**31
        self._wait_until = 0.0
        self._backoff = 0.0
        self._disabled = False
        self._stuck_at: str | None = None  # the horizon (vacuum_horizon) of a fruitless vacuum

    @property
    def interval(self) -> float:
        return self.config.check_seconds

    def tick(self, conn: psycopg.Connection, restore_timeout_ms: int) -> int:
        """Vacuum if it is worth it; returns the dead rows it removed (by the statistics)."""
        cfg = self.config
        now = time.monotonic()
        if self._disabled:
            return 0
        self._vacuum_permits(conn)
        if now < self._wait_until:
            return 0
        row = conn.execute(self.q["vacuum_state"], {"table": self._table}).fetchone()
        if row is None:
            return 0
        dead, since, allowed, running = int(row[0] or 0), row[1], bool(row[2]), bool(row[3])
        if dead < cfg.min_dead or (since is not None and since < cfg.min_gap_seconds) or running:
            return 0
        if not allowed:
            self._disabled = True
            log.info(
                "the task table has %d dead rows but this role does not own it, so only "
                "autovacuum can remove them; see the README on tuning autovacuum",
                dead,
            )
            return 0
        horizon = conn.execute(self.q["vacuum_horizon"]).fetchone()
        oldest = horizon[0] if horizon else None
        if oldest is not None and oldest == self._stuck_at:
            # The transaction that kept the last vacuum from removing rows is still there: a
            # vacuum now would read the whole table and indexes again, for nothing.
            return 0
        lock = {"class": VACUUM_LOCK_CLASS, "key": self._key}
        got = conn.execute(self.q["vacuum_try_lock"], lock).fetchone()
        if not got or not got[0]:
            return 0
        skipped: list[str] = []

        def on_notice(diag: psycopg.errors.Diagnostic) -> None:
            if diag.sqlstate == LOCK_NOT_AVAILABLE:  # "skipping vacuum of ...": it was busy
                skipped.append(diag.message_primary or "")

        conn.add_notice_handler(on_notice)
        try:
            conn.execute(self.q["session_statement_timeout"], {"ms": str(cfg.timeout_ms)})
            started = time.monotonic()
            conn.execute(self.q["vacuum_tasks"], prepare=False)
            took = time.monotonic() - started
        finally:
            conn.remove_notice_handler(on_notice)
            conn.execute(self.q["session_statement_timeout"], {"ms": str(restore_timeout_ms)})
            conn.execute(self.q["vacuum_unlock"], lock)
        if skipped:
            # Another vacuum (autovacuum's) had the table: it removes what ours would have.
            log.debug("the task table's vacuum was left to the one running: %s", skipped[0])
            return 0
        after = conn.execute(self.q["vacuum_state"], {"table": self._table}).fetchone()
        left = int(after[0] or 0) if after else 0
        removed = max(dead - left, 0)
        if left > dead // 2:
            # Little came off: something holds the horizon back. Try again later, not soon, and
            # not at all while the same transaction holds it.
            self._stuck_at = oldest
            self._backoff = min(max(self._backoff * 2, 30.0), cfg.max_backoff_seconds)
            log.warning(
                "vacuumed the task table in %.1fs but %d of %d dead rows remain: a long "
                "transaction, prepared transaction or replication slot may hold the xmin "
                "horizon back (see pg_stat_activity, or run `worker doctor`); next try once "
                "that has ended, and not before %.0fs",
                took,
                left,
                dead,
                self._backoff,
            )
        else:
            self._backoff = 0.0
            self._stuck_at = None
            log.info("vacuumed the task table: %d dead rows removed in %.1fs", removed, took)
        self._wait_until = time.monotonic() + self._backoff
        return removed

    def _vacuum_permits(self, conn: psycopg.Connection) -> None:
        row = conn.execute(self.q["vacuum_state"], {"table": self._permits}).fetchone()
        if row is None:
            return
        dead, since, allowed, running = int(row[0] or 0), row[1], bool(row[2]), bool(row[3])
        fresh = since is not None and since < self.config.min_gap_seconds
        if dead < self.config.min_dead_permits or fresh or running or not allowed:
            return
        lock = {"class": VACUUM_LOCK_CLASS, "key": self._key}
        got = conn.execute(self.q["vacuum_try_lock"], lock).fetchone()
        if not got or not got[0]:
            return
        try:
            conn.execute(self.q["vacuum_permits"], prepare=False)
        finally:
            conn.execute(self.q["vacuum_unlock"], lock)


__all__ = ["VACUUM_LOCK_CLASS", "VacuumConfig", "Vacuumer"]
