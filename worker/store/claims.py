"""The claim path: due scheduled rows become queued (``promote``), and queued rows become a
worker's (``claim``, ``claim_limited``), with the probes that tell a worker which queues hold work
(``due_queues``, ``behind``) and the cursor that keeps claims off dead index entries.

Every statement is in ``claims.sql`` beside this module, in the order a claim runs them.
"""

from __future__ import annotations

import math
import time
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from ..db.arrays import int_array, text_array
from .statements import statements

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
    xid: str = ""  # the claiming transaction's id (see monitor.metrics.journal)
    # The producer's trace context as JSON text, or None (schema/0013; read by worker.contrib.otel)
    trace_context: str | None = None
    # A rate limit's pace: seconds from when the claim was read until the handler may start, by
    # the database clock (None: now); the claim turns it into ``not_before``.
    start_in: float | None = None
    slack: float | None = None  # how late after its start it may still start (see not_before)
    limited: bool = False  # claimed under a queue's limits (it holds a permit, if any)
    not_before: float = 0.0  # the monotonic time its handler may start (0: now)
    # The monotonic time after which it must not start any more: a start later than this could
    # crowd a window with the next starts of the pace (inf: no pace).
    not_after: float = math.inf
    # Workflows (schema/0022): others wait for this step (its acknowledgement settles them), the
    # results of the steps it waited for (JSON text of a list, or None), and its workflow's id.
    dependents: bool = False
    inputs: str | None = None
    workflow_id: int | None = None


class ClaimCursor:
    """Keyset position per queue: where the next claim of this worker starts (its floor).

    Starting each claim near where the previous one stopped keeps claims from walking the dead
    index entries of rows claimed earlier (see the claim statement). The floor trails the last
    claimed row by a look-back, for rows that committed a little late (a producer's transaction,
    a promoted or retried row): ``lookback`` seconds of run_at, but never more than the last
    ``rows`` rows this worker claimed, so that draining a backlog (where thousands of rows share
    a run_at) does not re-read thousands of dead entries per claim. Higher and lower priorities
    are always read from their start. Rows further behind (named by a notification or a
    promotion, or found by ``behind``) move the floor back to them (``rewind``), not to the
    queue's start, which a held transaction can put millions of dead entries away. Short claims
    keep the cursor: at light load nearly every claim is short.
    """

    def __init__(self, lookback: float, rows: int = 1000) -> None:
        self.lookback = timedelta(seconds=lookback)
        self.rows = rows
        self._last: dict[str, tuple[int, datetime, int]] = {}
        self._recent: dict[str, deque[tuple[datetime, int]]] = {}
        self._back: dict[str, datetime] = {}  # a floor moved back by rewind, until a claim

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
        back = self._back.get(queue)
        if back is not None and back < floor[0]:
            floor = (back, 0)
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
        self._back.pop(queue, None)  # this claim read from there; what it left comes after it

    def passed(self, queue: str, earliest: int) -> bool:
        """Whether a row with this run_at (microseconds since the epoch) may lie behind the floor
        of ``queue``, where the next claim would not find it."""
        if queue not in self._last:
            return False
        floor = self.position(queue)[1]
        return earliest <= (floor - _EPOCH) // _MICROSECOND

    def rewind(self, queue: str, earliest: int) -> None:
        """Rows with this run_at (microseconds since the epoch) or later may wait in ``queue``:
        the next claim reads the cursor's priority from there, if that is behind its floor."""
        if self.passed(queue, earliest):
            first = (_EARLIEST - _EPOCH) // _MICROSECOND
            at = _EPOCH + timedelta(microseconds=max(earliest - 1, first))
            self._back[queue] = min(self._back.get(queue, at), at)

    def reset(self, queue: str) -> None:
        self._last.pop(queue, None)
        self._recent.pop(queue, None)
        self._back.pop(queue, None)

    def placed(self) -> list[str]:
        """The queues that have a position (the others are read from their start anyway)."""
        return list(self._last)


@dataclass(slots=True, frozen=True)
class Pace:
    """Starts of one rate-limited queue taken ahead of a claim (``pace_ahead``), for that claim:
    ``n`` of them from ``m``, ``gap`` seconds apart after ``burst`` at once (see take_starts in
    schema/0024); ``wait`` says when the rate allows more, when it allowed fewer than asked."""

    queue: str
    t0: datetime
    m: datetime | None
    gap: float
    burst: int
    n: int
    wait: float | None
    end: datetime | None


@dataclass(slots=True)
class Promoted:
    count: int
    next_due_in: float | None  # seconds until the next scheduled row is due, by the db clock
    queues: list[str] = field(default_factory=list)  # where rows went (up to 50 queues)
    earliest: int | None = None  # the earliest run_at among them, microseconds since the epoch


def promote(conn: psycopg.Connection, schema: str, *, limit: int, channel: str) -> Promoted:
    """scheduled -> queued for due rows, and when the next one is due."""
    row = conn.execute(
        statements(schema)["promote"], {"limit": limit, "channel": channel}
    ).fetchone()
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


def make_due(conn: psycopg.Connection, schema: str, *, until: datetime) -> int:
    """scheduled -> queued for rows due by ``until`` (worker.testing's clock). Returns how many."""
    return len(conn.execute(statements(schema)["make_due"], {"until": until}).fetchall())


@dataclass(slots=True)
class Taken:
    """What one claim took, and the limited queues it could not take from now: ``waits`` says in
    how many seconds a rate limit allows the next start, ``held`` which concurrency limits are
    full."""

    rows: list[Claimed]
    waits: dict[str, float] = field(default_factory=dict)
    held: set[str] = field(default_factory=set)


# How far ahead a claim takes the starts a rate limit allows: a runner waits for its start.
LOOKAHEAD = 0.5


def pace_ahead(conn: psycopg.Connection, schema: str, queue: str, want: int) -> Pace | None:
    """Take the starts of the next claim of ``queue`` (a queue with a rate and no other limit)
    in a transaction of their own, so that the claim holds no lock on the queue's pace: run
    outside any transaction. None when the queue is not paced ahead (no such limit: the claim
    paces it itself)."""
    row = conn.execute(
        statements(schema)["pace_ahead"],
        {"queue": queue, "want": want, "lookahead": LOOKAHEAD},
    ).fetchone()
    if row is None or row[4] is None:
        return None
    t0, m, gap, burst, n, wait, end = row
    return Pace(queue, t0, m, gap or 0.0, burst or 1, n, wait, end)


def _params(
    queues: Sequence[str],
    limit: int,
    worker_id: str,
    lease_seconds: float,
    cursor: ClaimCursor,
    handlers: HandlerLimits,
    pace: Pace | None = None,
) -> dict[str, Any]:
    """The claim statement's parameters: the one place they are built."""
    positions = [cursor.position(name) for name in queues]
    # Every array goes as text (see int_array): psycopg's list adaptation, six lists per claim,
    # was the largest Python cost of a claim at light load, where each claim takes a row or two.
    return {
        "queues": text_array(queues),
        "limit": limit,
        "worker_id": worker_id,
        "lease_seconds": lease_seconds,
        "handler_tasks": handlers.tasks,
        "handler_max_attempts": handlers.max_attempts,
        "cursor_priority": int_array(p[0] for p in positions),
        "floor_run_at": text_array(p[1].isoformat() for p in positions),
        "floor_id": int_array(p[2] for p in positions),
        "lookahead": LOOKAHEAD,
        **pace_params(pace),
    }


def pace_params(pace: Pace | None) -> dict[str, Any]:
    """The claim statement's parameters for the starts taken ahead (all None: none were)."""
    fields = ("queue", "t0", "m", "gap", "burst", "n", "wait", "end")
    return {f"pace_{f}": getattr(pace, f) if pace else None for f in fields}


def claim_all(
    conn: psycopg.Connection,
    schema: str,
    *,
    queues: Sequence[str],
    limit: int,
    worker_id: str,
    lease_seconds: float,
    cursor: ClaimCursor | None = None,
    max_attempts: Mapping[str, int] | HandlerLimits | None = None,
    pace: Pace | None = None,
) -> Taken:
    """queued -> in_progress for up to ``limit`` due rows of ``queues`` (first queues first), in
    claim order within each queue, whatever their limits; one statement whatever the number of
    queues (the claim in claims.sql, where pauses, limits and priorities are its predicates).

    ``max_attempts``: the handlers' settings by task name, for rows whose producer left
    max_attempts to the handler (NULL); rows of other tasks keep NULL (they are handed back).
    ``pace``: starts taken ahead for one of the queues (``pace_ahead``).
    """
    handlers = max_attempts if isinstance(max_attempts, HandlerLimits) else None
    params = _params(
        queues,
        limit,
        worker_id,
        lease_seconds,
        cursor or ClaimCursor(0),
        handlers or HandlerLimits(max_attempts or {}),
        pace,
    )
    rows = conn.execute(statements(schema)["claim"], params).fetchall()
    read = time.monotonic()
    taken = Taken([_claimed(row) for row in rows if row[0] is not None])
    for c in taken.rows:
        if c.start_in is not None:
            c.not_before = read + c.start_in
            c.not_after = c.not_before + (c.slack or 0.0)
    for row in rows:
        if row[0] is None:  # a limited queue held back: (..., queue, ..., wait_seconds, held)
            if row[15] is not None:
                taken.waits[row[5]] = min(float(row[15]), taken.waits.get(row[5], 1e9))
            if row[16]:
                taken.held.add(row[5])
    # UPDATE ... RETURNING does not keep the CTE's order; the cursor and the dispatch need it.
    order = {name: i for i, name in enumerate(queues)}
    taken.rows.sort(key=lambda c: (order.get(c.queue, 0), -c.priority, c.run_at, c.id))
    return taken


def _claimed(row: Sequence[Any]) -> Claimed:
    c = Claimed(*row[:15])
    if row[19] is not None:  # a workflow's step: (dependents, inputs, workflow_id)
        c.dependents, c.inputs, c.workflow_id = row[17], row[18], row[19]
    return c


def claim(
    conn: psycopg.Connection,
    schema: str,
    *,
    queues: Sequence[str],
    limit: int,
    worker_id: str,
    lease_seconds: float,
    cursor: ClaimCursor | None = None,
    max_attempts: Mapping[str, int] | HandlerLimits | None = None,
) -> list[Claimed]:
    """``claim_all``'s rows alone."""
    return claim_all(
        conn,
        schema,
        queues=queues,
        limit=limit,
        worker_id=worker_id,
        lease_seconds=lease_seconds,
        cursor=cursor,
        max_attempts=max_attempts,
    ).rows


def due_queues(conn: psycopg.Connection, schema: str, queues: Sequence[str]) -> list[str]:
    """Of ``queues``, those holding a row ready to claim (a read; it changes nothing)."""
    return [
        r[0]
        for r in conn.execute(statements(schema)["due_queues"], {"queues": list(queues)}).fetchall()
    ]


def behind(
    conn: psycopg.Connection, schema: str, cursor: ClaimCursor
) -> list[tuple[str, int | None]]:
    """Queues with a claimable row behind the cursor's look-back window (see ClaimCursor), each
    with the earliest such row's run_at in microseconds since the epoch (None: read the queue
    from its start)."""
    names = cursor.placed()
    if not names:
        return []
    positions = [cursor.position(n) for n in names]
    rows = conn.execute(
        statements(schema)["behind"],
        {
            "queues": names,
            "cursor_priority": [p[0] for p in positions],
            "floor_run_at": [p[1] for p in positions],
            "floor_id": [p[2] for p in positions],
        },
    ).fetchall()
    return [(r[0], r[1]) for r in rows]


class HandlerLimits:
    """A worker's max_attempts by task name, as the claim's two array parameters, written once
    (they change only when the worker's handlers do)."""

    __slots__ = ("max_attempts", "tasks")

    def __init__(self, limits: Mapping[str, int]) -> None:
        self.tasks = text_array(limits)
        self.max_attempts = int_array(limits.values())


def wake_handed_back(conn: psycopg.Connection, schema: str, tasks: Sequence[str]) -> None:
    """Rows of ``tasks`` that workers without a handler handed back become due now: a worker
    that has the handlers just started."""
    if tasks:
        conn.execute(statements(schema)["wake_handed_back"], {"tasks": list(tasks)})


def explain_claim(
    conn: psycopg.Connection, schema: str, prefix: Any, *, queue: str, limit: int
) -> Any:
    """``prefix`` (an EXPLAIN) of the claim a fresh worker would make of ``queue``, run for real:
    the caller rolls back the transaction it runs in. For ``worker doctor``'s claim probe."""
    # A fresh worker's cursor (the queue's start) and an id no worker has (nothing is fenced out).
    params = _params([queue], limit, str(uuid.uuid4()), 30.0, ClaimCursor(0), HandlerLimits({}))
    row = conn.execute(prefix + statements(schema)["claim"], params, prepare=False).fetchone()
    assert row is not None
    return row[0]
