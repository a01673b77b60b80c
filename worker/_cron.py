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

import argparse
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import psycopg
from croniter import CroniterError, croniter
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from ._errors import ConfigError
from ._hooks import emit
from ._registry import DEFAULT_MAX_ATTEMPTS, DEFAULT_QUEUE, Registry, TaskDef, registry
from ._sql import queries

log = logging.getLogger("worker.cron")

CatchUp = Literal["once", "skip"]
CATCH_UP_POLICIES: tuple[str, ...] = ("once", "skip")
DEFAULT_CATCH_UP: CatchUp = "once"
# A slot is "missed" (and the catch-up policy applies) once it is this late by the database
# clock; until then it is merely late and is always enqueued. It must exceed any stall of a
# worker's loop, or a loop that paused would treat its own late slots as missed.
DEFAULT_GRACE_SECONDS = 60.0
# Equal to the worker's default cron_keep_seconds: a slot older than the retention of finished
# cron rows is never inserted, because its row may have been purged already.
DEFAULT_HORIZON_SECONDS = 86400.0
# Bounds the slots one schedule offers in one tick (a per-second schedule after a long stall).
MAX_SLOTS_PER_TICK = 1000
_ERROR_LOG_EVERY = 60.0


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def parse_tz(tz: str) -> ZoneInfo:
    """An IANA zone name, refused in one line if unknown (no silent fallback to local time)."""
    if not isinstance(tz, str) or not tz.strip():
        raise ConfigError(f"invalid time zone {tz!r}: give an IANA name such as 'UTC'")
    try:
        return ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError):
        raise ConfigError(
            f"unknown time zone {tz!r}: give an IANA name such as 'UTC' or 'Europe/Paris'"
        ) from None


def check_expr(expr: str, zone: ZoneInfo) -> None:
    """Validate with croniter itself, and insist the expression fires at all (31 February)."""
    if not isinstance(expr, str):
        raise ConfigError(
            f"a cron expression must be a string such as '*/5 * * * *', got {type(expr).__name__}"
        )
    if not expr.strip():
        raise ConfigError(f"invalid cron expression {expr!r}: it is empty")
    try:
        itr = croniter(expr, datetime.now(zone))
        itr.get_next(datetime)
    except CroniterError as exc:
        # CroniterBadDateError: a valid expression that never matches a date.
        raise ConfigError(f"invalid cron expression {expr!r}: {_one_line(exc)}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"invalid cron expression {expr!r}: {_one_line(exc)}") from None


def _has_seconds(expr: str) -> bool:
    """croniter reads a 6th field as seconds (not the first, as Quartz does)."""
    return not expr.strip().startswith("@") and len(expr.split()) >= 6


@dataclass(frozen=True)
class Schedule:
    """One declared schedule. ``key`` names it in the database (tasks.cron_key)."""

    key: str
    expr: str
    task: str
    queue: str = DEFAULT_QUEUE
    payload: Any = None
    tz: str = "UTC"
    catch_up: CatchUp = DEFAULT_CATCH_UP
    grace_seconds: float = DEFAULT_GRACE_SECONDS
    priority: int = 0
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    zone: ZoneInfo = field(default=ZoneInfo("UTC"), compare=False, repr=False)

    @property
    def has_seconds(self) -> bool:
        return _has_seconds(self.expr)

    def next_after(self, when: datetime) -> datetime:
        """The first slot strictly after ``when``, in UTC."""
        itr = croniter(self.expr, when.astimezone(self.zone))
        return itr.get_next(datetime).astimezone(UTC)

    def prev_before(self, when: datetime) -> datetime:
        """The last slot strictly before ``when``, in UTC."""
        itr = croniter(self.expr, when.astimezone(self.zone))
        return itr.get_prev(datetime).astimezone(UTC)


def make_schedule(
    key: str,
    expr: str,
    *,
    task: str | None = None,
    queue: str | None = None,
    payload: Any = None,
    tz: str = "UTC",
    catch_up: str = DEFAULT_CATCH_UP,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    priority: int = 0,
    max_attempts: int | None = None,
    tasks: Registry | None = None,
) -> Schedule:
    """Validate everything a schedule needs, so a mistake fails at import with one clear line."""
    if not isinstance(key, str) or not key.strip() or len(key) > 255:
        raise ConfigError(f"invalid schedule name {key!r}: use 1-255 characters")
    if any(ch < " " for ch in key):
        raise ConfigError(f"invalid schedule name {key!r}: control characters are not allowed")
    zone = parse_tz(tz)
    check_expr(expr, zone)
    if catch_up not in CATCH_UP_POLICIES:
        raise ConfigError(f"schedule {key!r}: catch_up must be 'once' or 'skip', got {catch_up!r}")
    if not grace_seconds > 0:
        raise ConfigError(f"schedule {key!r}: grace_seconds must be positive")
    try:
        json.dumps({} if payload is None else payload)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"schedule {key!r}: payload is not JSON-serialisable: {exc}") from None
    task_name = task or key
    definition: TaskDef | None = (tasks if tasks is not None else registry).get(task_name)
    if max_attempts is not None and max_attempts < 1:
        raise ConfigError(f"schedule {key!r}: max_attempts must be at least 1")
    return Schedule(
        key=key,
        expr=" ".join(expr.split()),
        task=task_name,
        queue=queue or (definition.queue if definition else DEFAULT_QUEUE),
        payload={} if payload is None else payload,
        tz=tz,
        catch_up=catch_up,  # type: ignore[arg-type]
        grace_seconds=float(grace_seconds),
        priority=int(priority),
        max_attempts=max_attempts
        or (definition.max_attempts if definition else DEFAULT_MAX_ATTEMPTS),
        zone=zone,
    )


class ScheduleSet:
    """The schedules this process declares; the worker's ticker offers their slots."""

    def __init__(self) -> None:
        self._by_key: dict[str, Schedule] = {}

    def add(self, schedule: Schedule) -> Schedule:
        existing = self._by_key.get(schedule.key)
        if existing is not None and existing != schedule:
            raise ConfigError(
                f"schedule {schedule.key!r} is declared twice with different settings"
            )
        self._by_key[schedule.key] = schedule
        return schedule

    def remove(self, key: str) -> None:
        self._by_key.pop(key, None)

    def clear(self) -> None:
        self._by_key.clear()

    def __iter__(self) -> Iterator[Schedule]:
        return iter(sorted(self._by_key.values(), key=lambda s: s.key))

    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, key: str) -> Schedule | None:
        return self._by_key.get(key)


schedules = ScheduleSet()


def schedule(
    name: str,
    expr: str,
    *,
    task: str | None = None,
    queue: str | None = None,
    payload: Any = None,
    tz: str = "UTC",
    catch_up: str = DEFAULT_CATCH_UP,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    priority: int = 0,
    max_attempts: int | None = None,
) -> Schedule:
    """Declare a schedule in plain configuration: enqueue ``task`` (default: ``name``) at every
    slot of ``expr``. The handler may live in this process or in any other worker."""
    return schedules.add(
        make_schedule(
            name,
            expr,
            task=task,
            queue=queue,
            payload=payload,
            tz=tz,
            catch_up=catch_up,
            grace_seconds=grace_seconds,
            priority=priority,
            max_attempts=max_attempts,
        )
    )


_SCHEDULE_FIELDS = frozenset(
    {
        "name",
        "expr",
        "task",
        "queue",
        "payload",
        "tz",
        "catch_up",
        "grace_seconds",
        "priority",
        "max_attempts",
    }
)


def load_schedules(items: Iterable[Mapping[str, Any]]) -> list[Schedule]:
    """Declare schedules from a list of dicts (e.g. read from YAML or TOML); same keys as
    ``schedule()``, with ``name`` and ``expr`` required."""
    out: list[Schedule] = []
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise ConfigError(f"schedule #{i} must be a mapping, got {type(item).__name__}")
        unknown = sorted(set(item) - _SCHEDULE_FIELDS)
        if unknown:
            raise ConfigError(f"schedule #{i}: unknown field(s) {', '.join(unknown)}")
        missing = [k for k in ("name", "expr") if k not in item]
        if missing:
            raise ConfigError(f"schedule #{i}: missing field(s) {', '.join(missing)}")
        fields = dict(item)
        out.append(schedule(fields.pop("name"), fields.pop("expr"), **fields))
    return out


def cron(
    expr: str,
    *,
    name: str | None = None,
    queue: str | None = None,
    payload: Any = None,
    tz: str = "UTC",
    catch_up: str = DEFAULT_CATCH_UP,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    priority: int = 0,
    tasks: Registry | None = None,
    **task_options: Any,
) -> Callable[[Callable[..., Any]], TaskDef]:
    """Decorate a handler to run it on a schedule: registers it as task ``name`` (like
    ``@worker.task``, with ``task_options`` such as max_attempts, timeout, transactional) and
    declares schedule ``name`` for it. Already a TaskDef (``@task`` below)? Its name is used."""
    zone = parse_tz(tz)
    check_expr(expr, zone)  # fail at the decorator line, before the function is even seen
    reg = tasks if tasks is not None else registry

    def decorate(fn: Callable[..., Any]) -> TaskDef:
        if isinstance(fn, TaskDef):
            task_name, task_queue, attempts = fn.name, queue or fn.queue, fn.max_attempts
        else:
            task_name = name or f"{fn.__module__}.{fn.__qualname__}"
            task_queue = queue or DEFAULT_QUEUE
            attempts = task_options.get("max_attempts", DEFAULT_MAX_ATTEMPTS)
        # The whole schedule is validated and declared before the task is registered, so a bad
        # setting leaves neither behind.
        key = name or task_name
        existed = schedules.get(key) is not None
        declared = schedules.add(
            make_schedule(
                key,
                expr,
                task=task_name,
                queue=task_queue,
                payload=payload,
                tz=tz,
                catch_up=catch_up,
                grace_seconds=grace_seconds,
                priority=priority,
                max_attempts=attempts,
                tasks=reg,
            )
        )
        if isinstance(fn, TaskDef):
            return fn
        try:
            return reg.task(task_name, queue=task_queue, **task_options)(fn)
        except Exception:
            if not existed:
                schedules.remove(declared.key)
            raise

    return decorate


# -- the ticker ------------------------------------------------------------------------------------


def _execute(conn: psycopg.Connection, query: Any, params: Mapping[str, Any]) -> list[Any]:
    """One statement in its own transaction: the worker's pool is autocommit, but a caller's
    connection may not be, and a tick must not leave a transaction open."""
    if conn.autocommit:
        return conn.execute(query, params).fetchall()
    with conn.transaction():
        return conn.execute(query, params).fetchall()


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
                log.error("cron tick failed: %s: %s", type(exc).__name__, _one_line(exc))
            return 0

    def _register(self, conn: psycopg.Connection) -> None:
        now = self._clock()
        items = self.schedules
        rows = _execute(
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
        row = _execute(
            conn,
            self.q["cron_enqueue"],
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
        )[0]
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


# -- the `worker cron` command --------------------------------------------------------------------


def _fmt_time(value: datetime | None) -> str:
    if value is None:
        return "-"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") + "Z"


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


def cmd_cron(args: argparse.Namespace) -> int:
    from ._cli import _connect, _print_json, _require, _table, import_tasks

    declared: list[Schedule] = []
    if args.module:
        import_tasks(args.module)
        declared = list(schedules)
    with _connect(args) as conn:
        _require(conn, args.schema)
        rows = cron_rows(conn, args.schema, declared)
    if args.json:
        _print_json({"schedules": rows})
        return 0
    if not rows:
        where = f"module {args.module!r} or " if args.module else ""
        print(f"no cron schedules in {where}schema {args.schema}")
        return 0
    _table(
        ["schedule", "expr", "tz", "task", "queue", "catch-up", "last run", "state", "next run"],
        [
            [
                r["key"],
                r["expr"],
                r["tz"],
                r["task"],
                r["queue"],
                r["catch_up"],
                _fmt_time(r["last_run_slot"] or r["last_slot"]),
                r["last_run_state"] or "-",
                _fmt_time(r["next_slot"]),
            ]
            for r in rows
        ],
    )
    return 0


def add_cli(sub: Any, common: argparse.ArgumentParser) -> None:
    """The ``worker cron`` command (found by the CLI's plugin hook)."""
    p = sub.add_parser(
        "cron",
        parents=[common],
        help="list cron schedules (from MODULE and the database) with last and next runs",
    )
    p.add_argument(
        "module",
        nargs="?",
        help="module (dotted name or .py path) declaring schedules; default: the database's list",
    )
    p.set_defaults(func=cmd_cron)


__all__ = [
    "CATCH_UP_POLICIES",
    "Schedule",
    "ScheduleSet",
    "Ticker",
    "cron",
    "load_schedules",
    "make_ticker",
    "schedule",
    "schedules",
]
