"""Read-only views of the queue and the operator actions, shared by the CLI, the status page and
the metrics collector.

Every view is bounded on a table of any size (see status.sql beside it): counts stop at a cap, and
where one does, the planner's estimate is shown beside it. Single-row actions are in
``the store``, with every other change of a task's state; ``retry_failed`` walks the batches
of ``store.retry_failed_batch`` here, because it reports what it skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import psycopg
from psycopg.rows import dict_row

from ..db.sql import queries
from .workflows import workflow_gauges

# In the order a task goes through them: a workflow's step waits for its dependencies first.
STATES = ("waiting", "scheduled", "queued", "in_progress", "done", "failed", "cancelled")

# A worker is live while it has not stopped and its heartbeat is younger than this (the status
# page, the metrics and `worker status` agree on it).
ALIVE_SECONDS = 60.0
# `worker status`: counts stop here per queue and state (an index-only scan of at most this many
# entries each); queue names past MAX_QUEUES per index are summed.
STATUS_CAP = 10_000
MAX_QUEUES = 1_000
MAX_TASKS = 1_000  # task names read from the handed-back index at most
SAMPLE = 200  # queued rows per queue looked at for tasks no live worker has a handler for
SAMPLED_QUEUES = 100  # queues sampled so at most
ADVICE_LINES = 10  # routing problems named one by one; the rest are counted
MAX_ESTIMATES = 500  # (queue, state) pairs planned for an estimate at most
# The planner estimates at least one row whatever the condition: below this, its statistics hold
# no row of that (queue, state) at all.
SEEN_NONE = 1.5


# -- queue statistics ------------------------------------------------------------------------------


@dataclass
class QueueStats:
    """One row of queue_stats: counts exact up to the cap (``*_capped`` says when one stopped)."""

    queue: str
    queued: int
    scheduled: int
    scheduled_due: int
    running: int
    failed: int
    queued_capped: bool
    scheduled_capped: bool
    failed_capped: bool
    oldest_seconds: float | None
    served: bool

    @property
    def waiting(self) -> int:
        """Tasks that could run now: queued, and scheduled ones already due."""
        return self.queued + self.scheduled_due

    @property
    def capped(self) -> list[str]:
        """The states whose count stopped at the cap."""
        flags = zip(
            ("scheduled", "queued", "failed"),
            (self.scheduled_capped, self.queued_capped, self.failed_capped),
            strict=True,
        )
        return [state for state, capped in flags if capped]


@dataclass
class QueueScan:
    queues: list[QueueStats]
    truncated_after: str | None  # the name where the name scans stopped (None: every queue)


def queue_stats(
    conn: psycopg.Connection,
    schema: str,
    *,
    cap: int,
    failed_cap: int,
    max_queues: int,
    alive_seconds: float = ALIVE_SECONDS,
) -> QueueScan:
    params = {"cap": cap, "failed_cap": failed_cap, "max_queues": max_queues}
    rows = conn.execute(
        queries(schema)["queue_stats"], {**params, "alive_seconds": alive_seconds}
    ).fetchall()
    stats = [QueueStats(*(r[:11])) for r in rows]
    return QueueScan(stats, rows[0][11] if rows else None)


def queue_rest(
    conn: psycopg.Connection, schema: str, *, after: str, listed: list[str], cap: int
) -> tuple[int, int]:
    """(queued, scheduled) of the queues past ``after`` that are not ``listed``, each up to cap."""
    row = conn.execute(
        queries(schema)["queue_rest"], {"after": after, "listed": listed, "cap": cap}
    ).fetchone()
    return (int(row[0]), int(row[1])) if row else (0, 0)


def finished_counts(
    conn: psycopg.Connection, schema: str, *, cap: int
) -> tuple[dict[tuple[str, str], int], bool]:
    """Done and cancelled rows per (queue, state) among the newest ``cap``, and whether that was
    all of them (the counts are exact) or not (each is a lower bound)."""
    rows = conn.execute(queries(schema)["finished_counts"], {"cap": cap}).fetchall()
    counts = {(name, state): int(n) for name, state, n in rows}
    return counts, sum(counts.values()) < cap


def seen_none(count: int, guess: float | None) -> bool:
    """A count short of exact that found no row, and a planner whose statistics hold none either:
    the state has no rows to speak of, and shows 0 rather than the planner's floor of one row
    (`cancelled ≈1` with nothing cancelled). Only done and cancelled can be short of exact at 0:
    they are counted among the newest finished rows, the other states up to their cap."""
    return count == 0 and guess is not None and guess < SEEN_NONE


def finished_estimates(
    counts: dict[tuple[str, str], int], guesses: dict[tuple[str, str], float]
) -> dict[tuple[str, str], int]:
    """Done and cancelled per (queue, state) given when the newest finished rows were not all of
    them: the planner's estimate, or the newest rows' count when that is larger; 0 where neither
    found a row (see seen_none)."""
    return {
        k: 0 if seen_none(counts.get(k, 0), n) else max(round(n), counts.get(k, 0))
        for k, n in guesses.items()
    }


def estimates(
    conn: psycopg.Connection, schema: str, cells: list[tuple[str, str]]
) -> dict[tuple[str, str], float]:
    """The planner's rows for each (queue, state) given (at most MAX_ESTIMATES of them)."""
    cells = cells[:MAX_ESTIMATES]
    if not cells:
        return {}
    rows = conn.execute(
        queries(schema)["queue_state_estimates"],
        {"queues": [c[0] for c in cells], "states": [c[1] for c in cells]},
    ).fetchall()
    return {(name, state): float(n) for name, state, n in rows if n is not None}


# -- routing ---------------------------------------------------------------------------------------


@dataclass
class MissingHandler:
    kind: str  # "handed_back": rows workers without the handler gave back; "queued": a sample
    task: str
    queue: str
    count: int
    capped: bool  # the count stopped at the cap (handed_back) or the queue's sample was full


def missing_handlers(
    conn: psycopg.Connection,
    schema: str,
    stats: list[QueueStats],
    *,
    alive_seconds: float = ALIVE_SECONDS,
    cap: int = STATUS_CAP,
    limit: int = 100,
) -> list[MissingHandler]:
    """Tasks no live worker has a handler for: handed back ones, and those in a sample of the
    queued rows of the SAMPLED_QUEUES queues (of ``stats``) with the most of them."""
    busiest = sorted((s for s in stats if s.queued), key=lambda s: (-s.queued, s.queue))
    picked = [s.queue for s in busiest[:SAMPLED_QUEUES]]
    params = {"cap": cap, "max_tasks": MAX_TASKS, "sample": SAMPLE, "limit": limit}
    rows = conn.execute(
        queries(schema)["missing_handlers"],
        {**params, "alive_seconds": alive_seconds, "queues": picked},
    ).fetchall()
    return [MissingHandler(k, t, q, int(n), bool(c)) for k, t, q, n, c in rows]


def unserved(stats: list[QueueStats]) -> list[QueueStats]:
    """Queues with tasks that could run now and no live worker to run them."""
    return [s for s in stats if s.waiting and not s.served]


@dataclass
class Routing:
    """Work that no live worker will do: queues nobody serves, tasks nobody has a handler for."""

    unserved: list[QueueStats]
    missing: list[MissingHandler]
    workers_alive: int
    sample: int = SAMPLE

    def advice(self, quote: Callable[[str], str]) -> list[str]:
        """One line per problem (the largest first, at most ADVICE_LINES of each kind), saying
        what to do. ``quote`` shows a name (cut and quoted for the medium); the caller escapes
        the line."""
        lines: list[str] = []
        if self.unserved and self.workers_alive == 0:
            total = sum(q.waiting for q in self.unserved)
            more = "+" if any(q.queued_capped or q.scheduled_capped for q in self.unserved) else ""
            lines.append(
                f"no live worker at all: {len(self.unserved):,} queue(s) hold {total:,}{more} due "
                "task(s): start one with `worker run MODULE`"
            )
        unserved = sorted(self.unserved, key=lambda q: (-q.waiting, q.queue))
        for q in unserved[:ADVICE_LINES]:
            more = "+" if q.queued_capped or q.scheduled_capped else ""
            lines.append(
                f"no live worker serves queue {quote(q.queue)} ({q.waiting:,}{more} task(s) "
                f"waiting): start one with --queues {quote(q.queue)} or check the name"
            )
        if len(unserved) > ADVICE_LINES:
            lines.append(f"... and {len(unserved) - ADVICE_LINES:,} more queue(s) nobody serves")
        if self.workers_alive == 0:
            return lines  # every task lacks a live handler; the lines above say why
        for m in self.missing[:ADVICE_LINES]:
            if m.kind == "handed_back":
                what = (
                    f"({m.count:,}{'+' if m.capped else ''} handed back, waiting in queue "
                    f"{quote(m.queue)})"
                )
            else:
                first = f"the first {self.sample:,}" if m.capped else "all"
                what = f"({m.count:,} of {first} queued in queue {quote(m.queue)})"
            lines.append(
                f"task {quote(m.task)} has no handler in any live worker {what}: start a worker "
                "whose module registers it, or check the name"
            )
        if len(self.missing) > ADVICE_LINES:
            lines.append(f"... and {len(self.missing) - ADVICE_LINES:,} more task(s) without one")
        return lines

    def as_dict(self) -> dict[str, Any]:
        return {
            "workers_alive": self.workers_alive,
            "unserved_queues": [
                {
                    "queue": q.queue,
                    "waiting": q.waiting,
                    "capped": q.queued_capped or q.scheduled_capped,
                }
                for q in self.unserved
            ],
            "missing_handlers": [asdict(m) for m in self.missing],
            "advice": self.advice(lambda name: repr(name[:200])),
        }


# -- `worker status` -------------------------------------------------------------------------------


@dataclass
class QueueStatus:
    queue: str
    # Exact, or a lower bound for the states listed in ``capped`` (counts that stopped at the cap;
    # for done and cancelled, rows beyond the newest ``cap`` finished ones were not counted).
    counts: dict[str, int] = field(default_factory=dict)
    capped: list[str] = field(default_factory=list)
    estimates: dict[str, float] = field(default_factory=dict)  # the planner's, for capped states
    delayed: int = 0  # the scheduled count, under its old name for scripts that read it
    oldest_seconds: float | None = None
    served: bool = False
    waiting: int = 0


@dataclass
class Status:
    queues: list[QueueStatus]
    workers: list[dict[str, Any]]
    failed: list[dict[str, Any]]
    routing: Routing
    cap: int = STATUS_CAP
    truncated_after: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "queues": [asdict(q) for q in self.queues],
            "workers": self.workers,
            "failed": self.failed,
            "routing": self.routing.as_dict(),
            "cap": self.cap,
            "truncated_after": self.truncated_after,
        }


def status(
    conn: psycopg.Connection,
    schema: str,
    *,
    failed_limit: int = 10,
    cap: int = STATUS_CAP,
    max_queues: int = MAX_QUEUES,
    alive_seconds: float = ALIVE_SECONDS,
) -> Status:
    q = queries(schema)
    with conn.transaction():
        conn.execute(q["no_jit"])
        limits = {"cap": cap, "failed_cap": cap, "max_queues": max_queues}
        scan = queue_stats(conn, schema, **limits, alive_seconds=alive_seconds)
        finished, exact = finished_counts(conn, schema, cap=cap)
        with conn.cursor(row_factory=dict_row) as cur:
            workers = cur.execute(q["workers"], {"limit": MAX_QUEUES}).fetchall()
            # Names and errors in full, as before: the CLI cuts them itself, saying by how much.
            failed = cur.execute(
                q["recent_failed"], {"limit": failed_limit, "chars": 2**31 - 1}
            ).fetchall()
        missing = missing_handlers(conn, schema, scan.queues, alive_seconds=alive_seconds, cap=cap)
        row = conn.execute(q["metrics_workers_alive"], {"alive_seconds": alive_seconds}).fetchone()
        flows = workflow_gauges(conn, schema, cap=cap)
        queues = _queue_statuses(scan.queues, finished, exact, flows)
        cells = [(e.queue, s) for e in queues for s in e.capped]
        guesses = estimates(conn, schema, cells)
    for e in queues:
        e.capped = [s for s in e.capped if not seen_none(e.counts[s], guesses.get((e.queue, s)))]
        e.estimates = {s: round(guesses[(e.queue, s)]) for s in e.capped if (e.queue, s) in guesses}
    for w in workers:
        w["id"] = str(w["id"])
    routing = Routing(unserved(scan.queues), missing, int(row[0]) if row else 0)
    return Status(queues, workers, failed, routing, cap, scan.truncated_after)


def _queue_statuses(
    stats: list[QueueStats],
    finished: dict[tuple[str, str], int],
    exact: bool,
    flows: dict[str, Any],
) -> list[QueueStatus]:
    by_queue: dict[str, QueueStatus] = {}

    def entry(name: str) -> QueueStatus:
        return by_queue.setdefault(name, QueueStatus(name, dict.fromkeys(STATES, 0)))

    for s in stats:
        e = entry(s.queue)
        e.counts.update(
            scheduled=s.scheduled, queued=s.queued, in_progress=s.running, failed=s.failed
        )
        e.capped = s.capped
        e.delayed, e.waiting = s.scheduled, s.waiting
        e.oldest_seconds, e.served = s.oldest_seconds, s.served
    for (name, state), n in finished.items():
        entry(name).counts[state] = n
    # Workflow steps waiting for their dependencies (a bounded read of the workflow index: the
    # counts are lower bounds when it stopped at its cap).
    for name, n in flows.get("queues", {}).items():
        e = entry(name)
        e.counts["waiting"] = n
        if flows.get("capped"):
            e.capped.append("waiting")
    if not exact:
        for e in by_queue.values():
            e.capped += ["done", "cancelled"]
    return sorted(by_queue.values(), key=lambda s: s.queue)


def get_task(conn: psycopg.Connection, schema: str, task_id: int) -> dict[str, Any] | None:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(queries(schema)["get_task"], {"id": task_id}).fetchone()
