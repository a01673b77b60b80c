"""Cron schedules without a leader: every worker process offers due slots, the database keeps one.

Each process that declares a schedule computes its slots with croniter and, on each tick, offers
the due ones to the database in one ``INSERT ... ON CONFLICT (cron_key, cron_at) DO NOTHING``. The
unique index on (cron_key, cron_at) lets exactly one insert per slot win, so any number of
processes can run the same schedules: no election, no lock, no error for the losers. The enqueued
run is an ordinary task, so it gets retries, leases, metrics and load balancing like any other.

The database clock decides when a slot is due, so a process whose clock runs fast cannot enqueue
early, and one whose clock runs slow only offers late (another process, or its next tick, gets
there first). See docs/cron-and-locks.md for the catch-up policy and the retention window.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from croniter import CroniterError, croniter
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from .. import store
from ..db.sql import execute, queries
from ..errors import ConfigError
from ..hooks import emit
from .schedule import Schedule, one_line, parse_tz, schedules

log = logging.getLogger("worker.cron")

# Equal to the worker's default cron_keep_seconds: a slot older than the retention of finished
# cron rows is never inserted, because its row may have been purged already.
DEFAULT_HORIZON_SECONDS = 86400.0
# Bounds the slots one schedule offers in one tick (a per-second schedule after a long stall).
MAX_SLOTS_PER_TICK = 1000
_ERROR_LOG_EVERY = 60.0

# -- the ticker ------------------------------------------------------------------------------------


@dataclass
class _State:
    schedule: Schedule
    cursor: datetime | None = None  # the latest slot this process knows is settled
    next_due: datetime | None = None  # the first slot after the cursor (cached)


class Ticker:
    """Offers the due slots of a set of schedules; the worker loop calls ``tick`` every
    ``interval`` seconds on its main thread.

    Per-tick cost: when no slot is due, a few comparisons and no query; otherwise one statement
    for all due slots of all schedules.

    Time is the database's: every statement returns its clock, and the ticker keeps the offset
    from its own, so processes with skewed clocks agree on which slots are due, late or missed.
    """

    def __init__(
        self,
        schema: str,
        items: Iterable[Schedule],
        *,
        horizon_seconds: float = DEFAULT_HORIZON_SECONDS,
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        self.q = queries(schema)
        self.schema = schema
        self._states = [_State(s) for s in items]
        self.horizon_seconds = horizon_seconds
        self._clock = clock or (lambda: datetime.now(UTC))
        self._registered = False
        # The database clock minus ours, as of the last statement (plus the latency to the
        # server, so our estimate of its clock runs a hair ahead: such slots are offered again).
        self._offset = timedelta(0)
        self._last_error_log = 0.0
        seconds = any(st.schedule.has_seconds for st in self._states)
        # Second-level schedules need ticks well inside a second; the worker loop may still wake
        # less often when idle (its poll interval), which makes slots late, never missed.
        self.interval: float = 0.25 if seconds else 1.0

    @property
    def schedules(self) -> list[Schedule]:
        return [st.schedule for st in self._states]

    def tick(self, conn: psycopg.Connection) -> int:
        """Offer every due slot; return how many inserts this process won."""
        try:
            if not self._registered:
                self._register(conn)
            return self._offer(conn)
        except psycopg.OperationalError:
            raise  # the worker loop backs off and retries
        except psycopg.Error as exc:
            # Anything else must not stop the worker's loop; say so, at most once a minute.
            now = time.monotonic()
            if now - self._last_error_log >= _ERROR_LOG_EVERY:
                self._last_error_log = now
                log.error("cron tick failed: %s: %s", type(exc).__name__, one_line(exc))
            return 0

    def _register(self, conn: psycopg.Connection) -> None:
        now = self._clock()
        items = self.schedules
        rows = execute(
            conn,
            self.q["cron_register"],
            {
                "keys": [s.key for s in items],
                "exprs": [s.expr for s in items],
                "tzs": [s.tz for s in items],
                "tasks": [s.task for s in items],
                "queues": [s.queue for s in items],
                "catch_ups": [s.catch_up for s in items],
                "next_slots": [s.next_after(now) for s in items],
            },
        )
        last = {key: last_slot for key, last_slot, _ in rows}
        db_now = rows[0][2] if rows else now
        self._offset = db_now - now
        for st in self._states:
            # Where the fleet stopped; a schedule seen for the first time starts now (its past
            # slots were never due for anyone).
            st.cursor = last.get(st.schedule.key) or db_now
            st.next_due = st.schedule.next_after(st.cursor)
        self._registered = True

    def _offer(self, conn: psycopg.Connection) -> int:
        local = self._clock()
        now = local + self._offset
        offers: list[tuple[_State, datetime, datetime]] = []  # (state, slot, next slot)
        for st in self._states:
            if st.next_due is None or st.next_due > now:
                continue
            offers.extend((st, slot, nxt) for slot, nxt in self._due_slots(st, now))
        if not offers:
            return 0
        s = [o[0].schedule for o in offers]
        row = store.cron_slots(
            conn,
            self.schema,
            {
                "keys": [x.key for x in s],
                "slots": [o[1] for o in offers],
                "next_slots": [o[2] for o in offers],
                "tasks": [x.task for x in s],
                "queues": [x.queue for x in s],
                "payloads": [Jsonb(x.payload) for x in s],
                "priorities": [x.priority for x in s],
                "max_attempts": [x.max_attempts for x in s],
                "horizon_seconds": self.horizon_seconds,
            },
        )
        db_now, won = row[0], row[1] or {}
        self._offset = db_now - local
        # Slots the database found due are settled whether we won them or not; slots it found in
        # the future (the offset estimate was off) are offered again next tick.
        for st, slot, nxt in offers:
            if slot <= db_now and (st.cursor is None or slot > st.cursor):
                st.cursor = slot
                st.next_due = nxt
        total = 0
        for key, n in won.items():
            total += int(n)
            log.debug("cron: enqueued %d run(s) of %s", n, key)
            emit("cron_enqueued", schedule=key, count=int(n))
        return total

    def _due_slots(self, st: _State, now: datetime) -> list[tuple[datetime, datetime]]:
        """The slots to offer now, each with the slot after it.

        Slots later than the cursor but within the grace period are late, not missed: all are
        offered. When slots were missed beyond the grace period (every process was down, or the
        database was unreachable), only the latest of them is offered (catch_up="once"), or none
        (catch_up="skip"), and never one older than the horizon.
        """
        sch = st.schedule
        assert st.cursor is not None and st.next_due is not None
        boundary = now - timedelta(seconds=sch.grace_seconds)
        out: list[tuple[datetime, datetime]] = []
        start = st.cursor
        if st.next_due < boundary:
            missed = sch.prev_before(boundary)  # > cursor, since next_due <= it
            if sch.catch_up == "once" and missed > now - timedelta(seconds=self.horizon_seconds):
                out.append((missed, sch.next_after(missed)))
            else:
                # Settled without a run: skipped by policy, or too old to enqueue safely.
                log.info(
                    "cron: %s skips missed slot(s) up to %s (catch_up=%r)",
                    sch.key,
                    missed.isoformat(),
                    sch.catch_up,
                )
                st.cursor = missed
                st.next_due = sch.next_after(missed)
            # The first on-time slot is the first one at or after the boundary.
            start = boundary - timedelta(microseconds=1)
        itr = croniter(sch.expr, start.astimezone(sch.zone))
        slot = itr.get_next(datetime).astimezone(UTC)
        while slot <= now and len(out) < MAX_SLOTS_PER_TICK:
            nxt = itr.get_next(datetime).astimezone(UTC)
            out.append((slot, nxt))
            slot = nxt
        return out


def make_ticker(schema: str, *, horizon_seconds: float = DEFAULT_HORIZON_SECONDS) -> Ticker | None:
    """The worker's hook: a ticker for this process's declared schedules, or None if it has none.

    ``horizon_seconds`` must not exceed the worker's ``cron_keep_seconds`` (both default to a
    day): a slot older than the retention of finished cron rows is never offered.
    """
    items = list(schedules)
    if not items:
        return None
    return Ticker(schema, items, horizon_seconds=horizon_seconds)


# -- inspection ------------------------------------------------------------------------------


def cron_rows(
    conn: psycopg.Connection, schema: str, declared: list[Schedule]
) -> list[dict[str, Any]]:
    """Schedules from the database merged with those declared in this process, each with its
    last run and next slot (computed here from the expression and zone)."""
    q = queries(schema)
    with conn.cursor(row_factory=dict_row) as cur:
        db = {r["key"]: r for r in cur.execute(q["cron_list"]).fetchall()}
        extra = [s.key for s in declared if s.key not in db]
        runs = (
            {r["key"]: r for r in cur.execute(q["cron_last_runs"], {"keys": extra}).fetchall()}
            if extra
            else {}
        )
    now = datetime.now(UTC)
    out: list[dict[str, Any]] = []
    declared_by_key = {s.key: s for s in declared}
    for key in sorted({*db, *declared_by_key}):
        d = declared_by_key.get(key)
        r = db.get(key) or {}
        run = runs.get(key) or r
        expr = d.expr if d else r["expr"]
        tz = d.tz if d else r["tz"]
        next_slot: datetime | None
        try:
            zone = d.zone if d else parse_tz(tz)
            next_slot = croniter(expr, now.astimezone(zone)).get_next(datetime).astimezone(UTC)
        except (ConfigError, CroniterError, ValueError):
            next_slot = None
        out.append(
            {
                "key": key,
                "expr": expr,
                "tz": tz,
                "task": d.task if d else r["task"],
                "queue": d.queue if d else r["queue"],
                "catch_up": d.catch_up if d else r["catch_up"],
                "source": "module+db" if d and key in db else ("module" if d else "db"),
                "last_slot": r.get("last_slot"),
                "last_run_slot": run.get("last_run_slot"),
                "last_run_state": run.get("last_run_state"),
                "last_run_id": run.get("last_run_id"),
                "next_slot": next_slot,
                "updated_at": r.get("updated_at"),
            }
        )
    return out


__all__ = ["Ticker", "cron_rows", "make_ticker"]
