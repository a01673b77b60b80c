"""Where a task row changes state: the Python side of ``queries/tasks.sql``.

Cancelling (an operator's request, and the worker's poll for requests) is in ``_cancel``, by
concept; every other change of a task's state is here.

Every function here runs one statement for a whole batch of tasks; none is called per task on the
hot path. All of them fence on (worker id, attempt): a worker can only move rows it still owns.

Over 500 lines on purpose: the project keeps every Python write to a task's state in this one
module (the claim of limited queues, schema/0014, included), so that one file shows them all.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from ..db.sql import Queries

# Each task keeps the errors of its last ERROR_HISTORY attempts (column `errors`, schema/0008),
# each cut to ERROR_HISTORY_CHARS characters; last_error keeps the latest in full.
ERROR_HISTORY = 10
ERROR_HISTORY_CHARS = 2000
_HISTORY = {"history": ERROR_HISTORY, "history_chars": ERROR_HISTORY_CHARS}
_EARLIEST = datetime(1, 1, 1, tzinfo=UTC)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)
# The cursor of a fresh scan: before any possible (-priority, run_at, id).
_CURSOR_START: tuple[int, datetime, int] = (
    -(10**9),
    datetime(1, 1, 1, tzinfo=UTC),
    0,
)


@dataclass(slots=True)
class Claimed:
    id: int
    task: str
    payload: Any
    attempt: int
    max_attempts: int
    queue: str
    priority: int
    run_at: datetime
    created_at: datetime
    claimed_at: datetime
    xid: str = ""  # the claiming transaction's id (see _journal)
    # The producer's trace context as JSON text, or None (schema/0013; read by worker.contrib.otel)
    trace_context: str | None = None


@dataclass(slots=True)
class Failure:
    id: int
    attempt: int
    delay: float
    error: str
    permanent: bool


class ClaimCursor:
    """Keyset position per queue: where the next claim of this worker starts (its floor).

    Starting each claim near where the previous one stopped keeps claims from walking the dead
    index entries of rows claimed earlier (see the claim statement). The floor trails the last
    claimed row by a look-back, for rows that committed a little late (a producer's transaction,
    a promoted or retried row): ``lookback`` seconds of run_at, but never more than the last
    ``rows`` rows this worker claimed, so that draining a backlog (where thousands of rows share
    a run_at) does not re-read thousands of dead entries per claim. Higher and lower priorities
    are always read from their start. Rows further behind are found off the claim path
    (``behind``), which calls ``reset``. Short claims do not reset the cursor: at light load
    nearly every claim is short, and a reset would walk every dead entry again.
    """

    def __init__(self, lookback: float, rows: int = 1000) -> None:
        self.lookback = timedelta(seconds=lookback)
        self.rows = rows
        self._last: dict[str, tuple[int, datetime, int]] = {}
        self._recent: dict[str, deque[tuple[datetime, int]]] = {}

    def position(self, queue: str) -> tuple[int, datetime, int]:
        """(-priority, run_at, id) of the floor: the claim reads this priority from there."""
        last = self._last.get(queue)
        if last is None:
            return _CURSOR_START
        neg_priority, run_at, _ = last
        floor = (run_at - self.lookback, 0) if run_at > _EARLIEST + self.lookback else (run_at, 0)
        recent = self._recent[queue]
        if len(recent) == recent.maxlen:
            floor = max(floor, recent[0])
        return (neg_priority, *floor)

    def advance(self, queue: str, rows: Sequence[Claimed]) -> None:
        """``rows``: this queue's rows of one claim, in claim order."""
        last = rows[-1]
        prev = self._last.get(queue)
        recent = self._recent.get(queue)
        if recent is None or prev is None or prev[0] != -last.priority:
            recent = self._recent[queue] = deque(maxlen=self.rows)
        recent.extend((r.run_at, r.id) for r in rows if r.priority == last.priority)
        self._last[queue] = (-last.priority, last.run_at, last.id)

    def passed(self, queue: str, earliest: int) -> bool:
        """Whether a row with this run_at (microseconds since the epoch) may lie behind the floor
        of ``queue``, where the next claim would not find it."""
        if queue not in self._last:
            return False
        floor = self.position(queue)[1]
        return earliest <= (floor - _EPOCH) // _MICROSECOND

    def reset(self, queue: str) -> None:
        self._last.pop(queue, None)
        self._recent.pop(queue, None)

    def placed(self) -> list[str]:
        """The queues that have a position (the others are read from their start anyway)."""
        return list(self._last)


@dataclass(slots=True)
class Promoted:
    count: int
    next_due_in: float | None  # seconds until the next scheduled row is due, by the db clock
    queues: list[str] = field(default_factory=list)  # where rows went (up to 50 queues)
    earliest: int | None = None  # the earliest run_at among them, microseconds since the epoch


def promote(conn: psycopg.Connection, q: Queries, *, limit: int, channel: str) -> Promoted:
    """scheduled -> queued for due rows, and when the next one is due."""
    row = conn.execute(q["promote"], {"limit": limit, "channel": channel}).fetchone()
    assert row is not None
    return Promoted(
        int(row[0]), None if row[2] is None else float(row[2]), list(row[3] or ()), row[4]
    )


def parse_notification(payload: str | None) -> tuple[list[str] | None, int | None]:
    """The queues a new-rows notification names (None: every queue) and the earliest run_at of
    its rows in microseconds since the epoch, when it says (schema/0015)."""
    if not payload:
        return None, None
    names = payload.split(",")
    earliest = None
    if names[-1].startswith("\x1e"):
        try:
            earliest = int(names.pop()[1:])
        except ValueError:
            earliest = None
    return names, earliest


def make_due(conn: psycopg.Connection, q: Queries, *, until: datetime) -> int:
    """scheduled -> queued for rows due by ``until`` (worker.testing's clock). Returns how many."""
    return len(conn.execute(q["make_due"], {"until": until}).fetchall())


def claim(
    conn: psycopg.Connection,
    q: Queries,
    *,
    queues: Sequence[str],
    limit: int,
    worker_id: str,
    lease_seconds: float,
    cursor: ClaimCursor | None = None,
    max_attempts: Mapping[str, int] | HandlerLimits | None = None,
) -> list[Claimed]:
    """queued -> in_progress for up to ``limit`` due rows of ``queues`` (first queues first), in
    claim order within each queue; one statement whatever the number of queues.

    ``max_attempts``: the handlers' settings by task name, for rows whose producer left
    max_attempts to the handler (NULL); rows of other tasks keep NULL (they are handed back).
    """
    cursor = cursor or ClaimCursor(0)
    positions = [cursor.position(name) for name in queues]
    handlers = max_attempts if isinstance(max_attempts, HandlerLimits) else None
    if handlers is None:
        handlers = HandlerLimits(max_attempts or {})
    # Every array goes as text (see int_array): psycopg's list adaptation, six lists per claim,
    # was the largest Python cost of a claim at light load, where each claim takes a row or two.
    rows = conn.execute(
        q["claim"],
        {
            "queues": text_array(queues),
            "limit": limit,
            "worker_id": worker_id,
            "lease_seconds": lease_seconds,
            "handler_tasks": handlers.tasks,
            "handler_max_attempts": handlers.max_attempts,
            "cursor_priority": int_array(p[0] for p in positions),
            "floor_run_at": text_array(p[1].isoformat() for p in positions),
            "floor_id": int_array(p[2] for p in positions),
        },
    ).fetchall()
    claimed = [Claimed(*row) for row in rows]
    # UPDATE ... RETURNING does not keep the CTE's order; the cursor and the dispatch need it.
    order = {name: i for i, name in enumerate(queues)}
    claimed.sort(key=lambda c: (order.get(c.queue, 0), -c.priority, c.run_at, c.id))
    return claimed


@dataclass(slots=True)
class LimitedClaim:
    rows: list[Claimed]
    wait: float | None  # a rate limit held work back: seconds until the next start is allowed


def claim_limited(
    conn: psycopg.Connection,
    q: Queries,
    *,
    queue: str,
    limit: int,
    worker_id: str,
    lease_seconds: float,
    max_attempts: Mapping[str, int] | None = None,
) -> LimitedClaim:
    """queued -> in_progress for what ``queue``'s limits allow of up to ``limit`` due rows
    (schema/0014: claims of a limited queue take turns on its limit row, so they cannot together
    exceed a limit), in claim order."""
    limits = max_attempts or {}
    rows = conn.execute(
        q["claim_limited"],
        {
            "queue": queue,
            "limit": limit,
            "worker_id": worker_id,
            "lease_seconds": lease_seconds,
            "handler_tasks": list(limits),
            "handler_max_attempts": list(limits.values()),
        },
    ).fetchall()
    claimed = [Claimed(*row[:11]) for row in rows if row[0] is not None]
    waits = [float(row[11]) for row in rows if row[0] is None and row[11] is not None]
    claimed.sort(key=lambda c: (-c.priority, c.run_at, c.id))
    return LimitedClaim(claimed, min(waits) if waits else None)


def due_queues(conn: psycopg.Connection, q: Queries, queues: Sequence[str]) -> list[str]:
    """Of ``queues``, those holding a row ready to claim (a read; it changes nothing)."""
    return [r[0] for r in conn.execute(q["due_queues"], {"queues": list(queues)}).fetchall()]


def behind(conn: psycopg.Connection, q: Queries, cursor: ClaimCursor) -> list[str]:
    """Queues with a claimable row behind the cursor's look-back window (see ClaimCursor)."""
    names = cursor.placed()
    if not names:
        return []
    positions = [cursor.position(n) for n in names]
    rows = conn.execute(
        q["behind"],
        {
            "queues": names,
            "cursor_priority": [p[0] for p in positions],
            "floor_run_at": [p[1] for p in positions],
            "floor_id": [p[2] for p in positions],
        },
    ).fetchall()
    return [r[0] for r in rows]


def text_array(values: Iterable[str]) -> str:
    """Strings as PostgreSQL's text form of an array ('{"a","b"}'), every element quoted, with
    backslashes and double quotes escaped, so any name (commas, braces, quotes: queue names are
    data) comes back as it was."""
    return (
        "{"
        + ",".join('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values)
        + "}"
    )


class HandlerLimits:
    """A worker's max_attempts by task name, as the claim's two array parameters, written once
    (they change only when the worker's handlers do)."""

    __slots__ = ("max_attempts", "tasks")

    def __init__(self, limits: Mapping[str, int]) -> None:
        self.tasks = text_array(limits)
        self.max_attempts = int_array(limits.values())


# The statements that take a batch of (id, attempt) pairs join it to the table by primary key.
# A generic plan cached while the table was small reads the whole primary key instead, in a
# nested loop with the batch inside (cheaper, for a table of a few pages, than one look-up per
# row); PostgreSQL keeps it until the table is next analysed, and with autovacuum off, never
# replaces it: an acknowledgement of one row then read every row of the table (0.1 ms at 500
# rows, growing). Planned for each execution (PostgreSQL then sees the batch and the table as
# they are), they cost a plan each, once per batch.
PLAN_EACH: dict[str, Any] = {"prepare": False}


def int_array(values: Iterable[int]) -> str:
    """Integers as PostgreSQL's text form of an array ('{1,2,3}'), for the statements that take a
    batch of ids (cast to bigint[] or integer[] there). psycopg adapts a Python list of a hundred
    ints in about 250 µs, this string in about 15: on the acknowledgement path, per batch, that
    was the largest cost of the worker's main thread. int() keeps anything else out."""
    return "{" + ",".join(map(str, map(int, values))) + "}"


def complete(
    conn: psycopg.Connection,
    q: Queries,
    *,
    worker_id: str,
    done: Sequence[tuple[int, int]],
    delete: bool = False,
) -> dict[int, str]:
    """in_progress -> done (or deleted), or cancelled for rows someone asked to cancel. Returns
    {id: "done" | "cancelled"} for the rows that were still ours (a deleted row counts as done)."""
    if not done:
        return {}
    ids, attempts = zip(*done, strict=True)
    params = {"ids": int_array(ids), "attempts": int_array(attempts), "worker_id": worker_id}
    if not delete:
        return dict(conn.execute(q["complete"], params, **PLAN_EACH).fetchall())
    deleted = conn.execute(q["complete_delete"], params, **PLAN_EACH).fetchall()
    kept = {r[0]: "done" for r in deleted}
    if len(kept) < len(ids):
        # Cron rows are kept (their slot must stay taken), and so are rows with a cancel request
        # (they end cancelled): mark those instead.
        rest = [(i, a) for i, a in done if i not in kept]
        kept |= complete(conn, q, worker_id=worker_id, done=rest, delete=False)
    return kept


def fail(
    conn: psycopg.Connection, q: Queries, *, worker_id: str, failures: Sequence[Failure]
) -> dict[int, str]:
    """in_progress -> queued (later) or failed, each error appended to the row's history (the
    last ERROR_HISTORY kept). Returns {id: new state} for rows still ours."""
    if not failures:
        return {}
    rows = conn.execute(
        q["retry"],
        {
            "ids": int_array(f.id for f in failures),
            "attempts": int_array(f.attempt for f in failures),
            "delays": [f.delay for f in failures],
            "errors": [f.error for f in failures],
            "permanent": [f.permanent for f in failures],
            "worker_id": worker_id,
            **_HISTORY,
        },
        **PLAN_EACH,
    ).fetchall()
    return {r[0]: r[1] for r in rows}


def hand_back(
    conn: psycopg.Connection,
    q: Queries,
    *,
    worker_id: str,
    rows: Sequence[tuple[int, int, str]],
) -> dict[int, str]:
    """in_progress -> scheduled, uncounted, for rows of tasks this worker has no handler for:
    (id, attempt, error) each; cancelled for rows with a cancel request. Returns {id: new state}
    for the rows still ours."""
    if not rows:
        return {}
    ids, attempts, errors = zip(*rows, strict=True)
    found = conn.execute(
        q["hand_back"],
        {
            "ids": int_array(ids),
            "attempts": int_array(attempts),
            "errors": list(errors),
            "worker_id": worker_id,
            **_HISTORY,
        },
        **PLAN_EACH,
    ).fetchall()
    return dict(found)


def release(
    conn: psycopg.Connection, q: Queries, *, worker_id: str, tasks: Sequence[tuple[int, int]]
) -> set[int]:
    """in_progress -> queued, attempt not counted: for tasks a stopping worker gives back."""
    if not tasks:
        return set()
    ids, attempts = zip(*tasks, strict=True)
    rows = conn.execute(
        q["release"],
        {"ids": int_array(ids), "attempts": int_array(attempts), "worker_id": worker_id},
        **PLAN_EACH,
    ).fetchall()
    return {r[0] for r in rows}


@dataclass(slots=True)
class Beat:
    """What a heartbeat found: rows lost, and rows someone asked to cancel."""

    lost: set[tuple[int, int]]  # (id, attempt): another owner, another attempt, or not running
    cancel: set[int]  # ids of renewed rows with a cancel request (schema/0010)


def heartbeat(
    conn: psycopg.Connection,
    q: Queries,
    *,
    worker_id: str,
    tasks: Sequence[tuple[int, int]],
    lease_seconds: float,
) -> Beat:
    """Renew the leases of (id, attempt) rows still ours, and the worker's own row; says which
    rows are lost and which of the renewed ones have a cancel request. Waits on no lock."""
    rows = conn.execute(
        q["heartbeat"],
        {
            "ids": int_array(i for i, _ in tasks),
            "attempts": int_array(a for _, a in tasks),
            "worker_id": worker_id,
            "lease_seconds": lease_seconds,
        },
        **PLAN_EACH,
    ).fetchall()
    return Beat({(r[0], r[1]) for r in rows if not r[2]}, {r[0] for r in rows if r[2]})


def worker_died(
    conn: psycopg.Connection, q: Queries, *, worker_id: str, error: str
) -> list[tuple[int, str, str, str]]:
    """A dead worker process's running rows go back now (see queries/tasks.sql, worker_died)."""
    params = {"worker_id": worker_id, "error": error, **_HISTORY}
    rows = conn.execute(q["worker_died"], params).fetchall()
    return [tuple(r) for r in rows]  # type: ignore[misc]


def rescue(
    conn: psycopg.Connection, q: Queries, *, limit: int = 1000, since: datetime | None = None
) -> list[tuple[int, str, str, str]]:
    """Expired in_progress -> queued or failed, of the rows whose lease ran out at ``since`` or
    later (None: all). Returns (id, queue, task, new state) per row."""
    rows = conn.execute(q["rescue"], {"limit": limit, "since": since, **_HISTORY}).fetchall()
    return [tuple(r) for r in rows]  # type: ignore[misc]


def purge(
    conn: psycopg.Connection,
    q: Queries,
    *,
    done_seconds: float,
    failed_seconds: float,
    cron_keep_seconds: float,
    limit: int = 5000,
) -> int:
    """Delete one batch of finished rows past retention; returns how many went."""
    cur = conn.execute(
        q["purge"],
        {
            "done_seconds": done_seconds,
            "failed_seconds": failed_seconds,
            "cron_keep_seconds": cron_keep_seconds,
            "limit": limit,
        },
    )
    return cur.rowcount


# -- operator actions ------------------------------------------------------------------------------


def retry_task(conn: psycopg.Connection, q: Queries, *, task_id: int, channel: str) -> bool:
    """failed or cancelled -> queued, due now, attempts reset; wakes idle workers."""
    ok = bool(conn.execute(q["retry_task"], {"id": task_id}).fetchall())
    if ok:
        conn.execute(q["wake"], {"channel": channel})
    return ok


def retry_failed_batch(
    conn: psycopg.Connection, q: Queries, params: Mapping[str, Any]
) -> tuple[Any, ...]:
    """One batch of `worker retry --failed`: failed -> queued for rows whose dedupe key is free
    (see queries/admin.sql). Returns (seen, requeued, skipped ids, keyset position...); the
    caller (``_admin.retry_failed``) walks the batches and reports."""
    statement = q["retry_failed_all" if params["queue"] is None else "retry_failed_queue"]
    with conn.transaction():
        conn.execute(q["no_jit"])
        row = conn.execute(statement, params).fetchone()
    assert row is not None
    return tuple(row)


def retry_tasks(
    conn: psycopg.Connection, q: Queries, *, ids: list[int], channel: str
) -> tuple[int, int]:
    """failed or cancelled -> queued for each of ``ids`` whose dedupe key is free (see
    queries/console.sql); wakes idle workers. Returns (requeued, skipped)."""
    row = conn.execute(q["retry_tasks"], {"ids": ids}).fetchone()
    assert row is not None
    if row[0]:
        conn.execute(q["wake"], {"channel": channel})
    return int(row[0]), int(row[1])


@dataclass(slots=True)
class BulkStep:
    """Rows read (at most the batch), matched by the filter, changed; ids skipped (retry: dedupe
    key taken); a few matched ids; where the state's next batch starts (None: it is done)."""

    examined: int
    matched: int
    changed: int
    skipped: list[int]
    sample: list[int]
    cursor: Any


def bulk_step(
    conn: psycopg.Connection,
    q: Queries,
    *,
    action: str,
    states: Sequence[str],
    filter: Mapping[str, Any],
    cursor: Any,
    batch: int,
    dry_run: bool,
) -> BulkStep:
    """One batch of a bulk retry (-> queued), cancel (-> cancelled) or delete over the rows of
    one walk (one state, or done and cancelled), in a transaction of its own (schema/0008);
    never a running row. ``dry_run`` only counts."""
    with conn.transaction():
        row = conn.execute(
            q["bulk_step"],
            {
                "action": action,
                "states": list(states),
                "filter": Jsonb(dict(filter)),
                "batch": batch,
                "cursor": None if cursor is None else Jsonb(cursor),
                "dry_run": dry_run,
            },
        ).fetchone()
    assert row is not None
    return BulkStep(row[0], row[1], row[2], list(row[3]), list(row[4]), row[5])
