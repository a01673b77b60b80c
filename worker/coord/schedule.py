"""Cron schedules as values: parsing, validation, the process's set of declared schedules, and the
``@worker.cron`` / ``worker.schedule`` declarations. ``coord.cron`` turns them into enqueued
runs."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterError, croniter

from ..errors import ConfigError
from ..tasks.registry import DEFAULT_MAX_ATTEMPTS, DEFAULT_QUEUE, Registry, TaskDef, registry

CatchUp = Literal["once", "skip"]
CATCH_UP_POLICIES: tuple[str, ...] = ("once", "skip")
DEFAULT_CATCH_UP: CatchUp = "once"
# A slot is "missed" (and the catch-up policy applies) once it is this late by the database
# clock; until then it is merely late and is always enqueued. It must exceed any stall of a
# worker's loop, or a loop that paused would treat its own late slots as missed.
DEFAULT_GRACE_SECONDS = 60.0


def one_line(exc: BaseException) -> str:
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
        raise ConfigError(f"invalid cron expression {expr!r}: {one_line(exc)}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"invalid cron expression {expr!r}: {one_line(exc)}") from None


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


__all__ = [
    "CATCH_UP_POLICIES",
    "Schedule",
    "ScheduleSet",
    "cron",
    "load_schedules",
    "schedule",
    "schedules",
]
