"""Flow control: fleet-wide concurrency limits and rate limits, per queue and per key.

A queue's limits are one row of ``queue_limits`` (schema/0014), so they hold for every worker of
the fleet. Code declares them (``worker.limit(...)`` or ``@worker.task(limits=...)``), and a
worker writes its declarations when it starts; an operator changes them at run time (``worker
limits set``, or ``set_queue_limit()`` in SQL), and code then leaves the operator's setting alone.

Every claim honours them (the store's claim, schema/0017 and 0020): concurrency limits are
permits taken by the claim, free again once their task's attempt ends; rate limits pace the
starts, spaced evenly
with up to ``burst`` at once. This module only declares, records and lists limits, and turns a
task's payload into its key.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from ..db.connect import Target, borrow
from ..db.sql import execute, queries

MAX_QUEUE_CHARS = 255
MAX_KEY_CHARS = 255  # as the tasks_limit_key_length constraint (schema/0014)
MAX_BY_CHARS = 200
MAX_LISTED = 10_000
COUNT_CAP = 10_000  # running and waiting counts stop here (see the `limits` query)
MAX_PERIOD = 31_622_400.0  # a year (and a day): as the table's constraint
MAX_CONCURRENCY = 100_000  # tasks running at once, per queue or per key (schema/0019)
MAX_STARTS = 1_000_000_000  # starts per period
MAX_PER_SECOND = 1_000_000  # starts a second: a rate past it could not be paced anyway
MAX_BURST = 100_000
_UNITS = {"s": 1.0, "sec": 1.0, "second": 1.0, "m": 60.0, "min": 60.0, "minute": 60.0,
          "h": 3600.0, "hour": 3600.0, "d": 86400.0, "day": 86400.0}  # fmt: skip
_RATE = re.compile(r"^\s*(\d+)\s*/\s*(\d*(?:\.\d+)?)\s*([a-z]+?)s?\s*$")


class LimitError(ValueError):
    """A limit out of range or malformed. ``field`` names it as the Python API does
    (``key_rate``); ``problem`` says what is wrong, to follow the field's name (the CLI puts its
    flag there: ``--key-rate``)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field
        self.problem = problem


def parse_rate(text: str, field: str = "rate") -> tuple[int, float]:
    """'50/s', '1000/h', '10/5s', '3/2.5min' -> (starts, period in seconds); LimitError when it
    is not such a text or out of range (see ``checked_rate``)."""
    m = _RATE.match(text.lower()) if isinstance(text, str) else None
    if m is None or m[3] not in _UNITS:
        raise LimitError(field, f"must be N/PERIOD, as 50/s, 1000/h or 10/5min, not {text!r}")
    count, scale = int(m[1]), float(m[2]) if m[2] else 1.0
    return checked_rate(count, scale * _UNITS[m[3]], field)


def checked_rate(count: Any, seconds: Any, field: str = "rate") -> tuple[int, float]:
    """A rate in range: 1 to MAX_STARTS starts per period, a period of more than 0 s up to a
    year, and at most MAX_PER_SECOND starts a second."""
    if isinstance(count, bool) or not isinstance(count, int):
        raise LimitError(field, f"must be a whole number of starts per period, not {count!r}")
    if not 1 <= count <= MAX_STARTS:
        hint = " (to start nothing: pause the queue, or give it a concurrency of 0)"
        raise LimitError(
            field,
            f"must be 1 to {MAX_STARTS} starts per period, not {count}{hint if count < 1 else ''}",
        )
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise LimitError(field, f"must have a period in seconds, not {seconds!r}")
    seconds = float(seconds)
    if not math.isfinite(seconds) or not 0 < seconds <= MAX_PERIOD:
        raise LimitError(
            field, f"must have a period of more than 0 s up to a year, not {_secs(seconds)} s"
        )
    if count / seconds > MAX_PER_SECOND:
        raise LimitError(
            field,
            f"must be at most {MAX_PER_SECOND} starts a second, not {count} per {_secs(seconds)} s",
        )
    return count, seconds


def _secs(seconds: float) -> str:
    return f"{seconds:,.0f}" if seconds >= 1000 else f"{seconds:g}"


def _rate(value: str | tuple[int, float] | None, field: str) -> tuple[int, float] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return parse_rate(value, field)
    if not isinstance(value, tuple | list) or len(value) != 2:
        raise LimitError(
            field, f"must be a text such as '50/s' or (starts, seconds), not {value!r}"
        )
    return checked_rate(value[0], value[1], field)


def _whole(field: str, value: Any, low: int, high: int, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise LimitError(
            field, f"must be a whole number from {low} to {high} ({what}), not {value!r}"
        )
    return value


@dataclass(frozen=True)
class Limits:
    """A queue's limits; None means no such limit.

    ``concurrency``: at most this many of the queue's tasks running at once, fleet-wide.
    ``key_concurrency``: at most this many running per key (see ``limit_key`` of a task).
    ``rate`` / ``key_rate``: at most N starts in any window of a period, for the queue / per key:
    ``"50/s"``, ``"1000/h"`` or ``(50, 1.0)``. Starts are spaced evenly (period / N x 1.05
    apart: 5% to spare for the handlers' start jitter); ``burst`` / ``key_burst`` let that many
    start at once after a quiet spell (default 1: a window of one period then holds at most N
    starts; with a burst B, at most N + B - 1).
    """

    concurrency: int | None = None
    key_concurrency: int | None = None
    rate: tuple[int, float] | None = None
    key_rate: tuple[int, float] | None = None
    burst: int | None = None
    key_burst: int | None = None

    @classmethod
    def of(
        cls,
        *,
        concurrency: int | None = None,
        key_concurrency: int | None = None,
        rate: str | tuple[int, float] | None = None,
        key_rate: str | tuple[int, float] | None = None,
        burst: int | None = None,
        key_burst: int | None = None,
    ) -> Limits:
        """Checked limits: LimitError (a ValueError) for a value out of range or malformed, a
        burst without its rate, or no limit at all. The database's set_queue_limit checks the
        same (schema/0019)."""
        running = "tasks running at once"
        concurrency = _whole("concurrency", concurrency, 0, MAX_CONCURRENCY, running)
        key_concurrency = _whole("key_concurrency", key_concurrency, 0, MAX_CONCURRENCY, running)
        checked_rates = {"rate": _rate(rate, "rate"), "key_rate": _rate(key_rate, "key_rate")}
        for name, value in (("burst", burst), ("key_burst", key_burst)):
            _whole(name, value, 1, MAX_BURST, "starts at once")
            of = name.replace("burst", "rate")
            if value is not None and checked_rates[of] is None:
                raise LimitError(name, f"goes with {of}")
        made = cls(
            concurrency, key_concurrency, checked_rates["rate"], checked_rates["key_rate"],
            burst, key_burst,
        )  # fmt: skip
        if made.empty:
            raise ValueError("give at least one limit (concurrency, key_concurrency, rate, ...)")
        return made

    @property
    def empty(self) -> bool:
        return all(v is None for v in (self.concurrency, self.key_concurrency, self.rate,
                                       self.key_rate))  # fmt: skip

    def params(self) -> dict[str, Any]:
        return {
            "concurrency": self.concurrency,
            "key_concurrency": self.key_concurrency,
            "rate": None if self.rate is None else self.rate[0],
            "rate_seconds": None if self.rate is None else self.rate[1],
            "key_rate": None if self.key_rate is None else self.key_rate[0],
            "key_rate_seconds": None if self.key_rate is None else self.key_rate[1],
            "burst": self.burst,
            "key_burst": self.key_burst,
        }


@dataclass(frozen=True)
class QueueLimits:
    """A limited queue as ``limits()`` lists it, with what it holds now."""

    queue: str
    limits: Limits
    source: str  # "code" or "operator"
    updated_by: str
    updated_at: datetime
    running: int  # claimed under the limit and running (leases not expired)
    waiting: int  # queued and due
    recent_starts: int  # starts in the queue's current rate period (0 without a queue rate)
    running_keys: int  # distinct keys among the running


def describe_rate(rate: tuple[int, float] | None) -> str:
    if rate is None:
        return "-"
    count, seconds = rate
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("min", 60.0), ("s", 1.0)):
        if seconds >= size and seconds % size == 0:
            n = int(seconds // size)
            return f"{count}/{unit}" if n == 1 else f"{count}/{n}{unit}"
    return f"{count}/{seconds:g}s"


def _checked(queue: str) -> str:
    if not isinstance(queue, str) or not queue or len(queue) > MAX_QUEUE_CHARS:
        raise ValueError(f"a queue name is 1 to {MAX_QUEUE_CHARS} characters")
    return queue


def set_limits(
    conn: psycopg.Connection, schema: str, queue: str, limits: Limits, *, by: str,
    source: str = "operator",
) -> bool:  # fmt: skip
    """Record ``queue``'s limits (all of them: a None removes that one). With source "code", an
    operator's setting is left alone: False."""
    if limits.empty:
        raise ValueError("give at least one limit (or clear the queue's limits)")
    params = {"queue": _checked(queue), "source": source, "by": by[:MAX_BY_CHARS]}
    rows = execute(conn, queries(schema)["set_limit"], {**params, **limits.params()})
    return bool(rows[0][0])


def clear_limits(conn: psycopg.Connection, schema: str, queue: str) -> bool:
    """Remove ``queue``'s limits; False when it had none."""
    return bool(execute(conn, queries(schema)["clear_limit"], {"queue": _checked(queue)})[0][0])


def list_limits(
    conn: psycopg.Connection, schema: str, *, limit: int = MAX_LISTED, cap: int = COUNT_CAP
) -> list[QueueLimits]:
    """The limited queues by name with what they hold now; counts stop at ``cap``."""
    rows = execute(conn, queries(schema)["limits"], {"limit": limit, "cap": cap})
    found = []
    for r in rows:
        rate = None if r[3] is None else (r[3], r[4])
        key_rate = None if r[5] is None else (r[5], r[6])
        lim = Limits(r[1], r[2], rate, key_rate, r[14], r[15])
        found.append(QueueLimits(r[0], lim, r[7], r[8], r[9], r[10], r[11], r[12], r[13]))
    return found


def declare(
    conn: psycopg.Connection, schema: str, declared: Mapping[str, Limits], *, by: str
) -> None:
    """A worker's start: write the limits its code declares, unless an operator set them."""
    for queue, limits in sorted(declared.items()):
        set_limits(conn, schema, queue, limits, by=by, source="code")


KeyFn = Callable[[Any], Any]


def key_of(spec: str | KeyFn | None, payload: Any) -> str | None:
    """A task's key from its payload: ``spec`` is a payload field name or a function of the
    payload. None: no key. A key is text of at most 255 characters."""
    if spec is None:
        return None
    if callable(spec):
        value = spec(payload)
    elif isinstance(payload, Mapping):
        value = payload.get(spec)
    else:
        value = getattr(payload, spec, None)
    if value is None:
        return None
    key = value if isinstance(value, str) else str(value)
    if len(key) > MAX_KEY_CHARS:
        raise ValueError(f"a limit key is at most {MAX_KEY_CHARS} characters")
    return key


# -- the public API (worker.set_limits, ...): a connection, a pool or a DSN, like enqueue -------


def set_queue_limits(
    target: Target,
    queue: str,
    *,
    concurrency: int | None = None,
    key_concurrency: int | None = None,
    rate: str | tuple[int, float] | None = None,
    key_rate: str | tuple[int, float] | None = None,
    burst: int | None = None,
    key_burst: int | None = None,
    by: str = "python",
    schema: str = "worker",
) -> bool:
    """Set ``queue``'s limits at run time, as an operator: every worker applies them within about
    a second, and code declarations no longer change them (until ``clear_queue_limits``)."""
    limits = Limits.of(
        concurrency=concurrency,
        key_concurrency=key_concurrency,
        rate=rate,
        key_rate=key_rate,
        burst=burst,
        key_burst=key_burst,
    )
    with borrow(target) as conn:
        return set_limits(conn, schema, queue, limits, by=by)


def clear_queue_limits(target: Target, queue: str, *, schema: str = "worker") -> bool:
    with borrow(target) as conn:
        return clear_limits(conn, schema, queue)


def queue_limits(target: Target, *, schema: str = "worker") -> list[QueueLimits]:
    with borrow(target) as conn:
        return list_limits(conn, schema)
