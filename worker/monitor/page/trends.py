"""What the charts show, as the database counted it: tasks finished per minute (``Throughput``,
counted from the finished rows retention keeps), and the minute rollup the workers write
(``Trends``, schema/0018): queue depth and how long finished tasks waited to start. The console's
data layer reads them; the pages draw them (``charts``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

MINUTES = 60  # the window every chart shows, in minutes
WAIT_QUEUES = 6  # queues whose wait times are charted at most, the busiest first


@dataclass
class Minute:
    """Tasks finished in the minute starting at ``at``: done, and failed for good."""

    at: datetime
    done: int
    failed: int


@dataclass
class Throughput:
    minutes: list[Minute] = field(default_factory=list)  # oldest first; missing: not counted yet
    start: datetime | None = None  # the window's first minute
    pending: int = 0  # minutes of the window not counted yet (counted on the next refreshes)
    cap: int = 100_000  # each minute and outcome is counted up to this many rows
    error: str | None = None


@dataclass
class Depth:
    """The fleet's tasks due and waiting, and running, at ``at`` (a little after a minute)."""

    at: datetime
    queued: int
    queued_capped: bool  # the count stopped at its cap: there were at least that many
    in_progress: int


@dataclass
class Wait:
    """Of a queue's tasks that finished in the minute starting at ``minute`` (``tasks`` measured),
    the median and 99th percentile of the seconds from due to start of their last attempt."""

    minute: datetime
    tasks: int
    p50: float
    p99: float


@dataclass
class Trends:
    start: datetime | None = None  # the window's first minute (the database's clock)
    end: datetime | None = None  # the end of the window: the end of the current minute
    depth: list[Depth] = field(default_factory=list)  # oldest first
    waits: dict[str, list[Wait]] = field(default_factory=dict)  # by queue, busiest first
    error: str | None = None


__all__ = ["MINUTES", "WAIT_QUEUES", "Depth", "Minute", "Throughput", "Trends", "Wait"]
